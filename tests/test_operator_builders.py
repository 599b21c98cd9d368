"""Unit tests of the pure manifest builders (no cluster): shape, profiles, security, validity."""

from __future__ import annotations

from pathlib import Path

import builders
import pytest
import yaml
from kube_schemas import validate_manifest

from kuberl.api import AgenticRLJob, RolloutFleet, SandboxPool, load_manifests
from kuberl.operator.render.builders import build_for, engine_selector
from kuberl.operator.render.engines import CPU_KV_CACHE_BYTES
from kuberl.operator.render.job_builder import resolved_job_document
from kuberl.operator.render.keda import build_keda_scaled_object
from kuberl.operator.render.render_common import ANNOTATION_AUTOSCALER, CHILD_KINDS, selector_string
from kuberl.operator.render.trainer_runs import NEVER_PRUNED

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


QWEN = "Qwen/Qwen3-14B-Base"
QWEN_FLEET = builders.fleet_manifest(model={"uri": QWEN})
QWEN_JOB = builders.job_manifest(model={"base": QWEN}, data={"train": "s3://d/train.jsonl"})


def _by_kind(objs: list[dict]) -> dict[str, dict]:
    out = {o["kind"]: o for o in objs}
    assert len(out) == len(objs), "one object per kind expected"
    return out


def _container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_valid_manifests(path: Path) -> None:
    count = 0
    for res in load_manifests(path):
        for obj in build_for(res, "ns1"):
            validate_manifest(obj)  # kubernetes-validate --strict, or the CRD/upstream schema
            assert obj["metadata"]["namespace"] == "ns1"
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "kuberl"
            assert labels["app.kubernetes.io/component"] in {"trainer", "rollout", "sandbox"}
            assert labels["app.kubernetes.io/instance"]
            count += 1
    assert count >= 3


def test_validation_is_strict() -> None:
    """The checker itself must reject a typo, or every test above proves nothing."""
    dep = _by_kind(build_for(SandboxPool.model_validate({"metadata": {"name": "p"}, "spec": {}})))["Deployment"]
    _container(dep)["imagePulPolicy"] = "Always"
    with pytest.raises(ValueError, match="imagePulPolicy"):
        validate_manifest(dep)
    job = _by_kind(build_for(builders.job(of=QWEN_JOB, sandbox={"pool": {"replicas": 2}})))["SandboxPool"]
    job["spec"]["replicas"] = -1
    with pytest.raises(ValueError, match="replicas"):
        validate_manifest(job)


def test_sandbox_pool_security_and_egress() -> None:
    pool = SandboxPool.model_validate(
        {
            "metadata": {"name": "tools"},
            "spec": {"replicas": 3, "workersPerPod": 16, "limits": {"timeoutSeconds": 20}},
        }
    )
    objs = _by_kind(build_for(pool))
    dep, svc, netpol = objs["Deployment"], objs["Service"], objs["NetworkPolicy"]
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = _container(dep)["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    args = _container(dep)["args"]
    assert args[args.index("--workers") + 1] == "16" and args[args.index("--pool") + 1] == "tools"
    assert svc["spec"]["ports"][0]["name"] == "http"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert netpol["spec"]["egress"] == [] and "Egress" in netpol["spec"]["policyTypes"]
    assert netpol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # Selector labels must be a subset of the pod labels or the Deployment is rejected.
    assert (
        dep["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_a_default_sandbox_pod_is_guaranteed_with_whole_cpus() -> None:
    """requests == limits for cpu and memory in every container, cpu a whole number: the QoS
    class the kubelet's static CPU manager gives an exclusive cpuset (one CPU per worker)."""
    for spec in ({}, {"workersPerPod": 2}):
        dep = _by_kind(build_for(SandboxPool.model_validate({"metadata": {"name": "p"}, "spec": spec})))["Deployment"]
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            res = c["resources"]
            assert res["requests"] == res["limits"], (c["name"], res)
            assert set(res["limits"]) >= {"cpu", "memory"}
            assert str(res["limits"]["cpu"]).isdigit(), res


def test_fleet_mi300x_profile() -> None:
    fleet = builders.fleet(
        of=QWEN_FLEET,
        replicas=4,
        engine={"tensorParallel": 2, "memFractionStatic": 0.8, "contextLength": 16384, "extraArgs": ["--x"]},
        accelerator={"profile": "mi300x", "count": 2},
    )
    objs = _by_kind(build_for(fleet))
    dep, svc = objs["Deployment"], objs["Service"]
    assert dep["spec"]["replicas"] == 4
    c = _container(dep)
    assert "rocm" in c["image"]
    assert c["resources"]["limits"]["amd.com/gpu"] == "2"
    cmd = c["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    for flag, value in [
        ("--tp", "2"),
        ("--mem-fraction-static", "0.8"),
        ("--context-length", "16384"),
        ("--port", "30000"),
        ("--host", "0.0.0.0"),
        ("--model-path", "Qwen/Qwen3-14B-Base"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-metrics" in cmd and cmd[-1] == "--x"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pod = dep["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    keys = {
        e["key"]
        for t in pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        for e in t["matchExpressions"]
    }
    assert "amd.com/gpu.product-name" in keys
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["name"] == "http"


def test_fleet_h100_and_cpu_profiles() -> None:
    h100 = _container(_by_kind(build_for(builders.fleet(of=QWEN_FLEET, accelerator={"profile": "h100", "count": 1})))["Deployment"])
    assert h100["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "40Gi"} and "cu12" in h100["image"]
    cpu_dep = _by_kind(build_for(builders.fleet(of=QWEN_FLEET, accelerator={"profile": "cpu", "count": 1})))["Deployment"]
    c = _container(cpu_dep)
    assert not any("gpu" in k for part in c.get("resources", {}).values() for k in part)
    assert "affinity" not in cpu_dep["spec"]["template"]["spec"]
    assert c["command"][c["command"].index("--device") + 1] == "cpu"


def test_vllm_fleet_runs_vllms_server_with_its_rl_routes_and_metrics() -> None:
    fleet = builders.fleet(
        of=QWEN_FLEET,
        replicas=2,
        engine={"type": "vllm", "tensorParallel": 2, "memFractionStatic": 0.9, "contextLength": 16384},
        accelerator={"profile": "h100", "count": 2},
        autoscaling={"minReplicas": 1, "maxReplicas": 4},
    )
    objs = _by_kind(build_for(fleet))
    dep = objs["Deployment"]
    validate_manifest(dep)
    c = _container(dep)
    assert c["name"] == "vllm" and c["image"].startswith("vllm/vllm-openai:")
    cmd = c["command"]
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]  # not the console script
    for flag, value in [
        ("--model", "Qwen/Qwen3-14B-Base"),
        ("--tensor-parallel-size", "2"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-model-len", "16384"),
        ("--port", "30000"),
        ("--served-model-name", "f"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-prefix-caching" in cmd and "--enable-metrics" not in cmd
    assert "--enable-scale-out" in cmd  # /inference/v1/generate: the answers' weight labels
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["timeoutSeconds"] >= 5
    mi = _container(_by_kind(build_for(builders.fleet(of=QWEN_FLEET, engine={"type": "vllm"})))["Deployment"])
    assert "rocm" in mi["image"]
    cpu = _container(_by_kind(build_for(builders.fleet(of=QWEN_FLEET, engine={"type": "vllm"}, accelerator={"profile": "cpu"})))["Deployment"])
    assert "--no-enable-chunked-prefill" in cpu["command"]
    # an explicit KV cache on CPUs (else vLLM reserves a fraction of the whole node), which the
    # fleet's extraArgs override (they come later)
    assert cpu["command"][cpu["command"].index("--kv-cache-memory-bytes") + 1] == str(CPU_KV_CACHE_BYTES)
    assert "--kv-cache-memory-bytes" not in _container(dep)["command"]  # GPUs size it by memFractionStatic
    tuned = _container(_by_kind(build_for(builders.fleet(
        of=QWEN_FLEET, engine={"type": "vllm", "extraArgs": ["--kv-cache-memory-bytes", "123"]},
        accelerator={"profile": "cpu"})))["Deployment"])["command"]
    assert tuned[-2:] == ["--kv-cache-memory-bytes", "123"]
    assert tuned.index("--kv-cache-memory-bytes") < len(tuned) - 2
    # KEDA reads vLLM's own gauges for this fleet
    queries = [t["metadata"]["query"] for t in build_keda_scaled_object(fleet, "ns")["spec"]["triggers"]]
    assert queries[0].startswith("(avg(vllm:kv_cache_usage_perc{") and queries[1].startswith(
        "(sum(vllm:num_requests_waiting{"
    )


def test_sglang_probes_allow_for_a_generating_health_check() -> None:
    c = _container(_by_kind(build_for(builders.fleet(of=QWEN_FLEET)))["Deployment"])
    assert c["name"] == "sglang"
    assert all(c[p]["timeoutSeconds"] >= 10 for p in ("startupProbe", "readinessProbe", "livenessProbe"))


def test_trainer_pods_learn_the_fleets_engine_type() -> None:
    job = builders.job(of=QWEN_JOB, rollout={"engine": "vllm", "fleet": {"replicas": 1}})
    assert job.spec.rollout.fleet is not None and job.spec.rollout.fleet.engine.type == "vllm"
    objs = build_for(job)
    fleet = next(o for o in objs if o["kind"] == "RolloutFleet")
    assert fleet["spec"]["engine"]["type"] == "vllm"
    trainer = next(o for o in objs if o["kind"] == "Job")
    env = {e["name"]: e.get("value") for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBERL_ROLLOUT_ENGINE"] == "vllm"


def test_fleet_spanning_nodes_is_a_leaderworkerset() -> None:
    fleet = builders.fleet(of=QWEN_FLEET, replicas=2, engine={"tensorParallel": 16}, accelerator={"profile": "mi300x", "count": 8})
    objs = _by_kind(build_for(fleet))
    lws, svc = objs["LeaderWorkerSet"], objs["Service"]
    validate_manifest(lws)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 2 and tmpl["size"] == 2
    leader = tmpl["leaderTemplate"]["spec"]["containers"][0]
    worker = tmpl["workerTemplate"]["spec"]["containers"][0]
    assert "--nnodes" in leader["command"] and "$(LWS_LEADER_ADDRESS):20000" in leader["command"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert svc["spec"]["selector"]["kuberl.io/role"] == "leader"
    assert svc["spec"]["selector"] == engine_selector(fleet)
    assert engine_selector(builders.fleet(of=QWEN_FLEET)) == _by_kind(build_for(builders.fleet(of=QWEN_FLEET)))["Service"]["spec"]["selector"]


@pytest.mark.parametrize("profile", ["mi300x", "h100", "cpu"])
def test_engines_return_temperature_1_logprobs(profile: str) -> None:
    """GRPO-RoC's importance ratio divides by the sampler's logprob of the policy at T=1."""
    for tp, count in ((1, 1), (16, 8)):
        fleet = builders.fleet(of=QWEN_FLEET, engine={"tensorParallel": tp}, accelerator={"profile": profile, "count": count})
        for obj in build_for(fleet):
            templates = (
                [obj["spec"]["template"]]
                if obj["kind"] == "Deployment"
                else [obj["spec"]["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate")]
                if obj["kind"] == "LeaderWorkerSet"
                else []
            )
            for t in templates:
                env = {e["name"]: e.get("value") for e in t["spec"]["containers"][0]["env"]}
                assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"


def test_child_kinds_cover_everything_the_builders_emit() -> None:
    """The operator deletes stale children by kind: a kind missing here would never be pruned."""
    resources = [
        *(r for path in EXAMPLES for r in load_manifests(path)),
        builders.fleet(of=QWEN_FLEET, engine={"tensorParallel": 16}, accelerator={"profile": "h100", "count": 8}),
        builders.job(of=QWEN_JOB, rollout={"fleet": {"replicas": 1}}, sandbox={"pool": {"replicas": 1}}),
    ]
    for res in resources:
        emitted = {(o["apiVersion"], o["kind"]) for o in build_for(res) if o["kind"] != "ScaledObject"}
        emitted -= NEVER_PRUNED  # the checkpoint volume goes with its job only
        assert emitted <= set(CHILD_KINDS[res.KIND]), (res.KIND, emitted - set(CHILD_KINDS[res.KIND]))


def test_the_trainer_pod_meets_pod_security_restricted_and_owns_its_checkpoints() -> None:
    """The trainer images' non-root user, a read-only root with /tmp (HOME) writable, fsGroup for
    the checkpoint claim (a fresh volume's root is root's), and a grace period to end its step and
    write the checkpoint it resumes from."""
    objs = _by_kind(build_for(builders.job(of=QWEN_JOB, trainer={"accelerator": {"profile": "cpu", "count": 1}})))
    pod = objs["Job"]["spec"]["template"]["spec"]
    sc, csc = pod["securityContext"], _container(objs["Job"])["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == sc["fsGroup"] == 65532
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"]: m["name"] for m in _container(objs["Job"])["volumeMounts"]}
    assert {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]["emptyDir"] == {}
    env = {e["name"]: e.get("value") for e in _container(objs["Job"])["env"]}
    assert env["HOME"] == "/tmp"
    assert pod["terminationGracePeriodSeconds"] >= 120


def test_job_trainer_rendezvous_and_config() -> None:
    job = builders.job(
        of=QWEN_JOB,
        trainer={"replicas": 4, "accelerator": {"profile": "mi300x", "count": 8}},
        rollout={"fleetRef": "shared"},
        sandbox={"poolRef": "tools"},
    )
    objs = _by_kind(build_for(job, "team"))
    # refs: no inline children
    assert set(objs) == {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Job", "PersistentVolumeClaim"
    }
    assert objs["Role"]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert (
        objs["Job"]["spec"]["template"]["spec"]["serviceAccountName"]
        == objs["ServiceAccount"]["metadata"]["name"]
    )
    cm, svc, trainer = objs["ConfigMap"], objs["Service"], objs["Job"]
    doc = yaml.safe_load(cm["data"]["job.yaml"])
    assert AgenticRLJob.model_validate(doc).spec.trainer.replicas == 4  # the trainer can load it
    assert doc["spec"]["algorithm"]["groupSize"] == 16  # defaults resolved
    spec = trainer["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "j-trainer"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    env = {e["name"]: e.get("value") for e in _container(trainer)["env"]}
    assert env["MASTER_ADDR"] == "j-trainer-0.j-trainer.team.svc"
    assert env["KUBERL_SANDBOX_URL"] == "http://tools.team.svc:8080"
    assert env["KUBERL_ROLLOUT_FLEET"] == "shared"
    # 4 pods x 8 GPUs: torchrun starts one rank per GPU in every pod, rendezvous at pod 0.
    assert _container(trainer)["command"] == [
        "python",
        "-m",
        "kuberl.util.relay",  # torchrun's exit 1 on SIGTERM becomes 143
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "kuberl",
        "run",
        "/etc/kuberl/job.yaml",
        "--out",
        "/var/run/kuberl",
    ]
    assert {"NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(env)
    single = _by_kind(build_for(builders.job(of=QWEN_JOB, trainer={"accelerator": {"profile": "h100", "count": 1}})))["Job"]
    assert _container(single)["command"] == [
        "kuberl",
        "run",
        "/etc/kuberl/job.yaml",
        "--out",
        "/var/run/kuberl",
    ]
    assert _container(trainer)["resources"]["limits"]["amd.com/gpu"] == "8"


def test_job_inline_children_and_suspend() -> None:
    job = builders.job(
        of=QWEN_JOB,
        rollout={
            "fleet": {
                "replicas": 2,
                "accelerator": {"profile": "h100", "count": 1},
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
            }
        },
        sandbox={"pool": {"replicas": 3}},
    )
    objs = _by_kind(build_for(job))
    fleet, pool = objs["RolloutFleet"], objs["SandboxPool"]
    assert fleet["metadata"]["name"] == "j-rollout" and pool["metadata"]["name"] == "j-sandbox"
    assert fleet["spec"]["model"]["uri"] == "Qwen/Qwen3-14B-Base"  # defaults to model.base
    assert RolloutFleet.model_validate(fleet).spec.replicas == 2
    doc = resolved_job_document(job, "default")
    assert doc["spec"]["rollout"] == {**doc["spec"]["rollout"], "fleetRef": "j-rollout"}
    assert "fleet" not in doc["spec"]["rollout"] and doc["spec"]["sandbox"]["poolRef"] == "j-sandbox"

    suspended = _by_kind(
        build_for(job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})}))
    )
    assert suspended["Job"]["spec"]["suspend"] is True
    assert (
        suspended["RolloutFleet"]["spec"]["replicas"] == 0
        and "autoscaling" not in suspended["RolloutFleet"]["spec"]
    )
    assert suspended["SandboxPool"]["spec"]["replicas"] == 0
    for obj in suspended.values():
        validate_manifest(obj)


def test_config_change_changes_pod_template_hash() -> None:
    a = _by_kind(build_for(builders.job(of=QWEN_JOB)))["Job"]["spec"]["template"]["metadata"]["annotations"]
    b = _by_kind(build_for(builders.job(of=QWEN_JOB, seed=7)))["Job"]["spec"]["template"]["metadata"]["annotations"]
    assert a["kuberl.io/config-hash"] != b["kuberl.io/config-hash"]


def test_keda_scaled_objects() -> None:
    pool = SandboxPool.model_validate(
        {
            "metadata": {"name": "p", "annotations": {ANNOTATION_AUTOSCALER: "keda"}},
            "spec": {
                "replicas": 2,
                "workersPerPod": 8,
                "autoscaling": {"minReplicas": 1, "maxReplicas": 10, "targetQueuePerWorker": 2},
            },
        }
    )
    objs = _by_kind(build_for(pool))
    so = objs["ScaledObject"]
    validate_manifest(so)
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "SandboxPool",
        "name": "p",
    }
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 10)
    queue, busy, announced = so["spec"]["triggers"]
    assert queue["type"] == "prometheus" and queue["metricType"] == "AverageValue"
    # One pool's series only: same-named pools in other namespaces are not summed in.
    assert queue["metadata"]["query"] == 'sum(kuberl_sandbox_queue_depth{namespace="default",pool="p"}) / 8'
    assert queue["metadata"]["threshold"] == "2"
    # Work in flight keeps its pods, as in autoscale.recommend_pool: ceil(busy / workersPerPod).
    assert busy["metadata"]["query"] == 'sum(kuberl_sandbox_workers_busy{namespace="default",pool="p"})'
    assert busy["metricType"] == "AverageValue" and busy["metadata"]["threshold"] == "8"
    # the trainers' announced rollout phase, as autoscale.phase_floor: ceil(workers / workersPerPod)
    assert announced["metadata"]["query"] == 'sum(kuberl_rollout_phase_workers{namespace="default",pool="p"})'
    assert announced["metricType"] == "AverageValue" and announced["metadata"]["threshold"] == "8"
    fleet = builders.fleet(of=QWEN_FLEET, autoscaling={"minReplicas": 1, "maxReplicas": 8, "scaleDownStabilizationSeconds": 120})
    fso = build_keda_scaled_object(fleet, "ns")
    validate_manifest(fso)
    queries = [t["metadata"]["query"] for t in fso["spec"]["triggers"]]
    # By the instance label the chart's monitors copy onto the series: a pod-name regex
    # ("f-.*") would also match a fleet called "f-x".
    assert queries[0].startswith('(avg(sglang:token_usage{namespace="ns",app_kubernetes_io_instance="f"}) unless')
    assert queries[1].startswith('(sum(sglang:num_queue_reqs{namespace="ns",app_kubernetes_io_instance="f"}) unless')
    # the asynchronous trainers' pipeline, a Value metric against 1 (tests/test_keda_queries.py
    # evaluates it in a real Prometheus)
    pipeline = fso["spec"]["triggers"][2]
    assert pipeline["metricType"] == "Value" and pipeline["metadata"]["threshold"] == "1"
    assert 'kuberl_train_rollout_wait_ratio{namespace="ns",fleet="f"}' in queries[2]
    assert fso["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 120
    }
    with pytest.raises(ValueError, match="autoscaling is not set"):
        build_keda_scaled_object(builders.fleet(of=QWEN_FLEET))
    with pytest.raises(ValueError, match="no autoscaling"):
        build_keda_scaled_object(builders.job(of=QWEN_JOB))


def test_selector_string_is_sorted_and_stable() -> None:
    assert selector_string({"b": "2", "a": "1"}) == "a=1,b=2"


def test_cli_render_prints_every_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    from kuberl.cli import main

    assert main(["render", str(REPO / "examples" / "rstar2-mi300x.yaml"), "--namespace", "rl"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "Secret"]
        + ["Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"]
        + ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Job"]
    )
    assert {d["metadata"]["namespace"] for d in docs} == {"rl"}


def test_operator_deployment_and_rbac() -> None:
    from kuberl.operator.render.builders import build_operator

    objs = _by_kind(build_operator("kuberl-system"))
    for obj in objs.values():
        validate_manifest(obj)
    rules = objs["ClusterRole"]["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    # Everything the builders emit must be writable by the operator.
    for res in [
        *load_manifests(REPO / "examples" / "rstar2-mi300x.yaml"),
        *load_manifests(REPO / "examples" / "h100-inline.yaml"),
    ]:
        for obj in build_for(res):
            group = obj["apiVersion"].rpartition("/")[0]
            plural = {"NetworkPolicy": "networkpolicies"}.get(obj["kind"], obj["kind"].lower() + "s")
            assert (group, plural) in granted, obj["kind"]
    assert ("kuberl.io", "sandboxpools/scale") in granted and ("", "events") in granted
    # Webhook configurations only when admission is on (it is off in this Deployment).
    assert ("admissionregistration.k8s.io", "validatingwebhookconfigurations") not in granted
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kuberl-operator"
    c = pod["containers"][0]
    assert c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert {"name": "KUBERL_OPERATOR_METRICS_PORT", "value": "8080"} in c["env"]


def _mounts(obj: dict) -> dict[str, dict]:
    pod = obj["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    return {m["mountPath"]: {**m, "claim": claims.get(m["name"])} for m in _container(obj)["volumeMounts"]}


def test_weight_sync_volume_is_written_by_the_trainer_and_read_by_the_engines() -> None:
    ws = {"claimName": "policy-rwx", "mountPath": "/weights"}
    fleet_spec = {
        "model": {"uri": "Qwen/Qwen3-14B-Base"},
        "weightSync": ws,
        "scheduler": {"policy": "least-requests"},
    }
    inline = _by_kind(build_for(builders.job(of=QWEN_JOB, rollout={"fleet": fleet_spec})))
    child = RolloutFleet.model_validate({"metadata": {"name": "c"}, "spec": inline["RolloutFleet"]["spec"]})
    engines = _by_kind(build_for(child))["Deployment"]
    assert _mounts(engines)["/weights"] == {
        "name": "policy-weights", "mountPath": "/weights", "readOnly": True, "claim": "policy-rwx"
    }  # fmt: skip
    for trainer in (
        inline["Job"],
        # A referenced fleet: the operator passes the spec it read from the cluster.
        _by_kind(build_for(builders.job(of=QWEN_JOB, rollout={"fleetRef": "shared"}), fleet=child.spec))["Job"],
    ):
        mount = _mounts(trainer)["/weights"]
        assert mount["claim"] == "policy-rwx" and not mount.get("readOnly")
        env = {e["name"]: e.get("value") for e in _container(trainer)["env"]}
        assert env["KUBERL_WEIGHTS_DIR"] == "/weights"
        assert env["KUBERL_SCHEDULER_POLICY"] == "least-requests"
        validate_manifest(trainer)
    validate_manifest(engines)
    # An unknown referenced fleet: no mount, no policy; the trainer says what is missing.
    bare = _by_kind(build_for(builders.job(of=QWEN_JOB, rollout={"fleetRef": "shared"})))["Job"]
    env = {e["name"] for e in _container(bare)["env"]}
    assert "/weights" not in _mounts(bare) and "KUBERL_WEIGHTS_DIR" not in env and "KUBERL_NAMESPACE" in env
