"""What ``bench/peers.py`` prints: the equal-work table of both sides' step figures, and the
time-to-accuracy summary (TRL's final held-out accuracy, the time kuberl takes to reach it, the
two sides at equal wall-clock) with its PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import peers_curves as pc

GOAL_RATIO = 2 / 3  # issue 41: kuberl reaches TRL's final accuracy in at most 2/3 of TRL's wall-clock


def side_figures(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Per-step means of one run's step records, the warm-up step (the first) left out (pure).

    Records carry ``step_seconds``, ``generation_seconds``, ``tool_seconds``, ``update_seconds``
    (``push_seconds``: the part of it spent pushing weights to the engines),
    ``rollouts``, ``rows`` (rows the update trained on: kuberl drops groups whose rewards all
    tie, TRL trains every row), ``tokens`` (trained, model-written tokens) and ``reward_mean``.

    At equal work: ``rows_per_s`` (trained rows over step seconds) and ``update_s_per_row``
    (update seconds over trained rows), both over the timed steps together.
    """
    warm = steps[1:] if len(steps) > 1 else steps
    n = max(1, len(warm))

    def mean(key: str) -> float:
        vals = [float(r.get(key, 0.0)) for r in warm]
        return sum(vals) / n if vals else math.nan

    step_s = mean("step_seconds")
    upd_s = sum(float(r.get("update_seconds", 0.0)) for r in warm)
    rows = sum(float(r.get("rows", 0)) for r in warm)
    return {
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s if step_s > 0 else math.nan,
        "generation_s": mean("generation_seconds"),
        "tool_s": mean("tool_seconds"),
        "update_s": mean("update_seconds"),
        "push_s": mean("push_seconds"),  # TRL generates with the model it trains: none
        "samples_per_s": sum(float(r.get("rollouts", 0)) for r in warm) / max(1e-9, step_s * n),
        "trainer_tok_per_s": sum(float(r.get("tokens", 0.0)) for r in warm) / upd_s
        if upd_s > 0
        else math.nan,
        "rows_per_s": rows / max(1e-9, step_s * n) if warm else math.nan,
        "update_s_per_row": upd_s / rows if rows > 0 else math.nan,
    }


def kuberl_steps(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kuberl's RL step records in the common shape (pure).

    Generation is the wait for the step's rollouts, tool calls included: they run concurrently
    with other rollouts' generation, so ``tool_seconds`` (summed over calls) overlaps it. Update
    is everything else of the step: weight push, pi_old recomputation and the optimizer step.
    """
    out = []
    for r in metrics:
        if r.get("type") != "rl":
            continue
        roll = float(r.get("rollout_seconds", 0.0))
        out.append(
            {
                "step": r["step"],
                "step_seconds": r["step_seconds"],
                "generation_seconds": roll,
                "tool_seconds": float(r.get("tool_seconds", 0.0)),
                "update_seconds": r["step_seconds"] - roll,
                "push_seconds": float(r.get("sync_seconds", 0.0)),  # part of update_seconds
                "rollouts": r.get("rollouts", 0),
                "rows": 0.0 if r.get("skipped") else float(r.get("rollouts_kept", r.get("rollouts", 0))),
                "tokens": 0.0 if r.get("skipped") else float(r.get("tokens", 0.0)),
                "reward_mean": r.get("reward_mean", math.nan),
            }
        )
    return out


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "n/a"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}" if len(xs) > 1 else f"{m:.3f}"


def full_step_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[float, int]:
    """Their step seconds over ours, summed over the timed steps (the first left out) in which both
    sides trained the same number of rows (all of them, on TRL's side), and how many such steps
    (pure): the speed-up at equal work with nothing dropped."""
    pairs = [
        (a, b)
        for a, b in zip(ours[1:], theirs[1:], strict=False)
        if float(a.get("rows", 0)) == float(b.get("rows", 0)) > 0
    ]
    if not pairs:
        return math.nan, 0
    return sum(b["step_seconds"] for _, b in pairs) / sum(a["step_seconds"] for a, _ in pairs), len(pairs)


def report(results: dict[str, list[dict[str, Any]]], sft_acc: float, load: tuple, load_end: tuple) -> None:
    keys = [
        ("step_s", "step s (mean of steps 2..N)"),
        ("generation_s", "  generation s (tools inside)"),
        ("tool_s", "  tool calls s (sum of calls)"),
        ("update_s", "  update s (+push, +pi_old)"),
        ("push_s", "    of it weight push s"),
        ("steps_per_s", "RL steps/s"),
        ("samples_per_s", "samples/s"),
        ("trainer_tok_per_s", "trainer tok/s (trained tokens / update s)"),
        ("rows_per_s", "trained rows/s (equal work)"),
        ("update_s_per_row", "update s per trained row"),
        ("peak_rss_mb", "peak RSS MB (trainer process)"),
        ("peak_rss_children_mb", "peak RSS MB (largest child: vLLM server)"),
        ("heldout", "held-out accuracy after N steps"),
        ("reward_first", "train reward step 1"),
        ("reward_last", "train reward step N"),
    ]
    for runs in results.values():
        for r in runs:
            r["peak_rss_mb"] = r["summary"]["peak_rss_mb"]
            r["peak_rss_children_mb"] = r["summary"].get("peak_rss_children_mb", math.nan)
            r["reward_first"] = r["steps"][0].get("reward_mean", math.nan) if r["steps"] else math.nan
            r["reward_last"] = r["steps"][-1].get("reward_mean", math.nan) if r["steps"] else math.nan
    names = list(results)
    print(
        f"\nload average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at start, "
        f"{load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} at the end; held-out after SFT {sft_acc:.3f}"
    )
    print(f"{'':44s}" + "".join(f"{n:>22s}" for n in names))
    for k, label in keys:
        print(f"{label:44s}" + "".join(f"{spread([r[k] for r in results[n]]):>22s}" for n in names))
    for n in names:
        if not n.startswith("kuberl") or "trl" not in results:
            continue
        for k, label in (
            ("steps_per_s", "RL steps/s"),
            ("generation_s", "generation s"),
            ("update_s", "update s"),
            ("samples_per_s", "samples/s"),
            ("rows_per_s", "trained rows/s (equal work)"),
            ("update_s_per_row", "update s per trained row"),
        ):
            ours = sum(r[k] for r in results[n]) / len(results[n])
            theirs = sum(r[k] for r in results["trl"]) / len(results["trl"])
            print(f"{n}/trl {label}: {ours / theirs:.2f}x")
        pairs = [full_step_ratio(a["steps"], b["steps"]) for a, b in zip(results[n], results["trl"], strict=False)]
        both = [(x, k) for x, k in pairs if k]
        if both:
            mean = sum(x * k for x, k in both) / sum(k for _, k in both)
            print(f"{n}/trl speed-up on steps where both trained every row: {mean:.2f}x "
                  f"({sum(k for _, k in both)} steps over {len(both)} seeds)")
    print("reward curves (mean over seeds, per step):")
    for n in names:
        curve = [
            sum(r["steps"][i].get("reward_mean", math.nan) for r in results[n]) / len(results[n])
            for i in range(min(len(r["steps"]) for r in results[n]))
        ]
        print(f"  {n:12s} " + " ".join(f"{x:.3f}" for x in curve))


def seed_summary(trl: pc.Curve, ours: pc.Curve) -> dict[str, Any]:
    """One seed's time-to-accuracy figures (pure): TRL's final accuracy (the target), when each
    side first reached it, our time over TRL's whole run and over TRL's own first reach (None
    where we never reached it: a miss), and the two at equal wall-clock."""
    target = trl[-1][1]
    ours_t = pc.time_to_reach(ours, target)
    trl_end, trl_first = trl[-1][0], pc.time_to_reach(trl, target)
    return {
        "target": target,
        "trl_end_s": trl_end,
        "trl_first_s": trl_first,
        "ours_s": ours_t,
        "ratio": ours_t / trl_end if ours_t is not None and trl_end > 0 else None,
        "ratio_first": ours_t / trl_first if ours_t is not None and trl_first else None,
        "trl_improved": target > trl[0][1] + pc.EPS,  # else the start already "reaches" it
        "ours_final": ours[-1][1],
        "ours_end_s": ours[-1][0],
        **pc.equal_clock(ours, trl),
    }


def goals(summaries: list[dict[str, Any]], ratio: float = GOAL_RATIO) -> tuple[bool, bool]:
    """(every seed reached TRL's final accuracy within ``ratio`` of TRL's wall-clock, every seed at
    least as accurate at equal wall-clock on the time-weighted mean) (pure)."""
    fast = bool(summaries) and all(
        s["trl_improved"] and s["ratio"] is not None and s["ratio"] <= ratio + 1e-9 for s in summaries
    )
    accurate = bool(summaries) and all(s["mean_gap"] >= -1e-9 for s in summaries)
    return fast, accurate


def side_curves(runs: list[dict[str, Any]], start_acc: float) -> list[pc.Curve]:
    """Each run's curve from its clock and accuracies (JSON keys back to steps)."""
    return [
        pc.build_curve(
            start_acc,
            {int(k): float(v) for k, v in r["clock"].items()},
            {int(k): float(v) for k, v in r["evals"].items()},
        )
        for r in runs
    ]


def _s(x: float | None) -> str:
    return "missed" if x is None else f"{x:.0f} s"


def report_curves(results: dict[str, list[dict[str, Any]]], start_acc: float, plot: Path | None) -> None:
    """Print the time-to-accuracy summary per seed and the goals; write the PNG to ``plot``."""
    trl, ours = side_curves(results["trl"], start_acc), side_curves(results["kuberl"], start_acc)
    rows = [seed_summary(t, o) for t, o in zip(trl, ours, strict=False)]
    print(f"\nheld-out accuracy against training wall-clock (start: the SFT policy, {start_acc:.3f})")
    for name, curves in (("trl", trl), ("kuberl", ours)):
        for i, c in enumerate(curves):
            print(f"  {name:7s} seed {i}: " + "  ".join(f"{t:.0f}s {a:.3f}" for t, a in c))
    for i, s in enumerate(rows):
        ratio = "missed" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        first = "n/a" if s["ratio_first"] is None else f"{s['ratio_first']:.2f}x"
        print(
            f"seed {i}: TRL final held-out {s['target']:.3f} after {s['trl_end_s']:.0f} s (first reached at "
            f"{_s(s['trl_first_s'])}); kuberl reached it at {_s(s['ours_s'])} = {ratio} TRL's wall-clock "
            f"({first} TRL's first reach); kuberl final {s['ours_final']:.3f} after {s['ours_end_s']:.0f} s; "
            f"at equal wall-clock kuberl at least as accurate {100 * s['share_at_least']:.0f} % of "
            f"{s['span_s']:.0f} s, mean gap {s['mean_gap']:+.3f}"
            + ("" if s["trl_improved"] else " (TRL ended no better than the start: no time-to-accuracy figure)")
        )
    fast, accurate = goals(rows)
    print(
        f"goal (kuberl <= {GOAL_RATIO:.2f}x TRL's wall-clock to TRL's final accuracy, every seed): "
        f"{'met' if fast else 'MISSED'}; at least as accurate at equal wall-clock (every seed): "
        f"{'met' if accurate else 'MISSED'}"
    )
    if plot is not None:
        chart = pc.chart({"TRL": trl, "kuberl": ours}, "Held-out accuracy vs training wall-clock (s)")
        ratios = ", ".join("missed" if s["ratio"] is None else f"{s['ratio']:.2f}x" for s in rows)
        pc.write_png(chart, f"kuberl's time to TRL's final accuracy over TRL's wall-clock, per seed: {ratios}", plot)
        print(f"plot: {plot}")


