"""kuberl's operator as a pod on the real node (harness/node_fixtures.py), installed from the Helm chart
with admission on, and a SandboxPool it serves: shared by tests/test_real_node_operator.py and
bench/real_node.py."""

from __future__ import annotations

import base64

import yaml
from chart_render import render
from k8s_fixtures import OPERATOR_NAMESPACE, install_crds, running_ready, wait_for
from node_fixtures import RealNode

from kuberl.cluster.pki import NODE_NAME

POOL = "tools"
SELECTOR = f"app.kubernetes.io/instance={POOL},app.kubernetes.io/component=sandbox"
OPERATOR_SELECTOR = "app.kubernetes.io/name=kuberl,app.kubernetes.io/component=operator"
CHART_VALUES = {
    "admission": {"enabled": True},
    # the real node is the one that runs containers (the kwok GPU node is tainted anyway)
    "operator": {"nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "image": {"pullPolicy": "Never"}},
}
# an invalid pool only the webhook refuses (the schema takes it): requests over limits
WEBHOOK_PROBE = {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "probe"},
                 "spec": {"replicas": 1, "resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}}


def chart_objects(*, kueue: bool = False) -> list[dict]:
    """The chart as `helm install` renders it here (no prometheus-operator: no monitors); with
    ``kueue``, as `--set kueue.enabled=true` renders it (the operator watches Kueue's Workloads)."""
    return render({**CHART_VALUES, "kueue": {"enabled": kueue}}, api_versions=())


def operator_logs(node: RealNode) -> str:
    return node.kube.run("logs", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_SELECTOR, "--tail=40", check=False).stdout


def install_operator(node: RealNode, timeout: float = 300, *, kueue: bool = False) -> dict:
    """The chart applied (CRDs, ServiceAccount, RBAC, Deployment, webhook Service, Secret and
    configurations; with ``kueue``, its Kueue integration); the operator's pod once it is Ready (readiness: kopf's /healthz, served
    where it leads) and the API server reaches its webhook (a server-side dry run of an invalid
    pool is refused by it: kube-proxy routes the webhook's Service to the pod)."""
    install_crds(node.kube)
    node.kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}}])
    node.kube.apply(chart_objects(kueue=kueue), "-n", OPERATOR_NAMESPACE)

    def ready() -> dict | None:
        pods = [p for p in node.kube.items("pods", OPERATOR_NAMESPACE, OPERATOR_SELECTOR) if running_ready(p)]
        return pods[0] if pods else None

    pod = wait_for(ready, timeout, lambda: node.kube.run("describe", "pods", "-n", OPERATOR_NAMESPACE, check=False)
                   .stdout[-3000:] + operator_logs(node))

    def refused() -> str:
        return node.kube.run("apply", "--dry-run=server", "-n", "default", "-f", "-",
                             input=yaml.safe_dump(WEBHOOK_PROBE), check=False).stderr

    wait_for(lambda: "denied the request" in refused(), 120,
             lambda: f"the webhook answering the API server: {refused()}{operator_logs(node)}")
    return pod


def pool_manifest(ns: str, replicas: int) -> dict:
    """A pool small enough for a 2-core node: 2 workers a pod, 256 MB a call, 5 s a call."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": POOL, "namespace": ns},
        "spec": {"replicas": replicas, "workersPerPod": 2, "limits": {"timeoutSeconds": 5, "memoryMB": 256},
                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                               "limits": {"cpu": "1", "memory": "1Gi"}}},
    }  # fmt: skip


def serving(node: RealNode, ns: str) -> list[dict]:
    """The pool's pods that are Ready and not going."""
    return [p for p in node.kube.items("pods", ns, SELECTOR)
            if running_ready(p) and not p["metadata"].get("deletionTimestamp")]


def pool_access(node: RealNode, ns: str) -> tuple[str, str, int]:
    """(the pool's bearer token, its Service's ClusterIP, its port)."""
    secret = node.kube.json("get", "secret", f"{POOL}-token", "-n", ns)
    svc = node.kube.json("get", "service", POOL, "-n", ns)["spec"]
    return base64.b64decode(secret["data"]["token"]).decode(), svc["clusterIP"], svc["ports"][0]["port"]
