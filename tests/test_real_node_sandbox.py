"""A SandboxPool's pods on the real node, from kuberl's own image (cluster/image_build.py):
applied through the operator as it runs in the Helm chart's ServiceAccount and RBAC (on the
host), the pool's Deployment gets real pods from ``ghcr.io/kuberl/sandbox:0.1.0``; their
kubelet-run probes pass; they keep the securityContext ``kuberl render`` gives; ``/readyz``
through the pool's ClusterIP Service says which containment layers are active inside the pod;
``kubectl scale sandboxpool/NAME --replicas=3`` gives 3 serving pods, and calls through the
ClusterIP spread over them; the operator's deny-egress NetworkPolicy holds inside the pod. Needs what the real node needs and buildah + debootstrap (the image
is built the first time, minutes; cached by its inputs after).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from k8s_fixtures import Operator, install_chart_rbac, running_ready, wait_for
from node_fixtures import RealNode, load_images, programmed_endpoints, restricted_namespace, start

from kuberl.cluster.pki import NODE_NAME

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parent.parent
POOL = "tools"
SELECTOR = f"app.kubernetes.io/instance={POOL},app.kubernetes.io/component=sandbox"


def pool_manifest(ns: str) -> dict:
    """A pool small enough for a 2-core node: 1 replica of 2 workers, 256 MB a call."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": POOL, "namespace": ns},
        "spec": {"replicas": 1, "workersPerPod": 2, "limits": {"timeoutSeconds": 5, "memoryMB": 256},
                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                               "limits": {"cpu": "1", "memory": "1Gi"}}},
    }  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    yield from start(tmp_path_factory.mktemp("sandboxnode"))


@pytest.fixture(scope="module")
def sandbox_image(node: RealNode) -> str:
    """The sandbox image, built (or reused) and loaded into the node's containerd."""
    return load_images(node, ["sandbox"], REPO)[0]


@pytest.fixture(scope="module")
def pool(node: RealNode, sandbox_image: str, tmp_path_factory) -> Iterator[str]:
    """The pool applied in a PodSecurity-restricted namespace with the operator running; its
    namespace once its pod serves."""
    op = Operator(node.kube, install_chart_rbac(node.kube), tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        ns = restricted_namespace(node.kube, "sbx")
        node.kube.apply([pool_manifest(ns)])
        wait_for(lambda: len(serving(node, ns)) == 1, 240,
                 lambda: node.kube.run("describe", "pods", "-n", ns, "-l", SELECTOR, check=False).stdout[-2500:]
                 + op.log_text()[-1500:])
        yield ns
    finally:
        op.stop()


def serving(node: RealNode, ns: str) -> list[dict]:
    return [p for p in node.kube.items("pods", ns, SELECTOR) if running_ready(p)]


def service_url(node: RealNode, ns: str) -> str:
    svc = node.kube.json("get", "service", POOL, "-n", ns)["spec"]
    return f"http://{svc['clusterIP']}:{svc['ports'][0]['port']}"


def call(url: str, token: str, code: str) -> dict:
    req = urllib.request.Request(f"{url}/v1/execute", data=json.dumps({"code": code}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def pool_token(node: RealNode, ns: str) -> str:
    secret = node.kube.json("get", "secret", f"{POOL}-token", "-n", ns)
    return base64.b64decode(secret["data"]["token"]).decode()


def test_the_pools_pod_runs_the_image_with_the_rendered_security_context(node: RealNode, pool: str):
    pod = serving(node, pool)[0]
    assert pod["spec"]["nodeName"] == NODE_NAME
    status = pod["status"]["containerStatuses"][0]
    assert status["image"].endswith("ghcr.io/kuberl/sandbox:0.1.0") and status["restartCount"] == 0
    manifest = node.folder / "pool.yaml"
    manifest.write_text(yaml.safe_dump(pool_manifest(pool)))
    rendered = subprocess.run([sys.executable, "-P", "-m", "kuberl", "render", str(manifest)], capture_output=True,
                              text=True, check=True, cwd=node.folder).stdout
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    want = deployment["spec"]["template"]["spec"]
    assert pod["spec"]["securityContext"] == want["securityContext"]
    assert pod["spec"]["containers"][0]["securityContext"] == want["containers"][0]["securityContext"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    # the kubelet's probes passed: readiness (httpGet /readyz, 503 until the workers are up) made
    # it Ready, liveness (httpGet /healthz) never failed
    events = node.kube.json("get", "events", "-n", pool, "--field-selector", "reason=Unhealthy")["items"]
    assert not [e["message"] for e in events if e["message"].startswith("Liveness")]


def test_readyz_through_the_service_names_the_layers_active_in_the_pod(node: RealNode, pool: str):
    with urllib.request.urlopen(service_url(node, pool) + "/readyz", timeout=10) as resp:
        info = json.loads(resp.read())
    print("readyz in a pod on the real node:", json.dumps(info["protections"], sort_keys=True))
    assert info["ready"] and info["pool"] == POOL and info["workers_up"] == 2
    protections = info["protections"]
    assert protections and all(isinstance(v, bool) for v in protections.values())
    assert protections.get("seccomp") is True  # the one layer a restricted pod always keeps


def test_kubectl_scale_gives_three_serving_pods_and_calls_spread(node: RealNode, pool: str):
    node.kube.run("scale", f"sandboxpool/{POOL}", "-n", pool, "--replicas=3")
    wait_for(lambda: len(serving(node, pool)) == 3, 240,
             lambda: node.kube.run("get", "pods", "-n", pool, "-o", "wide", check=False).stdout)
    names = {p["metadata"]["name"] for p in serving(node, pool)}
    # the calls spread over what kube-proxy has programmed: wait until that is all three pods
    # (a pod Ready a moment ago may not be in the Service's rules yet)
    ips = {p["status"]["podIP"] for p in serving(node, pool)}
    wait_for(lambda: {e.split(":")[0] for e in programmed_endpoints(pool, POOL)} == ips, 60,
             lambda: f"kube-proxy programming {pool}/{POOL} -> {sorted(ips)}: {sorted(programmed_endpoints(pool, POOL))}")
    url, token = service_url(node, pool), pool_token(node, pool)
    answered = [call(url, token, "import os; print(os.uname().nodename)") for _ in range(30)]
    assert all(a["outcome"] == "stdout" for a in answered), answered[:3]
    hosts = {a["output"].strip() for a in answered}
    assert hosts == names, (hosts, names)


CONNECT = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as err:
    print(type(err).__name__)
"""


def test_the_operators_deny_egress_policy_holds_in_the_pod(node: RealNode, pool: str):
    """From inside a pool's pod (its own process, not a sandboxed call) neither another pod of the
    pool nor the API server can be reached; the same pod's port answers the node."""
    assert node.kube.run("get", "networkpolicy", f"{POOL}-deny-egress", "-n", pool, check=False).returncode == 0
    pods = serving(node, pool)
    source, target = pods[0]["metadata"]["name"], pods[1]["status"]["podIP"]
    api = node.kube.json("get", "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]

    def connect(host: str, port: int) -> str:
        return node.kube.run("exec", source, "-n", pool, "--", "python3", "-c", CONNECT, host, str(port)).stdout.strip()

    with urllib.request.urlopen(f"http://{target}:8080/healthz", timeout=10) as resp:
        assert resp.status == 200  # the target serves (the node may call it)
    # refused or timed out by the policy (an exception's name), not connected
    assert connect(target, 8080).endswith("Error")
    assert connect(api, 443).endswith("Error")
