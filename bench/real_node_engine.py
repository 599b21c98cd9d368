"""Benchmark: a vLLM engine pod of kuberl's CPU image on the real node (issue 38, item 3e).

    flock /tmp/kuberl-node.lock python -P bench/real_node_engine.py [--model DIR]

1. The ``rollout-cpu`` image (images/rollout/Dockerfile.cpu) built or reused from the store (a
   warm build is a cache hit on its inputs digest; the cold figure is the first build's, in
   bench/README.md), and its size.
2. ``kuberl cluster up`` with its real node, then the image loaded into the node's containerd
   (``load_into``, what ``kuberl images build rollout-cpu --load-into SOCKET`` does), and the disk
   the node's containerd then holds.
3. A RolloutFleet (vLLM, ``cpu`` profile, SmolLM2-135M-Instruct) rendered as the operator renders
   it (``build_for``) and applied: time from ``kubectl apply`` to the engine pod Ready (the
   kubelet's startup and readiness probes on vLLM's ``/health``), split into the container's
   start and vLLM's own start-up. The model reaches the pod as a read-only hostPath volume (a
   world-readable copy: the prepared folder's weights are root's, the pod runs as uid 65532).
4. One chat answer from the host at the pod's IP (over the node's bridge), as a trainer reaches it.
5. ``kubectl scale --replicas=0``: the kubelet runs the pod's preStop drain hook (quiet for
   DRAIN_QUIET_S, operator/render/engines.py) and then SIGTERM; time until the pod is gone.

Prints one line per figure and a JSON summary with the load average. Needs root and what the real
node needs; only one real node runs per host (run it under ``flock /tmp/kuberl-node.lock``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "harness"))

from k8s_fixtures import Kube, running_ready, wait_for  # noqa: E402

from kuberl.api.rollout_fleet import RolloutFleet  # noqa: E402
from kuberl.cluster import containerd  # noqa: E402
from kuberl.cluster.control_plane import down, up  # noqa: E402
from kuberl.cluster.image_build import Buildah, build_image, cache_dir, default_base, ensure_base, load_into  # noqa: E402
from kuberl.cluster.images import IMAGES  # noqa: E402
from kuberl.cluster.node import node_dir  # noqa: E402
from kuberl.cluster.nodes import default_pools  # noqa: E402
from kuberl.operator.render.builders import build_for, engine_selector  # noqa: E402

MODEL = Path.home() / ".cache" / "kuberl" / "models" / "hf" / "smollm2-135m-instruct"
FLEET, NAMESPACE, PORT = "engines", "fleet-bench", 8000


def _say(line: str) -> None:
    print(line, flush=True)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _size(store: Buildah, image_id: str) -> str:
    res = subprocess.run(store.cmd("images", "--json", "--no-trunc"), capture_output=True, text=True, timeout=120)
    return next((row["size"] for row in json.loads(res.stdout or "[]")
                 if row["id"].removeprefix("sha256:") == image_id), "?")


def _du_gb(path: Path) -> float:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, timeout=600).stdout
    return round(int(out.split()[0]) / 1e9, 2) if out else float("nan")


def fleet_manifest(model_dir: Path) -> dict:
    """One vLLM engine on the cpu profile serving ``model_dir`` (mounted read-only at /model)."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": NAMESPACE},
        "spec": {
            "replicas": 1, "model": {"uri": "/model"},
            "engine": {"type": "vllm", "port": PORT, "dtype": "float32", "contextLength": 1024,
                       "extraArgs": ["--enforce-eager"]},  # the KV cache: the renderer's cpu default
            "accelerator": {"profile": "cpu", "count": 1},
            "podTemplate": {"spec": {
                "volumes": [{"name": "model", "hostPath": {"path": str(model_dir), "type": "Directory"}}],
                "containers": [{"name": "vllm",
                                "volumeMounts": [{"name": "model", "mountPath": "/model", "readOnly": True}]}],
            }},
        },
    }  # fmt: skip


def _started_at(pod: dict) -> float | None:
    """The container's start (``state.running.startedAt``) as a Unix time."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        started = ((status.get("state") or {}).get("running") or {}).get("startedAt")
        if started:
            return datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
    return None


def complete(ip: str, question: str = "What is 2+3?") -> tuple[str, int, float]:
    """One greedy chat answer from the engine at ``ip``: its text, its token count, seconds."""
    body = json.dumps({"model": FLEET, "messages": [{"role": "user", "content": question}],
                       "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:{PORT}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL), help="the Hugging Face folder to serve")
    args = ap.parse_args()
    summary: dict = {"load_before": _load()}
    spec = IMAGES["rollout-cpu"]
    buildah, recipe = Buildah(cache_dir()), default_base()
    ensure_base(buildah, recipe)
    built = build_image(buildah, spec, ROOT, recipe, log=_say)
    summary["image"] = {"ref": spec.ref, "cached": built.cached, "build_s": round(built.seconds, 1),
                        "size": _size(buildah, built.image_id), "layers": len(buildah.layers(built.ref))}
    _say(f"{spec.ref}: {'warm (cached)' if built.cached else 'built'} in {built.seconds:.1f} s, "
         f"{summary['image']['size']}, {summary['image']['layers']} layers")
    number, unit = summary["image"]["size"].split()
    image_bytes = float(number) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}.get(unit, 0)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    # the archive buildah writes, containerd's copy of its layers and their unpacked snapshot
    if image_bytes and free < 3.2 * image_bytes:
        raise SystemExit(f"{free / 1e9:.0f} GB free under {tempfile.gettempdir()}: loading the "
                         f"{image_bytes / 1e9:.1f} GB image into a node needs about 3x that; free some disk")
    folder = Path(tempfile.mkdtemp(prefix="kuberl-bench-engine-"))
    model_copy = folder / "model"
    shutil.copytree(args.model, model_copy)
    for path in [model_copy, *model_copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        t0 = time.monotonic()
        # one kwok GPU node beside the real one, as the node tests start it (kwok waits for a node)
        state = up(folder / "cluster", pools=default_pools(mi300x=1, h100=0, cpu=0), real_node=True)
        summary["up_s"] = round(time.monotonic() - t0, 1)
        _say(f"cluster up with the real node: {summary['up_s']} s; load {_load()}")
        kube = Kube(state)
        ctd_root = containerd.paths(node_dir(folder / "cluster"))
        before = _du_gb(node_dir(folder / "cluster"))
        t0 = time.monotonic()
        load_into(buildah, spec.ref, str(ctd_root["socket"]), log=_say)
        summary["load_into_node_s"] = round(time.monotonic() - t0, 1)
        summary["node_disk_added_gb"] = round(_du_gb(node_dir(folder / "cluster")) - before, 2)
        _say(f"into the node's containerd: {summary['load_into_node_s']} s, "
             f"+{summary['node_disk_added_gb']} GB on disk there; load {_load()}")
        kube.run("create", "namespace", NAMESPACE)
        wait_for(lambda: kube.run("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0, 60,
                 "the namespace's default ServiceAccount")
        fleet = RolloutFleet.model_validate(fleet_manifest(model_copy))
        selector = ",".join(f"{k}={v}" for k, v in engine_selector(fleet).items())
        applied = time.time()
        kube.apply(build_for(fleet, NAMESPACE))

        def ready() -> dict | None:
            pods = kube.items("pods", NAMESPACE, selector)
            return pods[0] if pods and running_ready(pods[0]) else None

        pod = wait_for(ready, 900, lambda: kube.run("describe", "pods", "-n", NAMESPACE, check=False).stdout[-3000:],
                       interval=0.5)
        ready_s = time.time() - applied
        started = _started_at(pod)
        summary["apply_to_ready_s"] = round(ready_s, 1)
        summary["apply_to_container_start_s"] = round(started - applied, 1) if started else None
        _say(f"engine pod apply to Ready: {ready_s:.1f} s (container started after "
             f"{summary['apply_to_container_start_s']} s; the rest is vLLM's start-up); load {_load()}")
        ip = pod["status"]["podIP"]
        text, tokens, took = complete(ip)
        summary["completion"] = {"text": text, "tokens": tokens, "s": round(took, 2), "pod_ip": ip}
        _say(f"a chat answer from the host at {ip}:{PORT}: {text!r} ({tokens} tokens) in {took:.2f} s")
        name = pod["metadata"]["name"]
        t0 = time.monotonic()
        kube.run("scale", f"deployment/{FLEET}", "-n", NAMESPACE, "--replicas=0")
        wait_for(lambda: kube.run("get", "pod", name, "-n", NAMESPACE, check=False).returncode != 0, 400,
                 f"pod {name} gone", interval=0.5)
        summary["scale_down_to_gone_s"] = round(time.monotonic() - t0, 1)
        _say(f"scaled to 0: the pod gone after {summary['scale_down_to_gone_s']} s (preStop drain, then SIGTERM)")
    finally:
        t0 = time.monotonic()
        down(folder / "cluster")
        summary["down_s"] = round(time.monotonic() - t0, 1)
        shutil.rmtree(folder, ignore_errors=True)
    summary["load_after"] = _load()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
