"""RoC ablation: GRPO-RoC vs plain GRPO from the same SFT checkpoint, same seed.

Runs the manifest (default examples/quickstart.yaml) once with ``grpo-roc`` (SFT + RL), then
resumes a copy of its end-of-SFT checkpoint with ``--algorithm grpo``, so both RL runs start
from identical weights, data order and seeds. Prints both curves of the tool-error ratio in
positive rollouts (paper fig. 4), reward, and the summary of each run:

    python bench/roc_ablation.py [examples/quickstart.yaml] [--out runs/roc-ablation]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.trainer.local import run_job, summarize


def _curve(history: list[dict], key: str) -> list[float]:
    return [h.get(key) if h.get(key) is not None else math.nan for h in history if h.get("type") == "rl"]


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - k + 1) : i + 1] if not math.isnan(x)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", nargs="?", default="examples/quickstart.yaml")
    ap.add_argument("--out", default="runs/roc-ablation")
    ap.add_argument("--no-ray", action="store_true", help="run the rollout worker in-process")
    args = ap.parse_args(argv)
    job = find_one(load_manifests(args.manifest), AgenticRLJob)
    job.spec.checkpoint.keep = 10_000  # keep the end-of-SFT checkpoint for the second run
    sft = [s for s in job.spec.stages if s.type == "sft"]
    if not sft or job.spec.stages[0].type != "sft":
        print("the manifest must start with an sft stage", file=sys.stderr)
        return 2
    sft_steps = sum(s.steps for s in job.spec.stages[:1])
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    use_ray = not args.no_ray
    results = {}
    results["grpo-roc"] = run_job(job, out / "grpo-roc", algorithm="grpo-roc", use_ray=use_ray)
    src = out / "grpo-roc" / "checkpoints" / f"ckpt-{sft_steps:08d}.pt"
    dst = out / "grpo" / "checkpoints"
    dst.mkdir(parents=True)
    shutil.copy(src, dst / src.name)
    shutil.copy(out / "grpo-roc" / "tokenizer.json", out / "grpo" / "tokenizer.json")
    results["grpo"] = run_job(job, out / "grpo", algorithm="grpo", use_ray=use_ray)

    curves = {a: _curve(r.history, "tool_error_ratio_positive") for a, r in results.items()}
    rewards = {a: _curve(r.history, "reward_mean") for a, r in results.items()}
    print("\nstep  tool-error ratio in positives (5-step mean)   reward mean")
    print("      grpo-roc   grpo                              grpo-roc   grpo")
    sm = {a: _smooth(c) for a, c in curves.items()}
    for i in range(max(len(c) for c in curves.values())):
        row = [sm[a][i] if i < len(sm[a]) else math.nan for a in ("grpo-roc", "grpo")]
        rw = [rewards[a][i] if i < len(rewards[a]) else math.nan for a in ("grpo-roc", "grpo")]
        print(
            f"{i + 1:4d}  {row[0]:8.3f}  {row[1]:8.3f}                              {rw[0]:8.3f}  {rw[1]:8.3f}"
        )
    summary = {a: summarize(r) for a, r in results.items()}
    for s in summary.values():
        first, last = s["tool_error_ratio_positive_first"], s["tool_error_ratio_positive_last"]
        s["tool_error_ratio_positive_drop"] = first - last
        s["tool_error_ratio_positive_last_over_first"] = last / first if first else math.nan
    print(json.dumps(summary, indent=1))
    r, g = summary["grpo-roc"], summary["grpo"]
    print(
        f"tool-error ratio in positives, first->last: grpo-roc {r['tool_error_ratio_positive_first']:.3f} -> "
        f"{r['tool_error_ratio_positive_last']:.3f}, grpo {g['tool_error_ratio_positive_first']:.3f} -> "
        f"{g['tool_error_ratio_positive_last']:.3f}; final/first ratio roc {r['tool_error_ratio_positive_last_over_first']:.2f}"
        f" vs grpo {g['tool_error_ratio_positive_last_over_first']:.2f}"
    )
    (out / "summary.json").write_text(json.dumps({"summary": summary, "curves": curves, "rewards": rewards}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
