"""Benchmark: kuberl on the real node (issue 38, item 4).

    python -P bench/real_node.py [--calls 300] [--concurrency 12] [--log bench/logs/real-node-DATE.log]

1. Node start: ``kuberl cluster up`` with its real node (whole ``up``; the node's own steps from
   ``node/node.json``).
2. Image builds, warm (each a cache hit on its inputs digest) and into the node's containerd; the
   cold figures are bench/README.md's (bench/image_build.py into a fresh store: the shared store
   is not wiped here while others build into it).
3. The operator as a pod from the Helm chart (admission on): apply to Ready and webhook answering.
4. A SandboxPool of 3 replicas: ``kubectl apply`` to 3 serving pods.
5. Sandbox calls/s through the pool's Service from a pod (the sandbox image running kuberl's
   client), against the same service run on the host (``kuberl sandbox serve``, basic isolation
   as a non-root uid, as many workers as the 3 pods have) called by the same client code from the
   host, in the same run: the pod's cost as a ratio. The host also calls the Service's ClusterIP.

Prints one line per figure and a JSON summary with the load average; needs what the real node
needs (root) and stops the node it starts. Only one real node runs per host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "harness"))
sys.path.insert(1, str(ROOT / "bench"))

from k8s_fixtures import Kube, wait_for  # noqa: E402
from node_fixtures import RealNode, restricted_namespace  # noqa: E402
from operator_pod import POOL, install_operator, pool_access, pool_manifest, serving  # noqa: E402
from sandbox_service import service  # noqa: E402

from kuberl.api.sandbox_pool import SandboxLimits  # noqa: E402
from kuberl.cluster import containerd  # noqa: E402
from kuberl.cluster.control_plane import down, up  # noqa: E402
from kuberl.cluster.image_build import Buildah, build_image, cache_dir, default_base, ensure_base, load_into  # noqa: E402
from kuberl.cluster.images import select  # noqa: E402
from kuberl.cluster.node import node_dir  # noqa: E402
from kuberl.cluster.nodes import default_pools  # noqa: E402

# The client both sides run: argv url, calls, concurrency (token from $KUBERL_SANDBOX_TOKEN);
# 20 calls to warm up, then the timed ones; prints {"calls", "seconds", "per_s"}.
CLIENT = """
import asyncio, json, sys, time
from kuberl.sandbox.service.client import SandboxClient

async def main(url, calls, concurrency):
    async with SandboxClient(url, request_timeout=120) as client:
        await asyncio.gather(*(client.execute("print(1)") for _ in range(20)))
        todo = iter(range(calls))
        async def worker():
            for _ in todo:
                assert (await client.execute("print(1)")).output.strip() == "1"
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.perf_counter() - t0
    print(json.dumps({"calls": calls, "seconds": round(took, 2), "per_s": round(calls / took, 1)}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""
LIMITS = SandboxLimits(timeout_seconds=5, memoryMB=256)
PODS, WORKERS_PER_POD = 3, 2


def _say(line: str) -> None:
    print(line, flush=True)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def client_pod(ns: str, url: str, token: str, calls: int, concurrency: int) -> dict:
    """The client in a pod of the sandbox image, labelled as a trainer (the pool's policy admits
    its trainers), meeting Pod Security "restricted"."""
    from kuberl.cluster.images import select as pick

    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client", "namespace": ns,
                     "labels": {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/component": "trainer"}},
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{"name": "client", "image": pick(["sandbox"])[0].ref, "imagePullPolicy": "Never",
                                 "command": ["python3", "-c", CLIENT, url, str(calls), str(concurrency)],
                                 "env": [{"name": "KUBERL_SANDBOX_TOKEN", "value": token}],
                                 "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                     "capabilities": {"drop": ["ALL"]}}}]},
    }  # fmt: skip


def host_client(url: str, token: str, calls: int, concurrency: int) -> dict:
    env = dict(os.environ, KUBERL_SANDBOX_TOKEN=token)
    out = subprocess.run([sys.executable, "-P", "-c", CLIENT, url, str(calls), str(concurrency)], env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=12)
    args = ap.parse_args()
    summary: dict = {"load_before": _load()}
    folder = Path(tempfile.mkdtemp(prefix="kuberl-bench-node-"))
    t0 = time.monotonic()
    state = up(folder, pools=default_pools(mi300x=1, h100=0, cpu=0), real_node=True)
    summary["up_s"] = round(time.monotonic() - t0, 1)
    steps = json.loads((node_dir(folder) / "node.json").read_text()).get("started_s", {})
    summary["node_steps_s"] = steps
    _say(f"cluster up with the real node: {summary['up_s']} s (node steps {steps}); load {_load()}")
    node = RealNode(state, Kube(state), folder, {}, summary["up_s"])
    try:
        buildah, recipe = Buildah(cache_dir()), default_base()
        ensure_base(buildah, recipe)
        socket = str(containerd.paths(node_dir(folder))["socket"])
        for spec in select(["sandbox", "operator"]):
            t = time.monotonic()
            build_image(buildah, spec, ROOT, recipe)
            warm = time.monotonic() - t
            t = time.monotonic()
            load_into(buildah, spec.ref, socket)
            loaded = time.monotonic() - t
            summary[f"{spec.name}_warm_build_s"], summary[f"{spec.name}_load_s"] = round(warm, 2), round(loaded, 1)
            _say(f"{spec.name}: warm build {warm:.2f} s, into the node's containerd {loaded:.1f} s")
        t = time.monotonic()
        install_operator(node)
        summary["operator_ready_s"] = round(time.monotonic() - t, 1)
        _say(f"operator pod from the chart: Ready and its webhook answering in {summary['operator_ready_s']} s")
        ns = restricted_namespace(node.kube, "bench")
        t = time.monotonic()
        node.kube.apply([pool_manifest(ns, PODS)])
        wait_for(lambda: len(serving(node, ns)) == PODS, 600, "3 serving pool pods")
        summary["pool_apply_to_ready_s"] = round(time.monotonic() - t, 1)
        _say(f"SandboxPool apply to {PODS} serving pods: {summary['pool_apply_to_ready_s']} s; load {_load()}")
        token, ip, port = pool_access(node, ns)
        node.kube.apply([client_pod(ns, f"http://{POOL}.{ns}.svc:{port}", token, args.calls, args.concurrency)])
        wait_for(lambda: node.kube.json("get", "pod", "client", "-n", ns)["status"].get("phase") in ("Succeeded", "Failed"),
                 600, lambda: node.kube.run("describe", "pod", "client", "-n", ns, check=False).stdout[-2000:])
        logs = node.kube.run("logs", "client", "-n", ns).stdout
        summary["from_pod"] = json.loads(logs.strip().splitlines()[-1])
        _say(f"from a pod through the Service: {summary['from_pod']}")
        summary["from_host_via_service"] = host_client(f"http://{ip}:{port}", token, args.calls, args.concurrency)
        _say(f"from the host through the ClusterIP: {summary['from_host_via_service']}")
        one = serving(node, ns)[0]["status"]["podIP"]
        summary["one_pod_from_host"] = host_client(f"http://{one}:8080", token, args.calls, args.concurrency)
        _say(f"one pod ({WORKERS_PER_POD} workers) at its IP from the host: {summary['one_pod_from_host']}")
        for workers, key in ((PODS * WORKERS_PER_POD, "on_host"), (WORKERS_PER_POD, "on_host_one_pods_workers")):
            with service("basic", LIMITS, [], workers=workers, pool="bench", env={"KUBERL_SANDBOX_TOKEN": token}) as url:
                summary[key] = host_client(url, token, args.calls, args.concurrency)
            _say(f"the same service on the host ({workers} workers, basic, non-root): {summary[key]}")
        summary["pod_over_host"] = round(summary["from_pod"]["per_s"] / summary["on_host"]["per_s"], 2)
        summary["one_pod_over_host"] = round(summary["one_pod_from_host"]["per_s"]
                                             / summary["on_host_one_pods_workers"]["per_s"], 2)
        _say(f"calls/s from a pod through the Service (3 pods) / on the host (one service, 6 workers): "
             f"{summary['pod_over_host']}; one pod / the host service with its 2 workers: {summary['one_pod_over_host']}")
    finally:
        t = time.monotonic()
        down(folder)
        summary["down_s"] = round(time.monotonic() - t, 1)
    summary["load_after"] = _load()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
