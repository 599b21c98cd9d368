"""A RolloutFleet's engine pods on the real node, scaled up and down with ``kubectl scale``: the
operator (on the host, under the chart's RBAC) renders the fleet's Deployment, the real kubelet
runs its pods, their startup and readiness probes, and, for the pod a scale-down removes, the
preStop drain hook the renderer gives engines (operator/render/engines.py) and then SIGTERM.

The engines are stand-ins (harness/standin_engine.py, in the sandbox image): the CPU vLLM image is
6+ GB, too heavy to load into every test cluster's containerd (docs/cluster.md, "The elastic
fleet"); tests/test_elastic_fleet.py trains on real vLLM servers behind kwok's pods. What this
adds is the kubelet's side of an engine leaving: the hook runs in the container with its
``POD_IP``, holds the pod (Terminating, out of the Service's ready endpoints) while the engine
reports running requests, lets it go after DRAIN_QUIET_S idle seconds, and SIGTERM comes after.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fixtures import Operator, install_chart_rbac, new_namespace, running_ready, wait_for
from node_fixtures import RealNode, load_images, start
from standin_engine import SCRIPT, events

from kuberl.cluster.pki import NODE_NAME
from kuberl.operator.render.engines import DRAIN_GRACE_S, DRAIN_QUIET_S

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parent.parent
FLEET, PORT = "engines", 8000
SELECTOR = f"app.kubernetes.io/instance={FLEET},app.kubernetes.io/component=rollout"


def fleet_manifest(ns: str, image: str, events_dir: Path) -> dict:
    """One vLLM engine on the cpu profile, its container running the stand-in from ``image``;
    small requests so that two fit a 2-core node beside the rest."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": FLEET, "namespace": ns},
        "spec": {
            "replicas": 1, "model": {"uri": "/model"}, "engine": {"type": "vllm", "port": PORT},
            "accelerator": {"profile": "cpu", "count": 1},
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            "podTemplate": {"spec": {
                "volumes": [{"name": "events", "hostPath": {"path": str(events_dir), "type": "Directory"}}],
                "containers": [{
                    "name": "vllm", "image": image, "imagePullPolicy": "Never",
                    "command": ["python3", "-c", SCRIPT, str(PORT), "/events/$(POD_NAME).jsonl"],
                    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                    "volumeMounts": [{"name": "events", "mountPath": "/events"}],
                }],
            }},
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    yield from start(tmp_path_factory.mktemp("fleetnode"))


@pytest.fixture(scope="module")
def fleet(node: RealNode, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The fleet applied with the operator running, once its engine serves: (namespace, the
    folder of the engines' event files)."""
    (image,) = load_images(node, ["sandbox"], REPO)
    events_dir = tmp_path_factory.mktemp("engine-events")
    events_dir.chmod(0o777)  # the image's user, 65532, writes there
    op = Operator(node.kube, install_chart_rbac(node.kube), tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        ns = new_namespace(node.kube, "fleet")  # not "restricted": hostPath carries the events out
        node.kube.apply([fleet_manifest(ns, image, events_dir)])
        wait_for(lambda: len(serving(node, ns)) == 1, 240,
                 lambda: node.kube.run("describe", "pods", "-n", ns, "-l", SELECTOR, check=False).stdout[-2500:]
                 + op.log_text()[-1500:])
        yield ns, events_dir
    finally:
        op.stop()


def serving(node: RealNode, ns: str) -> list[dict]:
    return [p for p in node.kube.items("pods", ns, SELECTOR)
            if running_ready(p) and not p["metadata"].get("deletionTimestamp")]


def set_busy(ip: str, n: int) -> None:
    req = urllib.request.Request(f"http://{ip}:{PORT}/busy?n={n}", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def endpoint_conditions(node: RealNode, ns: str) -> dict[str, dict]:
    """The fleet Service's EndpointSlice conditions by pod IP."""
    slices = node.kube.items("endpointslices", ns, f"kubernetes.io/service-name={FLEET}")
    return {ep["addresses"][0]: ep.get("conditions", {}) for s in slices for ep in s.get("endpoints") or []}


def test_engine_pods_scale_up_and_a_leaving_one_drains_before_sigterm(node: RealNode, fleet: tuple[str, Path]):
    ns, events_dir = fleet
    (first,) = serving(node, ns)
    assert first["spec"]["nodeName"] == NODE_NAME
    assert first["spec"]["terminationGracePeriodSeconds"] == DRAIN_GRACE_S
    # scale up: a second engine pod, Ready through the kubelet's probes, in the Service's endpoints
    node.kube.run("scale", f"rolloutfleet/{FLEET}", "-n", ns, "--replicas=2")
    pods = wait_for(lambda: (p := serving(node, ns)) and len(p) == 2 and p, 120,
                    lambda: node.kube.run("describe", "pods", "-n", ns, check=False).stdout[-2500:])
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    wait_for(lambda: all(endpoint_conditions(node, ns).get(ip, {}).get("ready") for ip in ips.values()), 60,
             "both engines ready in the fleet's EndpointSlice")
    for ip in ips.values():
        set_busy(ip, 1)  # each engine reports a running request
    # scale down while both are busy: the one leaving is held by its preStop hook
    scaled_down = time.time()
    node.kube.run("scale", f"rolloutfleet/{FLEET}", "-n", ns, "--replicas=1")
    (stays,) = wait_for(lambda: (p := serving(node, ns)) and len(p) == 1 and p, 60, "one engine left serving")
    (leaving,) = [name for name in ips if name != stays["metadata"]["name"]]
    log = events_dir / f"{leaving}.jsonl"
    wait_for(lambda: any(e["event"] == "metrics" for e in events(log)), 60, "the drain hook polling the engine")
    time.sleep(DRAIN_QUIET_S / 2)
    pod = node.kube.json("get", "pod", leaving, "-n", ns)  # still there, terminating, out of rotation
    assert pod["metadata"].get("deletionTimestamp"), pod["metadata"]
    cond = endpoint_conditions(node, ns).get(ips[leaving], {})
    assert cond.get("terminating") is True and cond.get("ready") is False, cond
    assert not any(e["event"] == "sigterm" for e in events(log))
    idle = time.time()
    set_busy(ips[leaving], 0)
    wait_for(lambda: node.kube.run("get", "pod", leaving, "-n", ns, check=False).returncode != 0,
             DRAIN_QUIET_S + 60, f"pod {leaving} gone after its drain")
    seen = events(log)
    polls = [e for e in seen if e["event"] == "metrics"]
    assert {e["peer"] for e in polls} == {ips[leaving]}  # the hook, in the container, at its POD_IP
    (term,) = [e for e in seen if e["event"] == "sigterm"]
    # the hook ran only after the scale-down, saw the engine busy, then idle, and SIGTERM came
    # once it had been idle for DRAIN_QUIET_S seconds (a second's polling either side)
    assert polls[0]["t"] >= scaled_down and polls[0]["busy"] == 1, polls[:3]
    assert polls[-1]["busy"] == 0 and polls[-1]["t"] <= term["t"], polls[-3:]
    assert DRAIN_QUIET_S - 1 <= term["t"] - idle <= DRAIN_QUIET_S + 15, (term["t"] - idle, seen[-5:])
    # the engine that stays was never drained nor stopped, and still serves
    kept = events(events_dir / f"{stays['metadata']['name']}.jsonl")
    assert not any(e["event"] in ("metrics", "sigterm") for e in kept), kept
    assert [p["metadata"]["name"] for p in serving(node, ns)] == [stays["metadata"]["name"]]
