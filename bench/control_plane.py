"""Benchmark: the local control plane and the operator on it (issue 27, item 4).

    python -P bench/control_plane.py                              # all of it, ~10 min
    python -P bench/control_plane.py --applies 20 --replicas 10 100 1000
    python -P bench/control_plane.py --cold                       # also a build from empty caches

1. Start: ``kuberl cluster up`` in a fresh folder with the programs cached (warm start) and the
   restart of a stopped cluster; with --cold, the build of every program into empty Go and
   program caches (what a first run costs; minutes).
2. Apply to Running: ``kubectl apply -f examples/h100-inline.yaml`` (a job with an inline fleet
   and pool) until every pod of it is Running and Ready, each apply in a fresh namespace: p50
   and p99 over --applies.
3. Operator load: one SandboxPool of N replicas (kwok CPU nodes) reconciled to N Ready pods,
   then over --window seconds the API requests the operator's ServiceAccount sends (the API
   server's audit log; watches excluded), per reconcile pass (one every
   KUBERL_RECONCILE_INTERVAL seconds), and the operator process's CPU seconds per pass.

The operator runs as ``kuberl operator -A`` under the Helm chart's ServiceAccount and RBAC (the
helpers of harness/k8s_fixtures.py). Counts do not depend on the machine's load; the latencies do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "harness"))

from k8s_fixtures import Kube, Operator, install_chart_rbac, new_namespace, running_ready, wait_for  # noqa: E402

from kuberl.cluster import build  # noqa: E402
from kuberl.cluster.control_plane import down, up  # noqa: E402
from kuberl.cluster.nodes import default_pools  # noqa: E402

RECONCILE_INTERVAL = 5.0


def cold_build(root: Path) -> float:
    """Seconds to build every program with empty Go build, module and program caches."""
    env = {**os.environ, "GOCACHE": str(root / "gocache"), "GOMODCACHE": str(root / "gomodcache"),
           "KUBERL_K8S_CACHE": str(root / "programs")}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-P", "-m", "kuberl", "cluster", "build"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    took = time.monotonic() - t0
    subprocess.run(["chmod", "-R", "u+w", str(root / "gomodcache")], check=False)  # the module cache is read-only
    return took


def start_times(root: Path) -> tuple[float, float]:
    """(warm start in a fresh folder, restart of a stopped cluster) in seconds."""
    folder = root / "start"
    t0 = time.monotonic()
    up(folder, pools=default_pools(mi300x=1, h100=1, cpu=1))
    fresh = time.monotonic() - t0
    down(folder)
    t0 = time.monotonic()
    up(folder, pools=default_pools(mi300x=1, h100=1, cpu=1))
    restart = time.monotonic() - t0
    down(folder)
    return fresh, restart


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def apply_latencies(kube: Kube, applies: int) -> list[float]:
    example = REPO / "examples" / "h100-inline.yaml"
    out = []
    for _ in range(applies):
        ns = new_namespace(kube, "apply")
        kube.apply([{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": "qwen-policy-weights", "namespace": ns},
                     "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}])
        t0 = time.monotonic()
        kube.run("apply", "-n", ns, "-f", str(example))

        def all_running(ns: str = ns) -> bool:
            pods = kube.items("pods", ns)
            trainers = [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "trainer"]
            # the example: 1 trainer pod, 2 engines, 2 sandbox pods
            return len(pods) == 5 and bool(trainers) and all(running_ready(p) for p in pods)

        wait_for(all_running, 180, f"every pod of the job in {ns} Running and Ready", interval=0.1)
        out.append(time.monotonic() - t0)
        kube.run("delete", "namespace", ns, "--wait=true", "--timeout=180s")
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def operator_requests(audit_log: Path, user: str, since: float, until: float) -> dict[str, int]:
    """The requests ``user`` sent between two wall-clock times, by verb and resource (no watches)."""
    counts: dict[str, int] = {}
    with audit_log.open() as f:
        for line in f:
            e = json.loads(line)
            if e.get("stage") != "ResponseComplete" or e["user"].get("username") != user or e["verb"] == "watch":
                continue
            t = datetime.fromisoformat(e["requestReceivedTimestamp"]).timestamp()
            if since <= t < until:
                ref = e.get("objectRef") or {}
                key = f"{e['verb']} {ref.get('resource', '?')}{'/' + ref['subresource'] if ref.get('subresource') else ''}"
                counts[key] = counts.get(key, 0) + 1
    return counts


def operator_load(kube: Kube, op: Operator, replicas: int, window: float, audit_log: Path) -> dict:
    ns = new_namespace(kube, f"load-{replicas}")
    kube.apply([{
        "apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool",
        "metadata": {"name": "tools", "namespace": ns},
        "spec": {"replicas": replicas, "workersPerPod": 2,
                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}},
    }])
    t0 = time.monotonic()
    wait_for(lambda: (kube.json("get", "sandboxpool", "tools", "-n", ns).get("status") or {}).get("readyReplicas")
             == replicas, 900, f"{replicas} ready sandbox pods", interval=1.0)
    settle = time.monotonic() - t0
    time.sleep(2 * RECONCILE_INTERVAL)  # past the burst that followed the pods' readiness
    assert op.proc is not None
    cpu0, wall0 = cpu_seconds(op.proc.pid), time.time()
    time.sleep(window)
    cpu1, wall1 = cpu_seconds(op.proc.pid), time.time()
    time.sleep(2)  # the audit log is written as each request completes
    user = f"system:serviceaccount:kuberl-system:{op.service_account}"
    counts = operator_requests(audit_log, user, wall0, wall1)
    passes = window / RECONCILE_INTERVAL
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=600s")
    return {"replicas": replicas, "ready_after_s": round(settle, 1), "requests_per_pass": round(sum(counts.values()) / passes, 1),
            "cpu_s_per_pass": round((cpu1 - cpu0) / passes, 3), "by_request": counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--applies", type=int, default=20, help="applies of the inline-job example (default 20)")
    ap.add_argument("--replicas", type=int, nargs="*", default=[10, 100, 1000], help="SandboxPool sizes (none: skip)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds the operator is watched per size")
    ap.add_argument("--cold", action="store_true", help="also build every program from empty caches")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kuberl-bench-cp-"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")
    try:
        if args.cold:
            print(f"cold build (empty Go and program caches): {cold_build(root / 'cold'):.0f} s")
        build.ensure_binaries()
        fresh, restart = start_times(root)
        print(f"warm start (programs cached, fresh folder): {fresh:.1f} s; restart of a stopped cluster: {restart:.1f} s")
        state = up(root / "cluster", pools=default_pools(mi300x=2, h100=4, cpu=8, pods_per_cpu_node=200), audit=True)
        kube = Kube(state)
        op = Operator(kube, install_chart_rbac(kube), root)
        op.start()  # KUBERL_RECONCILE_INTERVAL=5, as RECONCILE_INTERVAL says
        try:
            if args.applies:
                lat = apply_latencies(kube, args.applies)
                print(f"apply -> all {5} pods Running+Ready (examples/h100-inline.yaml, {len(lat)} applies): "
                      f"p50 {statistics.median(lat):.2f} s, p99 {percentile(lat, 0.99):.2f} s, "
                      f"min {min(lat):.2f} s, max {max(lat):.2f} s")
            for n in args.replicas:
                r = operator_load(kube, op, n, args.window, state.audit_log)
                top = ", ".join(f"{k} {v}" for k, v in sorted(r["by_request"].items(), key=lambda kv: -kv[1])[:6])
                print(f"SandboxPool {n:>5} replicas: Ready after {r['ready_after_s']:6.1f} s; operator "
                      f"{r['requests_per_pass']:6.1f} API requests and {r['cpu_s_per_pass']:.3f} CPU s per "
                      f"reconcile pass ({top})")
        finally:
            op.stop()
            down(Path(state.dir))
    finally:
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
