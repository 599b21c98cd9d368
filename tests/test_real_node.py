"""The real node of ``kuberl cluster up``: a kubelet, kube-proxy, containerd, runc and CNI on this
host, beside one kwok GPU node, its pods run in containers.

A pod of a tiny image (harness/node_test_image.py) runs under PodSecurity ``restricted``, gets an
IP from the node's bridge, passes its kubelet-run httpGet and exec probes; ``kubectl logs`` and
``exec`` reach it; a ClusterIP Service routes to two such pods from the host and from a pod
(kube-proxy, iptables), and by its name (CoreDNS); a pod calls the API server as an in-cluster
client; a SandboxPool's rendered NetworkPolicy is enforced (kube-router); the kubelet's
credentials are a node's; and ``down`` leaves the host as it found it (harness/node_fixtures.py).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fixtures import Kube, running_ready, wait_for
from node_fixtures import (
    RealNode,
    dns_a,
    host_view,
    programmed_endpoints,
    require_or_skip,
    restricted_namespace,
    start,
    wait_ready,
)

from kuberl.cluster.control_plane import down, up
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.node import node_dir
from kuberl.cluster.node_config import NODE_CIDR, NODE_IP
from kuberl.cluster.pki import KUBELET, NODE_NAME

pytestmark = pytest.mark.node

IMAGE_PORT = 8080


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    from node_test_image import ensure_archive

    try:
        archive = ensure_archive()
    except (ClusterError, subprocess.CalledProcessError) as err:
        require_or_skip(f"the test image could not be built: {err}")
    yield from start(tmp_path_factory.mktemp("realnode"), (archive,))


RESTRICTED = {
    "runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}  # fmt: skip


def server_container() -> dict:
    from node_test_image import TAG

    return {
        "name": "server", "image": TAG, "imagePullPolicy": "Never", "securityContext": RESTRICTED,
        "ports": [{"containerPort": IMAGE_PORT}],
        # a loaded CI machine answers slowly: a probe waits up to 5 s
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": IMAGE_PORT}, "periodSeconds": 1,
                           "timeoutSeconds": 5},
        "livenessProbe": {"exec": {"command": ["/server", "echo", "alive"]}, "periodSeconds": 2, "timeoutSeconds": 5},
    }  # fmt: skip


def server_pod(name: str, ns: str, labels: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"containers": [server_container()], "terminationGracePeriodSeconds": 1}}


def test_the_node_joins_ready_labelled_as_a_cpu_node(node: RealNode):
    n = node.kube.json("get", "node", NODE_NAME)
    assert n["metadata"]["labels"]["kuberl.io/node-kind"] == "cpu"
    assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {a["type"]: a["address"] for a in n["status"]["addresses"]}["InternalIP"] == "10.250.0.1"
    # the real node replaces kwok's CPU pool: the only untainted node
    names = [x["metadata"]["name"] for x in node.kube.json("get", "nodes")["items"]]
    assert sorted(names) == ["kuberl-node", "mi300x-0"]
    print(f"real node Ready {node.start_s:.1f} s after `up` began (control plane included)")


def test_a_second_real_node_on_the_host_is_refused(node: RealNode, tmp_path: Path):
    with pytest.raises(ClusterError, match=f"a real node already runs on this host .*{node.folder}"):
        up(tmp_path / "second", real_node=True)
    assert not (tmp_path / "second" / "cluster.json").exists()  # refused before anything started


def test_the_kubelet_holds_a_node_identity(node: RealNode):
    """Node authorizer + NodeRestriction: the kubelet's credentials reach its own node only."""
    kubelet = Kube(node.state, node.folder / "kubeconfigs" / f"{KUBELET.name}.yaml")
    assert kubelet.run("get", "node", NODE_NAME, check=False).returncode == 0
    refused = kubelet.run("label", "node", "mi300x-0", "stolen=yes", check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
    listing = kubelet.run("get", "secrets", "-A", check=False)
    assert listing.returncode != 0 and "forbidden" in listing.stderr.lower()


def test_a_pod_runs_with_an_ip_and_passes_its_probes(node: RealNode):
    ns = restricted_namespace(node.kube, "probes")
    node.kube.apply([server_pod("web", ns)])
    pod = wait_ready(node.kube, ns, "web")
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["status"]["podIP"].startswith(NODE_CIDR.rsplit(".", 2)[0] + ".")
    time.sleep(5)  # a few liveness periods: the exec probe keeps passing
    status = node.kube.json("get", "pod", "web", "-n", ns)["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0
    events = node.kube.json("get", "events", "-n", ns, "--field-selector", "reason=Unhealthy")["items"]
    assert not [e["message"] for e in events if e["message"].startswith("Liveness")]
    assert node.kube.run("logs", "web", "-n", ns).stdout.strip() == "serving on :8080"
    assert node.kube.run("exec", "web", "-n", ns, "--", "/server", "echo", "from", "exec").stdout == "from exec\n"


def test_podsecurity_restricted_refuses_a_privileged_pod(node: RealNode):
    ns = restricted_namespace(node.kube, "psa")
    pod = server_pod("priv", ns)
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    refused = node.kube.run("apply", "-f", "-", input=json.dumps(pod), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr


def test_a_cluster_ip_service_routes_from_the_host_and_from_a_pod_by_ip_and_name(node: RealNode):
    ns = restricted_namespace(node.kube, "svc")
    node.kube.apply([server_pod(f"web-{i}", ns, {"app": "web"}) for i in range(2)] + [server_pod("client", ns)] + [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": IMAGE_PORT}]},
    }])  # fmt: skip
    for name in ("web-0", "web-1", "client"):
        wait_ready(node.kube, ns, name)
    ip = node.kube.json("get", "service", "web", "-n", ns)["spec"]["clusterIP"]
    pod_ips = {node.kube.json("get", "pod", f"web-{i}", "-n", ns)["status"]["podIP"] for i in range(2)}

    def from_host() -> str:
        with urllib.request.urlopen(f"http://{ip}/", timeout=5) as resp:
            return resp.read().decode()

    # Each layer learns of the Service on its own watch, in its own time: kube-proxy programs the
    # endpoints the EndpointSlice lists ready (one pod first, if one was ready first), CoreDNS
    # answers the name once its informer has the Service. Asking before either has caught up was
    # this test's flake; it waits for each condition itself, then asks once.
    t0 = time.monotonic()
    wait_for(lambda: {e.split(":")[0] for e in programmed_endpoints(ns, "web")} == pod_ips, 60,
             lambda: f"kube-proxy programming {ns}/web -> {sorted(pod_ips)}: {sorted(programmed_endpoints(ns, 'web'))}")
    proxied_s = time.monotonic() - t0
    name = f"web.{ns}.svc.cluster.local"
    wait_for(lambda: dns_a(name, NODE_IP) == [ip], 60, lambda: f"CoreDNS answering {name} with {ip}: {dns_a(name, NODE_IP)}")
    print(f"after the pods were Ready: both endpoints in kube-proxy's rules {proxied_s:.1f} s, "
          f"the name in CoreDNS {time.monotonic() - t0:.1f} s")
    assert {from_host() for _ in range(30)} == {"web-0", "web-1"}
    from_pod = {node.kube.run("exec", "client", "-n", ns, "--", "/server", "get", f"http://{ip}/").stdout
                for _ in range(12)}
    assert from_pod == {"web-0", "web-1"}
    # by name, through the cluster DNS (CoreDNS), as a trainer calls its pool: `NAME.NAMESPACE.svc`
    by_name = node.kube.run("exec", "client", "-n", ns, "--", "/server", "get", f"http://web.{ns}.svc/").stdout
    assert by_name in {"web-0", "web-1"}, by_name


def test_a_pod_calls_the_api_server_as_an_in_cluster_client(node: RealNode):
    """The `kubernetes` Service's ClusterIP with the pod's service-account CA and token."""
    ns = restricted_namespace(node.kube, "incluster")
    node.kube.apply([server_pod("client", ns)])
    wait_ready(node.kube, ns, "client")
    ip = node.kube.json("get", "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    out = node.kube.run("exec", "client", "-n", ns, "--", "/server", "get", f"https://{ip}/version").stdout
    assert json.loads(out)["gitVersion"] == "v1.34.4"


def test_the_sandbox_pools_policy_is_enforced(node: RealNode):
    """The NetworkPolicy the operator renders for a SandboxPool (no egress; ingress on its port
    from the job's trainers only), enforced by kube-router: a trainer's call gets through,
    another pod's does not, and the pool's pod reaches neither another pod nor the API server.
    The kubelet's probes from the node still pass."""
    from kuberl.operator.render.isolation import sandbox_policy

    ns = restricted_namespace(node.kube, "netpol")
    pool, trainer = {"app": "pool"}, {"role": "trainer"}
    policy = sandbox_policy({"name": "pool-deny-egress", "namespace": ns}, pool, IMAGE_PORT, trainers=trainer,
                            annotations={})
    node.kube.apply([server_pod("pool", ns, pool), server_pod("trainer", ns, trainer),
                     server_pod("other", ns), policy])
    pods = {name: wait_ready(node.kube, ns, name) for name in ("pool", "trainer", "other")}
    ip = {name: p["status"]["podIP"] for name, p in pods.items()}
    api = node.kube.json("get", "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]

    def call(src: str, url: str) -> subprocess.CompletedProcess:
        return node.kube.run("exec", src, "-n", ns, "--", "/server", "get", url, "2s", check=False)

    # kube-router applies the policy within its sync: until then the pool's pod reaches out
    wait_for(lambda: call("pool", f"http://{ip['other']}:{IMAGE_PORT}/").returncode != 0, 60,
             "the pool's egress denied")
    assert call("trainer", f"http://{ip['pool']}:{IMAGE_PORT}/").stdout == "pool"
    assert call("other", f"http://{ip['pool']}:{IMAGE_PORT}/").returncode != 0
    assert call("pool", f"https://{api}/version").returncode != 0
    assert call("other", f"http://{ip['trainer']}:{IMAGE_PORT}/").stdout == "trainer"  # unselected pods: open
    assert running_ready(node.kube.json("get", "pod", "pool", "-n", ns))  # probes from the node pass


def test_down_leaves_the_host_as_it_was(node: RealNode):
    pids = json.loads((node_dir(node.folder) / "node.json").read_text())["pids"]
    assert host_view(node.folder) != node.before  # the node changed the host while it ran
    t0 = time.monotonic()
    down(node.folder)
    print(f"down took {time.monotonic() - t0:.1f} s")
    after = host_view(node.folder)
    for key in node.before:
        assert after[key] == node.before[key], key
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or b"kube" not in Path(f"/proc/{pid}/cmdline").read_bytes()
