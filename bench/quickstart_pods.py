"""Benchmark: the full examples/quickstart.yaml in real pods against ``kuberl run`` on the host
(issue 38 items 3d and 4).

    python -P bench/quickstart_pods.py [--only pods|host]

1. ``kuberl cluster up`` with its real node; the sandbox, operator and trainer-cpu images built
   (or reused) and loaded into the node's containerd (each load timed: the trainer's is 6 GB).
2. The operator pod from the chart, then ``kubectl apply -f examples/quickstart.yaml`` unchanged
   (in a PodSecurity-restricted namespace): apply to Succeeded, the trainer pod's own minutes,
   and the held-out accuracy the run recorded (its eval step records on the job's claim).
3. ``kuberl run examples/quickstart.yaml`` on the host, on the same machine right after (or alone:
   ``--only host``, which needs no node): minutes and the same accuracies.

Prints one line per figure and a JSON summary with the load average before and after each part;
needs what the real node needs (root) and stops the node it starts. Only one real node runs per
host: wrap it in ``flock /tmp/kuberl-node.lock``.
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

from k8s_fixtures import Kube  # noqa: E402
from node_fixtures import RealNode, load_images, restricted_namespace  # noqa: E402
from operator_pod import install_operator  # noqa: E402
from trainer_pod import claim_folder, quickstart, records, running_trainer, wait_phase  # noqa: E402

from kuberl.cluster.control_plane import down, up  # noqa: E402
from kuberl.cluster.nodes import default_pools  # noqa: E402


def _say(line: str) -> None:
    print(line, flush=True)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def accuracies(recs: list[dict]) -> dict[str, float]:
    """Held-out accuracy by the stage it followed (eval step records), and the first one (before
    training: the run evaluates its starting point too, where it does)."""
    return {str(r.get("label") or r.get("stage") or r["step"]): round(100 * r["accuracy"], 1)
            for r in recs if r.get("type") == "eval" and r.get("accuracy") is not None}


def in_pods(summary: dict) -> None:
    folder = Path(tempfile.mkdtemp(prefix="kuberl-bench-qs-"))
    t = time.monotonic()
    state = up(folder, pools=default_pools(mi300x=1, h100=0, cpu=0), real_node=True)
    summary["up_s"] = round(time.monotonic() - t, 1)
    node = RealNode(state, Kube(state), folder, {}, summary["up_s"])
    try:
        for name in ("sandbox", "operator", "trainer-cpu"):
            t = time.monotonic()
            load_images(node, [name], ROOT)
            summary[f"{name}_build_and_load_s"] = round(time.monotonic() - t, 1)
            _say(f"{name}: built or reused, into the node's containerd in {summary[f'{name}_build_and_load_s']} s")
        install_operator(node)
        ns = restricted_namespace(node.kube, "qs")
        summary["pods_load_before"] = _load()
        t = time.monotonic()
        node.kube.apply([quickstart(ns)])
        pod = running_trainer(node.kube, ns, 900)
        started = time.monotonic() - t
        status = wait_phase(node.kube, ns, {"Succeeded", "Failed"}, 7200)
        summary["pods_apply_to_done_s"] = round(time.monotonic() - t, 1)
        summary["pods_trainer_started_s"] = round(started, 1)
        summary["pods_phase"] = status.get("phase")
        summary["pods_load_after"] = _load()
        pod = node.kube.json("get", "pod", pod["metadata"]["name"], "-n", ns)
        term = pod["status"]["containerStatuses"][0]["state"].get("terminated", {})
        summary["pods_container"] = {k: term.get(k) for k in ("exitCode", "startedAt", "finishedAt")}
        summary["pods_accuracy"] = accuracies(records(claim_folder(node.kube, ns)))
        _say(f"in pods: {summary['pods_phase']} {summary['pods_apply_to_done_s']} s after apply (trainer container "
             f"running after {started:.0f} s); held-out accuracy {summary['pods_accuracy']}; "
             f"load {summary['pods_load_before']} -> {summary['pods_load_after']}")
    finally:
        down(folder)


def on_host(summary: dict) -> None:
    out = Path(tempfile.mkdtemp(prefix="kuberl-bench-qs-host-"))
    summary["host_load_before"] = _load()
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "kuberl", "run", str(ROOT / "examples" / "quickstart.yaml"), "--out",
                    str(out)], check=True, stdout=subprocess.DEVNULL, timeout=7200)
    summary["host_s"] = round(time.monotonic() - t, 1)
    summary["host_load_after"] = _load()
    summary["host_accuracy"] = accuracies(records(out))
    _say(f"on the host: {summary['host_s']} s; held-out accuracy {summary['host_accuracy']}; "
         f"load {summary['host_load_before']} -> {summary['host_load_after']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("pods", "host"), help="one side alone")
    args = ap.parse_args()
    summary: dict = {"load_before": _load()}
    if args.only != "host":
        in_pods(summary)
    if args.only != "pods":
        on_host(summary)
    if not args.only:
        summary["pods_over_host"] = round(summary["pods_apply_to_done_s"] / summary["host_s"], 2)
    summary["load_after"] = _load()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
