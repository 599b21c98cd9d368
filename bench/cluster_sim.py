"""Paper scale, simulated: rStar2-Agent RL steps on 64 MI300X through kuberl's own control code.

    python bench/cluster_sim.py                     # 64 GPUs, 512 prompts x 32 rollouts, 2 steps
    python bench/cluster_sim.py --gpus 16           # a quarter of it (about 4x faster)
    python bench/cluster_sim.py --tool-mix stress   # heavier tool calls (clustersim.workload)
    python bench/cluster_sim.py --json out.json --plot bench/cluster_sim.png

The 64-GPU run takes ~6.5 min of CPU (17 min wall on the shared, loaded 2-core machine).

A seeded discrete-event simulation (virtual clock; bench/clustersim) runs the real KV-aware
Scheduler, SandboxClient (retries), SandboxService (queue limit, 429 backpressure, batching,
503 while a pod stops) and the operator's autoscaling decisions (kuberl.operator.decide.autoscale)
against modelled engines, tool-call durations, pod start-up, update and weight sync.

1. Closed loop: every rollout generates on a simulated engine and sends its tool calls to a
   SandboxPool autoscaled by the operator's policy from one pod (the shape of
   examples/rstar2-mi300x.yaml: 32-core pods, max 64, 4 queued calls per worker). The
   RolloutFleet autoscaler runs in dry run (a colocated fleet keeps an engine per GPU): what it
   would do, from the engines' own gauges.
2. Replays of those steps' tool calls (same dispatch times and durations, no engines) price
   other pools: fixed pools of growing size, to find the fewest cores meeting the goal (mean
   tool latency <= 0.3 s and p99 <= 1 s, the paper's figure), then the same autoscaler with
   its minimum pre-warmed to that size ("after"). Each pod has its own queue and a call is
   bound to a pod when it arrives, so pods that start after a step's first burst cannot take
   the calls already queued: no scale-up policy fixes a cold first burst, capacity in place does.
3. The same autoscaler from one pod with the trainer announcing each rollout phase before it
   starts ("announced"): the pool has the phase's pods ready when its calls come
   (``rollout.phases``; the first phase by the per-GPU sizing rule) and drops back to
   its minimum for the update. Its core-seconds over the run are printed beside the others'.

Prints a table per scenario and step, the sizing answer in cores per GPU, and writes a PNG of
pods and latency over the steps. Exit status 1 when no fixed pool of the sweep meets the goal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clustersim.step import SimConfig, SimResult, latency_summary, simulate  # noqa: E402
from clustersim.workload import TOOL_MIXES, TrainerModel, WorkloadSpec, make_plans  # noqa: E402

from kuberl.api.rollout_fleet import FleetAutoscaling  # noqa: E402
from kuberl.api.sandbox_pool import SandboxAutoscaling  # noqa: E402

GOAL_MEAN_S, GOAL_P99_S = 0.3, 1.0


def meets_goal(lat: np.ndarray) -> bool:
    s = latency_summary(lat)
    return s["mean"] <= GOAL_MEAN_S and s["p99"] <= GOAL_P99_S


def scenario_rows(name: str, res: SimResult, workers_per_pod: int) -> list[dict]:
    """One row per step: where its time went, tool latency, pool size, rejections and retries."""
    rows = []
    tl = res.timeline
    for i, st in enumerate(res.steps):
        window = [s for s in tl if st.start <= s["t"] < st.end]
        lat = latency_summary(st.latency)
        rows.append(
            {
                "scenario": name,
                "step": i + 1,
                "step_s": st.end - st.start,
                "rollout_s": st.rollout_s,
                "critical_generation_s": st.critical["generation"],
                "critical_tools_s": st.critical["tools"],
                "critical_wait_engine_s": st.critical["wait_for_engine"],
                "update_s": st.update_s,
                "sync_s": st.sync_s,
                "calls": st.calls,
                "lat_mean_s": lat["mean"],
                "lat_p50_s": lat["p50"],
                "lat_p99_s": lat["p99"],
                "goal_met": meets_goal(st.latency),
                "failed": st.failed_calls,
                "peak_pods": max((s["pods_ready"] for s in window), default=0),
                "peak_cores": max((s["cores_ready"] for s in window), default=0),
                "mean_cores": float(np.mean([s["cores_ready"] for s in window])) if window else 0.0,
                "peak_queue": max((s["queue"] for s in window), default=0),
                "peak_engines": max((s["engines"] for s in window), default=0),
            }
        )
    rows[-1]["rejected_429"] = res.statuses.get("429", 0)
    rows[-1]["unavailable_503"] = res.statuses.get("503", 0)
    rows[-1]["retried"] = res.attempts - sum(st.calls for st in res.steps)
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'scenario':<32}{'step':>5}{'step s':>8}{'rollout':>8}{'gen*':>7}{'tools*':>7}{'wait*':>7}"
        f"{'update':>7}{'sync':>6}{'calls':>7}{'mean ms':>8}{'p50 ms':>7}{'p99 ms':>8}"
        f"{'pods pk':>8}{'cores pk':>9}{'cores avg':>10}{'queue pk':>9}  goal"
    )
    print(head)
    for r in rows:
        print(
            f"{r['scenario']:<32}{r['step']:>5}{r['step_s']:>8.0f}{r['rollout_s']:>8.0f}"
            f"{r['critical_generation_s']:>7.0f}{r['critical_tools_s']:>7.1f}{r['critical_wait_engine_s']:>7.0f}"
            f"{r['update_s']:>7.0f}{r['sync_s']:>6.0f}{r['calls']:>7}{1e3 * r['lat_mean_s']:>8.0f}"
            f"{1e3 * r['lat_p50_s']:>7.0f}{1e3 * r['lat_p99_s']:>8.0f}{r['peak_pods']:>8}{r['peak_cores']:>9}"
            f"{r['mean_cores']:>10.0f}{r['peak_queue']:>9}  {'met' if r['goal_met'] else 'MISSED'}"
        )
        if "rejected_429" in r:
            print(
                f"{'':<32}  rejected (429) {r['rejected_429']}, stopped pod (503) {r['unavailable_503']}, "
                f"retried requests {r['retried']}, failed calls {r['failed']}"
            )


def core_seconds(res: SimResult) -> float:
    """Cores ready, integrated over the run: what the pool cost (timeline samples as steps)."""
    tl = res.timeline
    return sum(a["cores_ready"] * (b["t"] - a["t"]) for a, b in zip(tl, tl[1:], strict=False))


def peak_cores(steps: list, window: float = 10.0) -> float:
    """Cores the busiest ``window`` of calls asks for: their execution seconds over the window."""
    best = 0.0
    for st in steps:
        if not st.costs.size:
            continue
        bins = (st.dispatch // window).astype(int)
        best = max(best, float(np.bincount(bins, weights=st.costs).max()) / window)
    return best


def fleet_report(res: SimResult) -> None:
    """What the RolloutFleet autoscaler (dry run) saw and would have done during the steps: from
    the engines' gauges only (before issue 18's fix) and with the trainer's backlog (after)."""
    if not res.fleet_observed:
        return
    busy = [(t, u, w) for t, u, w in res.fleet_observed if w > 0]
    if busy:
        print(
            f"fleet autoscaler (dry run, target KV 0.85): while rollouts waited for KV (up to "
            f"{max(w for _, _, w in busy)}), engines' mean KV usage was {min(u for _, u, _ in busy):.2f}-"
            f"{max(u for _, u, _ in busy):.2f}"
        )
    for label, decisions in (("engines' gauges only (before)", res.fleet_blind_decisions),
                             ("with the trainer's backlog (after)", res.fleet_decisions)):  # fmt: skip
        wanted = [d for d in decisions if d[4] != "hold"]
        lows = [d[2] for d in decisions]
        print(
            f"  {label}: would have changed replicas {len(wanted)} times"
            + (f", down to {min(lows)} engines" if lows else "")
            + (": " + ", ".join(f"t={t:.0f}s {a}->{b}" for t, a, b, _, _ in wanted[:6]) if wanted else "")
        )


def binned(res: SimResult, width: float = 5.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tool latency by dispatch time over the whole run: bin starts, mean and p99 per bin."""
    t = np.concatenate([st.start + st.dispatch for st in res.steps])
    lat = np.concatenate([st.latency for st in res.steps])
    edges = np.arange(0.0, t.max() + width, width)
    idx = np.digitize(t, edges) - 1
    mean = np.full(edges.size, np.nan)
    p99 = np.full(edges.size, np.nan)
    for b in np.unique(idx):
        sel = lat[idx == b]
        mean[b], p99[b] = sel.mean(), np.quantile(sel, 0.99)
    return edges, mean, p99


def plot(results: dict[str, SimResult], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    for name, res in results.items():
        t = [s["t"] for s in res.timeline]
        axes[0].step(t, [s["cores_ready"] for s in res.timeline], where="post", label=name)
        edges, mean, p99 = binned(res)
        (line,) = axes[1].plot(edges, 1e3 * mean, label=f"{name} mean")
        axes[1].plot(edges, 1e3 * p99, linestyle=":", color=line.get_color(), label=f"{name} p99")
    first = next(iter(results.values()))
    t = [s["t"] for s in first.timeline]
    axes[2].plot(t, [s["calls_inflight"] for s in first.timeline], label="tool calls in flight")
    axes[2].plot(t, [s["rollouts_active"] for s in first.timeline], label="rollouts on an engine")
    axes[2].plot(t, [s["rollouts_waiting"] for s in first.timeline], label="rollouts waiting for KV")
    if first.fleet_decisions:
        ax2 = axes[2].twinx()
        dt = [d[0] for d in first.fleet_decisions]
        ax2.step(dt, [d[2] for d in first.fleet_decisions], where="post", color="k", linestyle="--", label="")
        ax2.set_ylabel("engines the fleet autoscaler\nwould keep (dry run, dashed)", fontsize=8)
        ax2.set_ylim(bottom=0)
    for st in first.steps:
        for ax in axes:
            ax.axvspan(st.rollouts_done, st.end, color="0.9")
    axes[0].set_ylabel("sandbox cores ready")
    axes[1].set_ylabel("tool latency, ms (5 s bins)")
    axes[1].set_yscale("log")
    axes[1].axhline(1e3 * GOAL_MEAN_S, color="k", linewidth=0.5)
    axes[1].axhline(1e3 * GOAL_P99_S, color="k", linewidth=0.5, linestyle="--")
    axes[2].set_ylabel("closed-loop run")
    axes[2].set_xlabel("simulated seconds (grey: update + weight sync)")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=64, help="engines (one per GPU); prompts scale with it")
    ap.add_argument("--prompts", type=int, help="prompts per step (default 512 * gpus / 64)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers-per-pod", type=int, default=32)
    ap.add_argument("--pod-startup-s", type=float, default=15.0)
    ap.add_argument("--sweep-pod-cores", type=int, default=8, help="pod size of the fixed-pool sizing sweep")
    ap.add_argument(
        "--tool-mix",
        choices=sorted(TOOL_MIXES),
        default="measured",
        help="tool-call durations: classes measured on kuberl's sandbox, or the stress mix (clustersim.workload)",
    )
    ap.add_argument("--json", help="write every row and decision to this file")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parent / "cluster_sim.png"))
    args = ap.parse_args(argv)
    if args.gpus < 1 or args.steps < 1 or args.workers_per_pod < 1:
        ap.error("--gpus, --steps and --workers-per-pod must be >= 1")
    prompts = args.prompts or max(1, round(512 * args.gpus / 64))
    spec = WorkloadSpec(prompts=prompts, tool_mix=TOOL_MIXES[args.tool_mix])
    # examples/rstar2-mi300x.yaml's pool, down to one pod at idle: the autoscaler alone sizes it
    auto = SandboxAutoscaling(
        minReplicas=1, maxReplicas=max(2, round(64 * args.gpus / 64)), targetQueuePerWorker=4
    )
    # The example fleet's autoscaling, in dry run: a colocated fleet keeps every GPU's engine
    fleet_auto = FleetAutoscaling(
        minReplicas=4, maxReplicas=args.gpus, targetKVCacheUtilization=0.85, scaleDownStabilizationSeconds=300
    )
    base = SimConfig(
        workload=spec,
        steps=args.steps,
        seed=args.seed,
        engines=args.gpus,
        workers_per_pod=args.workers_per_pod,
        pod_startup_s=args.pod_startup_s,
        pool_replicas=auto.min_replicas,
        pool_autoscaling=auto,
        trainer=TrainerModel(gpus=args.gpus),
    )
    print(
        f"{args.gpus} engines, {prompts} prompts x {spec.rollouts_per_prompt} rollouts, up to {spec.max_turns} "
        f"turns, {spec.max_response_tokens} tokens; pool pods of {args.workers_per_pod} cores, "
        f"autoscaled {auto.min_replicas}-{auto.max_replicas}, start-up {args.pod_startup_s:g} s; "
        f"tool mix {args.tool_mix}"
    )
    t0 = time.perf_counter()
    plans = [make_plans(spec, args.seed * 1000 + s) for s in range(args.steps)]
    closed = simulate(replace(base, plans=plans, fleet_autoscaling=fleet_auto, fleet_dry_run=True))
    print(f"[closed loop simulated in {time.perf_counter() - t0:.0f} s]")
    before = f"autoscaled from {auto.min_replicas} pod (before)"
    results = {before: closed}
    trace = closed.steps
    t1 = time.perf_counter()

    # Sizing: the fewest cores of a fixed pool that meets the goal in every step, from 3/4 of
    # what the busiest 10 s of calls ask for, up by 25 % a try.
    pod = args.sweep_pod_cores
    cpu_s = sum(float(st.costs.sum()) for st in trace) / len(trace)
    peak = peak_cores(trace)
    pods = max(1, math.ceil(0.75 * peak / pod))
    sizing: tuple[int, str] | None = None
    fixed_rows: list[dict] = []
    for attempt in range(8):
        res = simulate(
            replace(base, replay=trace, pool_autoscaling=None, pool_replicas=pods, workers_per_pod=pod)
        )
        name = f"fixed {pods}x{pod} cores"
        fixed_rows += scenario_rows(name, res, pod)
        if attempt == 0 or all(meets_goal(st.latency) for st in res.steps):
            results[name] = res  # the first (too few, usually) and the one that meets the goal
        if all(meets_goal(st.latency) for st in res.steps):
            sizing = (pods * pod, name)
            break
        pods = max(pods + 1, math.ceil(pods * 1.25))
    # Announced: the same autoscaler from one pod, with the trainer announcing each rollout
    # phase before it starts (issue 31): the pool has the phase's pods ready, then shrinks back.
    announced = f"announced from {auto.min_replicas} pod"
    results[announced] = simulate(replace(base, replay=trace, announce=True))
    # After: the same autoscaler, its minimum pre-warmed to the sizing (pods of the pool's shape).
    if sizing:
        warm = min(auto.max_replicas, math.ceil(sizing[0] / args.workers_per_pod))
        warm_auto = auto.model_copy(update={"min_replicas": warm})
        after = f"autoscaled from {warm} pods (after)"
        results[after] = simulate(replace(base, replay=trace, pool_autoscaling=warm_auto, pool_replicas=warm))
    rows = [
        r
        for name, res in results.items()
        if not name.startswith("fixed")
        for r in scenario_rows(name, res, args.workers_per_pod)
    ]
    rows += fixed_rows
    print(f"[replays simulated in {time.perf_counter() - t1:.0f} s]\n")
    print_table(rows)
    calls = np.mean([st.calls for st in trace])
    print(
        f"\nper step: {calls:.0f} tool calls, {cpu_s:.0f} core-seconds of execution "
        f"(mean {cpu_s / calls * 1e3:.0f} ms a call), rollout phase {np.mean([st.rollout_s for st in trace]):.0f} s"
    )
    print("\nthe pool from the run's start to its last step's end, core-seconds:")
    for name, res in results.items():
        met = all(meets_goal(st.latency) for st in res.steps)
        print(f"  {name:<34}{core_seconds(res):>10.0f}  goal {'met in every step' if met else 'MISSED'}")
    fleet_report(closed)
    print(f"busiest 10 s of a step asked for {peak:.0f} cores of execution")
    if sizing:
        cores, name = sizing
        print(
            f"goal (mean <= {GOAL_MEAN_S:g} s, p99 <= {GOAL_P99_S:g} s) met by a fixed pool of {cores} cores "
            f"({name}): {cores / args.gpus:.2f} cores per GPU"
        )
    else:
        print("goal NOT met by any fixed pool of the sweep")
    if args.plot and plot(results, args.plot, f"{args.gpus} GPUs, {prompts} prompts x 32 rollouts per step"):
        print(f"plot: {args.plot}")
    if args.json:
        out = {
            "rows": rows,
            "pool_decisions": {k: v.pool_decisions for k, v in results.items()},
            "statuses": {k: v.statuses for k, v in results.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0 if sizing else 1


if __name__ == "__main__":
    sys.exit(main())
