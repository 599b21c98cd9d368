"""Issue 14 item 4: a podTemplate per component, merged over what the operator renders."""

from __future__ import annotations

from typing import Any

import builders
import pytest
from kube_schemas import validate_manifest

from kuberl.api import ManifestError, parse_resource
from kuberl.cli import main
from kuberl.operator.render.builders import build_for
from kuberl.operator.render.podtemplate import merge
from kuberl.operator.validate.checks import rendered_problems
from tests.test_operator_e2e import (
    API,
    NS,
    _status,
    cluster_and_operator,
    emulated_cluster,
    eventually,
    job,
    running_operator,
)

SECRET_ENV = [
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    {"name": "KUBERL_JOB", "value": "overridden"},
]
OVERRIDE: dict[str, Any] = {
    "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}, "labels": {"team": "rl"}},
    "spec": {
        "priorityClassName": "training",
        "schedulerName": "volcano",
        "imagePullSecrets": [{"name": "regcred"}],
        "nodeSelector": {"pool": "mi300x"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
        "securityContext": {"supplementalGroups": [44, 110]},
        "containers": [
            {
                "name": "trainer",
                "env": SECRET_ENV,
                "envFrom": [{"secretRef": {"name": "aws"}}],
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            },
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.0"},
        ],
    },
}


MI300X = {"replicas": 1, "accelerator": {"profile": "mi300x", "count": 8}}  # the trainer
TUNED = job("tuned", trainer=MI300X)


def _pod(objs: list[dict[str, Any]], kind: str = "Job") -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind)["spec"]["template"]


def test_trainer_pod_template_is_merged_over_the_rendered_pod() -> None:
    plain = _pod(build_for(parse_resource(TUNED)))
    objs = build_for(parse_resource(builders.job_manifest(of=TUNED, trainer={**MI300X, "podTemplate": OVERRIDE})))
    tpl = _pod(objs)
    spec = tpl["spec"]
    assert tpl["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    assert tpl["metadata"]["labels"]["team"] == "rl"
    assert tpl["metadata"]["labels"]["app.kubernetes.io/instance"] == "tuned"  # selector kept
    assert spec["priorityClassName"] == "training" and spec["schedulerName"] == "volcano"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    # kuberl's GPU toleration and affinity stay; the user's toleration is added
    assert spec["tolerations"] == plain["spec"]["tolerations"] + OVERRIDE["spec"]["tolerations"]
    assert spec["affinity"] == plain["spec"]["affinity"]
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    env = {e["name"]: e for e in trainer["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    assert env["KUBERL_JOB"]["value"] == "overridden"
    assert len(trainer["env"]) == len(plain["spec"]["containers"][0]["env"]) + 1
    assert trainer["envFrom"] == [{"secretRef": {"name": "aws"}}]
    assert trainer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert trainer["image"] == plain["spec"]["containers"][0]["image"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "log-shipper"]
    for obj in objs:
        validate_manifest(obj)  # still a valid core/v1 pod template


def test_fleet_pod_template_reaches_leaders_and_workers() -> None:
    fleet = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "big"},
            "spec": {
                "model": {"uri": "m"},
                "engine": {"tensorParallel": 16},
                "accelerator": {"count": 8},
                "podTemplate": {"spec": {"containers": [{"name": "sglang", "env": SECRET_ENV[:1]}]}},
            },
        }
    )
    lws = build_for(fleet)[0]
    for part in ("leaderTemplate", "workerTemplate"):
        c = lws["spec"]["leaderWorkerTemplate"][part]["spec"]["containers"][0]
        assert any(e["name"] == "HF_TOKEN" for e in c["env"]), part


def test_merge_rules() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "volumes": [{"name": "x", "emptyDir": {}}], "drop": 1}
    out = merge(base, {"a": {"c": [3]}, "volumes": [{"name": "x", "emptyDir": {"sizeLimit": "1Gi"}}], "drop": None})
    assert out == {"a": {"b": 1, "c": [3]}, "volumes": [{"name": "x", "emptyDir": {"sizeLimit": "1Gi"}}]}
    assert base["volumes"][0]["emptyDir"] == {}  # inputs untouched


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ({"spec": {"tolerationz": []}}, "unknown field 'tolerationz'; did you mean 'tolerations'?"),
        ({"spec": {"containers": [{"name": "trainer", "envv": []}]}}, "did you mean 'env'?"),
        ({"spec": {"containers": [{"image": "x"}]}}, "needs a name"),
        ({"spec": {"restartPolicy": "Always"}}, "set by the operator"),
        ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}, "selects its pods"),
    ],
)
def test_bad_overrides_are_refused_with_what_to_fix(template: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_resource(builders.job_manifest(of=TUNED, trainer={**MI300X, "podTemplate": template}))
    assert fragment in str(err.value)


def test_a_sidecar_without_an_image_or_a_missing_volume_is_refused_as_the_api_server_would() -> None:
    tpl = {"spec": {"containers": [{"name": "extra"}, {"name": "trainer", "volumeMounts": [
        {"name": "nope", "mountPath": "/x"}]}]}}
    problems = rendered_problems(parse_resource(builders.job_manifest(of=TUNED, trainer={**MI300X, "podTemplate": tpl})))
    assert any("containers[extra].image: Required value" in p for p in problems), problems
    assert any("volume 'nope' not found" in p for p in problems), problems


def _pool(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "tools"}, "spec": spec}


def test_sandbox_override_cannot_leave_pod_security_restricted(tmp_path: Any, capsys: Any) -> None:
    import yaml

    bad = _pool(podTemplate={"spec": {"hostNetwork": True, "containers": [
        {"name": "sandbox", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}})
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert 'Pod Security "restricted"' in err and "hostNetwork" in err and "SYS_ADMIN" in err
    # env from a Secret is fine
    good = _pool(podTemplate={"spec": {"containers": [{"name": "sandbox", "envFrom": [{"secretRef": {"name": "s"}}]}]}})
    assert rendered_problems(parse_resource(good)) == []


async def test_restricted_namespace_refuses_privileged_pods() -> None:
    async with emulated_cluster(restricted_namespaces={NS}) as k:
        dep = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "root", "namespace": NS},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"a": "b"}},
                "template": {
                    "metadata": {"labels": {"a": "b"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                },
            },
        }
        out = await k.create(f"/apis/apps/v1/namespaces/{NS}/deployments", dep)
        cond = next(c for c in out["status"]["conditions"] if c["type"] == "ReplicaFailure")
        assert "violates PodSecurity" in cond["message"] and out["status"]["readyReplicas"] == 0


async def test_operator_applies_the_override() -> None:
    async with cluster_and_operator() as k:
        tuned = job("tuned")
        tuned["spec"]["trainer"]["podTemplate"] = {
            "spec": {"containers": [{"name": "trainer", "env": SECRET_ENV[:1]}]}
        }
        await k.create(f"{API}/agenticrljobs", tuned)
        trainer = await eventually(
            lambda: k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/tuned-trainer"), what="Job"
        )
        env = trainer["spec"]["template"]["spec"]["containers"][0]["env"]
        assert any(e["name"] == "HF_TOKEN" for e in env)


async def test_sandbox_pools_run_in_a_restricted_namespace() -> None:
    async with emulated_cluster(restricted_namespaces={NS}) as k, running_operator(k):
        pool = _pool(replicas=2)
        pool["metadata"]["namespace"] = NS
        await k.create(f"{API}/sandboxpools", pool)

        async def ready() -> bool:
            return (await _status(k, f"{API}/sandboxpools/tools")).get("phase") == "Ready"

        await eventually(ready, what="pool Ready under Pod Security restricted")
