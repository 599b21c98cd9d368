"""The operator end to end on a real control plane: kube-apiserver with RBAC, the real controllers
and scheduler, kwok's simulated nodes (see k8s_fixtures). The operator runs under the Helm chart's
ServiceAccount and RBAC, so a verb the chart does not grant fails here as on a cluster.

Each test uses a namespace of its own; the examples are applied with `kubectl apply -f` as a user
would, unchanged except for that namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8s_fixtures import Kube, new_namespace, running_ready, wait_for

from kuberl.cluster.nodes import FAIL_LABEL

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
OWNER = "app.kubernetes.io/managed-by=kuberl"
TIMEOUT = 90


@pytest.fixture
def namespace(kube):
    """A function making a fresh namespace; each is deleted (with all it holds) after the test, so
    the simulated nodes' GPUs and CPUs are free for the next one."""
    made: list[str] = []

    def make(prefix: str) -> str:
        ns = new_namespace(kube, prefix)
        made.append(ns)
        return ns

    yield make
    for ns in made:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)
    # a pod releases its node's resources only once gone, and the namespace controller takes
    # its time: the pods go at once (a terminating namespace admits no new ones), the rest of
    # each namespace in the background
    for ns in made:
        kube.run("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", "--wait=false", check=False)
    for ns in made:
        gone = kube.run("wait", "--for=delete", "pods", "--all", "-n", ns, "--timeout=60s", check=False)
        assert gone.returncode == 0 or not pods_of(kube, ns, ""), f"pods of {ns} still there: {gone.stderr}"


def example_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def status(kube: Kube, kind: str, name: str, ns: str) -> dict:
    return kube.json("get", kind, name, "-n", ns).get("status") or {}


def ready_condition(obj_status: dict) -> dict:
    return next((c for c in obj_status.get("conditions", []) if c["type"] == "Ready"), {})


def pods_of(kube: Kube, ns: str, selector: str = OWNER) -> list[dict]:
    return kube.items("pods", ns, selector)


def seen(kube: Kube, ns: str, operator=None) -> str:
    """What a timed-out wait shows: the namespace's objects and events, the operator's last lines."""
    out = kube.run("get", "all,pvc,events", "-n", ns, "-o", "wide", check=False).stdout
    if operator is not None and operator.log.exists():
        out += "\n--- operator log\n" + "\n".join(operator.log.read_text(errors="replace").splitlines()[-40:])
    return out


def node_of(kube: Kube, pod: dict) -> dict:
    return kube.json("get", "node", pod["spec"]["nodeName"])


def prerequisites(kube: Kube, ns: str, docs: list[dict]) -> None:
    """What an example's comments ask the user to create first: a fleet's weight-sync claim."""
    for d in docs:
        fleets = [d["spec"]] if d["kind"] == "RolloutFleet" else []
        fleets += [d["spec"]["rollout"]["fleet"]] if d["kind"] == "AgenticRLJob" and (
            d["spec"].get("rollout", {}).get("fleet")) else []
        for fleet in fleets:
            claim = (fleet.get("weightSync") or {}).get("claimName")
            if claim:
                kube.apply([{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                             "metadata": {"name": claim, "namespace": ns},
                             "spec": {"accessModes": ["ReadWriteMany"],
                                      "resources": {"requests": {"storage": "10Gi"}}}}])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_applies_and_every_pod_runs_on_the_right_nodes(kube, kuberl_operator, namespace, example):
    ns = namespace(example.stem)
    docs = example_docs(example)
    prerequisites(kube, ns, docs)
    kube.run("apply", "-n", ns, "-f", str(example))
    jobs = [d["metadata"]["name"] for d in docs if d["kind"] == "AgenticRLJob"]

    def all_running() -> list[dict] | None:
        pods = pods_of(kube, ns)
        trainers = [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "trainer"]
        if len(trainers) < len(jobs) or not pods or not all(running_ready(p) for p in pods):
            return None
        return pods

    pods = wait_for(all_running, TIMEOUT, lambda: f"every pod of {example.name} Running and Ready\n"
                    + seen(kube, ns, kuberl_operator))
    for pod in pods:
        node = node_of(kube, pod)
        labels = node["metadata"]["labels"]
        limits = {k: v for c in pod["spec"]["containers"] for k, v in (c["resources"].get("limits") or {}).items()}
        kind = labels["node.kubernetes.io/instance-type"]
        if "amd.com/gpu" in limits:
            assert kind == "mi300x", f"{pod['metadata']['name']} asks for amd.com/gpu but runs on {kind}"
        elif "nvidia.com/gpu" in limits:
            assert kind == "h100", f"{pod['metadata']['name']} asks for nvidia.com/gpu but runs on {kind}"
        else:
            assert kind == "cpu", f"{pod['metadata']['name']} needs no GPU but runs on a {kind} node"

    # every kuberl object reports Ready (jobs: their trainer pods all ready) for its generation
    for kind in ("agenticrljobs", "rolloutfleets", "sandboxpools"):
        for obj in kube.items(kind, ns):
            name, gen = obj["metadata"]["name"], obj["metadata"]["generation"]

            def reported(kind=kind, name=name, gen=gen) -> dict | None:
                st = status(kube, kind, name, ns)
                ok = ready_condition(st).get("status") == "True"
                return st if ok and st.get("observedGeneration") == gen else None

            st = wait_for(reported, TIMEOUT, f"{kind}/{name} Ready at generation {gen}")
            assert st["phase"] in ("Running", "Ready"), st
    # the printer columns read what the status holds
    table = kube.run("get", "arj,rf,sbx", "-n", ns).stdout
    for kind in ("sandboxpools", "rolloutfleets"):
        for obj in kube.items(kind, ns):
            row = next(line.split() for line in table.splitlines() if line.startswith(f"{kind[:-1]}.kuberl.io/"
                                                                                      f"{obj['metadata']['name']} "))
            assert row[1] == str(obj["spec"]["replicas"]) and row[2] == str(obj["status"]["readyReplicas"]), table
    for job in jobs:
        row = next(line.split() for line in table.splitlines() if line.startswith(f"agenticrljob.kuberl.io/{job} "))
        assert row[1] == "Running", table


def test_pods_the_scheduler_cannot_place_are_reported_with_its_reason(kube, kuberl_operator, namespace):
    """The fleet's weight-sync claim does not exist: the engines stay Pending, and the fleet's
    and the job's Ready conditions carry the scheduler's own reason."""
    ns = namespace("unschedulable")
    kube.run("apply", "-n", ns, "-f", str(REPO / "examples" / "rstar2-mi300x.yaml"))

    def said(kind: str, name: str) -> str | None:
        cond = ready_condition(status(kube, kind, name, ns))
        return cond.get("message") if cond.get("reason") == "Unschedulable" else None

    msg = wait_for(lambda: said("rolloutfleet", "qwen3-14b"), TIMEOUT, "the fleet saying why its pods wait")
    assert 'persistentvolumeclaim "rstar2-policy-weights" not found' in msg, msg
    msg = wait_for(lambda: said("agenticrljob", "rstar2-agent-14b"), TIMEOUT, "the job saying why its trainer waits")
    assert "rstar2-policy-weights" in msg, msg


def test_children_are_owned_and_match_the_render(kube, kuberl_operator, namespace, tmp_path):
    """The objects the operator made are what `kuberl render` prints, owned by the kuberl object."""
    ns = namespace("owned")
    prerequisites(kube, ns, example_docs(REPO / "examples" / "rstar2-mi300x.yaml"))
    kube.run("apply", "-n", ns, "-f", str(REPO / "examples" / "rstar2-mi300x.yaml"))
    rendered = [d for d in yaml.safe_load_all(subprocess.run(
        [sys.executable, "-P", "-m", "kuberl", "render", str(REPO / "examples" / "rstar2-mi300x.yaml")],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout) if d]
    expected = {(d["kind"], d["metadata"]["name"]) for d in rendered if d["kind"] not in ("RolloutFleet", "SandboxPool")}
    plural = {"Deployment": "deployments", "Service": "services", "NetworkPolicy": "networkpolicies",
              "PodDisruptionBudget": "poddisruptionbudgets", "Secret": "secrets", "ServiceAccount": "serviceaccounts",
              "Role": "roles", "RoleBinding": "rolebindings", "ConfigMap": "configmaps", "Job": "jobs",
              "PersistentVolumeClaim": "persistentvolumeclaims"}
    assert {k for k, _ in expected} <= set(plural), expected

    def made() -> set | None:
        found = {(k, o["metadata"]["name"]) for k in {k for k, _ in expected}
                 for o in kube.items(plural[k], ns)}
        return found if expected <= found else None

    wait_for(made, TIMEOUT, f"the operator's children in {ns}: {sorted(expected)}")
    uids = {(o["kind"], o["metadata"]["name"]): o["metadata"]["uid"]
            for kind in ("agenticrljobs", "rolloutfleets", "sandboxpools") for o in kube.items(kind, ns)}
    for kind, name in expected:
        obj = kube.json("get", plural[kind], name, "-n", ns)
        owners = obj["metadata"].get("ownerReferences") or []
        assert any(o.get("controller") and uids.get((o["kind"], o["name"])) == o["uid"] for o in owners), (
            f"{kind}/{name} has no controller owner among the kuberl objects: {owners}")


def test_kubectl_scale_sandboxpool_goes_through_the_scale_subresource(kube, kuberl_operator, namespace):
    ns = namespace("scale")
    pool = next(d for d in example_docs(REPO / "examples" / "rstar2-mi300x.yaml") if d["kind"] == "SandboxPool")
    pool["spec"]["replicas"] = 2
    pool["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 6}
    pool["spec"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    pool["metadata"]["namespace"] = ns
    kube.apply([pool])
    name = pool["metadata"]["name"]
    selector = f"app.kubernetes.io/instance={name}"

    def ready_pods(n: int):
        return lambda: (len(p := [x for x in pods_of(kube, ns, selector) if running_ready(x)]) == n
                        and len(pods_of(kube, ns, selector)) == n and p)

    wait_for(ready_pods(2), TIMEOUT, f"2 ready pods of {name}")
    # the operator writes status.selector in the status pass after it made the pods, which may
    # come after they are Ready: the scale subresource reads it from there
    wait_for(lambda: status(kube, "sandboxpool", name, ns).get("selector"), TIMEOUT, "status.selector")
    scale = json.loads(kube.run("get", "--raw", f"/apis/kuberl.io/v1alpha1/namespaces/{ns}/sandboxpools/{name}/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"], scale  # labelSelectorPath: what an HPA's selector reads

    kube.run("scale", f"sandboxpool/{name}", "-n", ns, "--replicas=5")
    assert kube.json("get", "sandboxpool", name, "-n", ns)["spec"]["replicas"] == 5
    wait_for(ready_pods(5), TIMEOUT, f"5 ready pods of {name} after kubectl scale")
    wait_for(lambda: status(kube, "sandboxpool", name, ns).get("readyReplicas") == 5, TIMEOUT,
             "status.readyReplicas 5")
    kube.run("scale", f"sandboxpool/{name}", "-n", ns, "--replicas=1")
    wait_for(ready_pods(1), TIMEOUT, f"1 pod of {name} after scaling down")
    # beyond the autoscaling bounds: the CRD's rule refuses it through the scale subresource too
    out = kube.run("scale", f"sandboxpool/{name}", "-n", ns, "--replicas=7", check=False)
    assert out.returncode != 0 and "autoscaling.maxReplicas" in out.stderr, out.stderr


def test_the_hpa_controller_scales_a_sandboxpool(kube, kuberl_operator, namespace):
    """The real HPA controller drives a SandboxPool through its scale subresource (no metrics
    server here: it applies minReplicas, which it does before reading any metric)."""
    ns = namespace("hpa")
    kube.apply([{"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool",
                 "metadata": {"name": "tools", "namespace": ns},
                 "spec": {"replicas": 1, "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                                       "limits": {"memory": "2Gi"}}}}])
    wait_for(lambda: status(kube, "sandboxpool", "tools", ns).get("selector"), TIMEOUT,
             "status.selector (the scale subresource's labelSelectorPath)")
    kube.apply([{"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                 "metadata": {"name": "tools", "namespace": ns},
                 "spec": {"scaleTargetRef": {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "name": "tools"},
                          "minReplicas": 3, "maxReplicas": 6,
                          "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                              "type": "Utilization", "averageUtilization": 80}}}]}}])
    wait_for(lambda: kube.json("get", "sandboxpool", "tools", "-n", ns)["spec"]["replicas"] == 3, TIMEOUT,
             lambda: "the HPA controller setting replicas 3\n" + kube.run("describe", "hpa", "tools", "-n", ns).stdout)
    wait_for(lambda: len([p for p in pods_of(kube, ns, "app.kubernetes.io/instance=tools") if running_ready(p)]) == 3,
             TIMEOUT, "3 ready sandbox pods")


def test_spec_edit_and_drift_are_repaired(kube, kuberl_operator, namespace):
    ns = namespace("drift")
    pool = next(d for d in example_docs(REPO / "examples" / "rstar2-mi300x.yaml") if d["kind"] == "SandboxPool")
    pool["metadata"]["namespace"] = ns
    pool["spec"]["replicas"] = 1
    pool["spec"].pop("autoscaling", None)
    pool["spec"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    kube.apply([pool])
    name = pool["metadata"]["name"]
    wait_for(lambda: status(kube, "sandboxpool", name, ns).get("observedGeneration") == 1, TIMEOUT,
             "observedGeneration 1")

    # a spec edit: a new generation, the Deployment follows, observedGeneration catches up
    kube.run("patch", "sandboxpool", name, "-n", ns, "--type=merge",
             "-p", json.dumps({"spec": {"limits": {"timeoutSeconds": 12}}}))
    gen = kube.json("get", "sandboxpool", name, "-n", ns)["metadata"]["generation"]
    assert gen == 2
    wait_for(lambda: status(kube, "sandboxpool", name, ns).get("observedGeneration") == gen, TIMEOUT,
             f"observedGeneration {gen}")

    def deployment_env() -> dict:
        dep = kube.json("get", "deployment", name, "-n", ns)
        c = dep["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in c.get("env", [])} | {"_args": " ".join(c.get("args", []))}

    wait_for(lambda: "12" in json.dumps(deployment_env()), TIMEOUT, "the Deployment carrying the new timeout")

    # drift: someone edits the Deployment by hand; the operator puts the spec back
    kube.run("scale", f"deployment/{name}", "-n", ns, "--replicas=3")
    wait_for(lambda: kube.json("get", "deployment", name, "-n", ns)["spec"]["replicas"] == 1, TIMEOUT,
             "the Deployment's replicas repaired to the pool's 1")
    # a deleted child comes back
    kube.run("delete", "service", name, "-n", ns)
    wait_for(lambda: kube.run("get", "service", name, "-n", ns, check=False).returncode == 0, TIMEOUT,
             "the deleted Service recreated")


def test_delete_cascades_through_the_garbage_collector(kube, kuberl_operator, namespace):
    ns = namespace("delete")
    kube.run("apply", "-n", ns, "-f", str(REPO / "examples" / "quickstart.yaml"))
    wait_for(lambda: any(running_ready(p) for p in pods_of(kube, ns)), TIMEOUT,
             lambda: "a running pod\n" + seen(kube, ns, kuberl_operator))
    kube.run("delete", "agenticrljob", "quickstart", "-n", ns, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = kube.run("get", "all,cm,netpol,pdb,pvc,sa,roles,rolebindings,sandboxpools,rolloutfleets", "-n", ns,
                        "-l", OWNER, "-o", "name").stdout.split()
        return not left

    # the checkpoint claim included: the operator never deletes it, its owner reference does
    wait_for(gone, TIMEOUT, f"everything the job owned in {ns} deleted by the garbage collector")


def test_a_failed_trainer_pod_is_reported(kube, kuberl_operator, namespace):
    ns = namespace("fail")
    kube.run("apply", "-n", ns, "-f", str(REPO / "examples" / "quickstart.yaml"))
    selector = "app.kubernetes.io/component=trainer,app.kubernetes.io/instance=quickstart"
    pod = wait_for(lambda: next((p for p in pods_of(kube, ns, selector) if running_ready(p)), None), TIMEOUT,
                   lambda: "the trainer pod running\n" + seen(kube, ns, kuberl_operator))
    # kwok plays the kubelet reporting the trainer's container exited 1
    kube.run("label", "pod", pod["metadata"]["name"], "-n", ns, f"{FAIL_LABEL}=true")
    wait_for(lambda: kube.json("get", "pod", pod["metadata"]["name"], "-n", ns)["status"]["phase"] == "Failed",
             TIMEOUT, "kwok marking the pod Failed")

    def reported() -> dict | None:
        st = status(kube, "agenticrljob", "quickstart", ns)
        msg = json.dumps(st.get("conditions", []))
        return st if (st.get("phase") == "Failed" or "exit" in msg.lower() or st.get("restarts")) else None

    st = wait_for(reported, TIMEOUT, lambda: "the job reporting its trainer's failure\n" + seen(kube, ns, kuberl_operator))
    assert st.get("observedGeneration") == 1


def test_operator_restarted_mid_reconcile_makes_no_duplicates(kube, kuberl_operator, namespace):
    ns = namespace("restart")
    example = REPO / "examples" / "rstar2-mi300x.yaml"
    prerequisites(kube, ns, example_docs(example))
    kuberl_operator.stop(kill=True)
    try:
        kube.run("apply", "-n", ns, "-f", str(example))
        kuberl_operator.start()
        # killed again as soon as it has begun making children
        wait_for(lambda: kube.items("deployments", ns, OWNER), TIMEOUT, "the first children")
        kuberl_operator.stop(kill=True)
    finally:
        kuberl_operator.start()

    def settled() -> list | None:
        pods = pods_of(kube, ns)
        return pods if pods and all(running_ready(p) for p in pods) and len(
            [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "trainer"]) == 4 else None

    wait_for(settled, TIMEOUT, lambda: "the job's pods all running after the restarts\n"
             + kube.run("get", "pods,arj,rf,sbx,deploy,rs", "-n", ns, "-o", "wide").stdout)
    for kind in ("deployments", "services", "jobs", "configmaps", "networkpolicies", "poddisruptionbudgets"):
        names = [o["metadata"]["name"] for o in kube.items(kind, ns, OWNER)]
        assert len(names) == len(set(names)), f"duplicate {kind}: {names}"
    deployments = {o["metadata"]["name"]: o["spec"]["replicas"] for o in kube.items("deployments", ns, OWNER)}
    assert deployments == {"python-tools": 8, "qwen3-14b": 8}, deployments
    rs = kube.items("replicasets", ns)
    assert len(rs) == 2, [r["metadata"]["name"] for r in rs]  # one template each: no flapping rollouts


def test_the_operator_holds_only_the_charts_rbac(kube, kuberl_operator, namespace):
    """The operator's identity can do what the chart grants and nothing the chart does not."""
    sa = f"system:serviceaccount:kuberl-system:{kuberl_operator.service_account}"

    def can(*args: str) -> bool:
        return kube.run("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip() == "yes"

    assert can("patch", "deployments", "-n", "default")
    assert can("list", "events", "-n", "default")
    assert can("patch", "sandboxpools/scale", "-n", "default")
    assert not can("delete", "nodes")
    assert not can("get", "secrets", "-n", "kube-system")  # list and patch only, never read a secret by name
    assert not can("create", "pods", "-n", "default")
    # RBAC's refusals name the user; a terminating namespace's refusal of new events does not
    forbidden = [line for line in kuberl_operator.log_text().splitlines()
                 if "403 Forbidden" in line and "is forbidden: User" in line]
    assert not forbidden, "the operator was refused by RBAC:\n" + "\n".join(forbidden[:5])
