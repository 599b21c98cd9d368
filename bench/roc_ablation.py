"""RoC ablation: GRPO-RoC vs plain GRPO from the same SFT checkpoint, same seed, over N seeds.

For each seed, runs the manifest (default examples/quickstart.yaml) once with ``grpo-roc`` (SFT +
RL), then resumes a copy of its end-of-SFT checkpoint with ``--algorithm grpo``, so both RL runs
of a seed start from identical weights, data order and rollout seeds. Seed k sets the job's
``spec.seed`` to base + k (model init, sampling, RoC draws); the data and tokenizer stay the
same. One run is noisy on a task this small, so with ``--seeds N`` the script prints the mean
and spread (sample standard deviation, min..max) of every summary number per arm, and the
per-step curves of the tool-error ratio in positive rollouts (paper fig. 4) and of the reward,
averaged over seeds:

    python bench/roc_ablation.py [examples/quickstart.yaml] [--seeds 3] [--out runs/roc-ablation]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.trainer.local import run_job, summarize
from kuberl.trainer.stage_host import RunResult
from kuberl.trainer.step_record import StepRecord

ARMS = ("grpo-roc", "grpo")


def _curve(history: list[StepRecord], figure: Callable[[StepRecord], float | None]) -> list[float]:
    return [v if (v := figure(h)) is not None else math.nan for h in history if h.type == "rl"]


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - k + 1) : i + 1] if not math.isnan(x)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if x is not None and not math.isnan(x)]


def spread(xs: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (NaN for one value), min and max of the finite values."""
    v = _finite(xs)
    if not v:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    std = statistics.stdev(v) if len(v) > 1 else math.nan
    return {"mean": statistics.fmean(v), "std": std, "min": min(v), "max": max(v), "n": len(v)}


def mean_curve(curves: list[list[float]]) -> list[float]:
    """Per-step mean over seeds (NaN where no seed has a value)."""
    steps = max((len(c) for c in curves), default=0)
    return [spread([c[i] for c in curves if i < len(c)])["mean"] for i in range(steps)]


def run_seed(job: AgenticRLJob, out: Path, use_ray: bool) -> dict[str, RunResult]:
    """Both arms for one seed: grpo-roc from scratch, grpo from its end-of-SFT checkpoint."""
    sft_steps = job.spec.stages[0].steps
    results = {"grpo-roc": run_job(job, out / "grpo-roc", algorithm="grpo-roc", use_ray=use_ray)}
    src = out / "grpo-roc" / "checkpoints" / f"ckpt-{sft_steps:08d}.pt"
    dst = out / "grpo" / "checkpoints"
    dst.mkdir(parents=True)
    shutil.copy(src, dst / src.name)  # the checkpoint carries its tokenizer
    results["grpo"] = run_job(job, out / "grpo", algorithm="grpo", use_ray=use_ray)
    return results


def _summary(result: RunResult) -> dict[str, float]:
    s = summarize(result)
    first, last = s["tool_error_ratio_positive_first"], s["tool_error_ratio_positive_last"]
    s["tool_error_ratio_positive_drop"] = first - last
    return s


def _fmt(sp: dict[str, float]) -> str:
    if not sp["n"]:
        return "-"
    std = "" if math.isnan(sp["std"]) else f" ± {sp['std']:.3f}"
    return f"{sp['mean']:.3f}{std} [{sp['min']:.3f}..{sp['max']:.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", nargs="?", default="examples/quickstart.yaml")
    ap.add_argument("--out", default="runs/roc-ablation")
    ap.add_argument("--seeds", type=int, default=1, help="independent seeds per arm (spec.seed + k)")
    ap.add_argument("--no-ray", action="store_true", help="run the rollout worker in-process")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        print("--seeds must be >= 1", file=sys.stderr)
        return 2
    base = find_one(load_manifests(args.manifest), AgenticRLJob)
    if base.spec.stages[0].type != "sft":
        print("the manifest must start with an sft stage", file=sys.stderr)
        return 2
    base.spec.checkpoint.keep = 10_000  # keep the end-of-SFT checkpoint for the second arm
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    per_seed: list[dict[str, RunResult]] = []
    for k in range(args.seeds):
        job = base.model_copy(deep=True)
        job.spec.seed = base.spec.seed + k
        per_seed.append(run_seed(job, out / f"seed-{job.spec.seed}", use_ray=not args.no_ray))

    curves = {a: [_curve(r[a].history, lambda h: h.tool_error_ratio_positive) for r in per_seed] for a in ARMS}
    rewards = {a: [_curve(r[a].history, lambda h: h.reward_mean) for r in per_seed] for a in ARMS}
    sm = {a: _smooth(mean_curve(curves[a])) for a in ARMS}
    rw = {a: mean_curve(rewards[a]) for a in ARMS}
    print(f"\nmean over {args.seeds} seed(s)")
    print("step  tool-error ratio in positives (5-step mean)   reward mean")
    print("      grpo-roc   grpo                              grpo-roc   grpo")
    for i in range(max(len(c) for c in sm.values())):
        t = [sm[a][i] if i < len(sm[a]) else math.nan for a in ARMS]
        r = [rw[a][i] if i < len(rw[a]) else math.nan for a in ARMS]
        print(f"{i + 1:4d}  {t[0]:8.3f}  {t[1]:8.3f}                              {r[0]:8.3f}  {r[1]:8.3f}")

    summaries = {a: [_summary(r[a]) for r in per_seed] for a in ARMS}
    keys = list(summaries["grpo-roc"][0])
    table = {a: {k: spread([s[k] for s in summaries[a]]) for k in keys} for a in ARMS}
    print(f"\n{'metric':<36}{'grpo-roc: mean ± std [min..max]':<40}grpo")
    for k in keys:
        print(f"{k:<36}{_fmt(table['grpo-roc'][k]):<40}{_fmt(table['grpo'][k])}")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "seeds": args.seeds,
                "spread": table,
                "per_seed": summaries,
                "curves": curves,
                "rewards": rewards,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
