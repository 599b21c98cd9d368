"""Benchmark: a real pretrained LLM trained end to end on this machine (examples/smollm2-cpu.yaml).

Runs ``kuberl run`` on the manifest (SmolLM2-135M-Instruct on a local vLLM server, the real
sandbox, SFT then GRPO-RoC) and reports, from the run's metrics.jsonl: held-out sampled accuracy
(256 problems, T=1, one sample each) after SFT and after RL, wall time, rollout tokens/s (sampled
tokens over generation time) and update tokens/s (trained tokens over the rest of the step:
old-logprob recomputation, the update and the weight push). Goal (the real-model issue): +10
points of held-out accuracy within 45 minutes on the 2-core machine.

    python bench/real_model.py [--manifest examples/smollm2-cpu.yaml] [--seed N] [--out /tmp/real-model]

``--seed N`` runs a copy of the manifest with ``spec.seed: N`` (written into the run folder).
A manifest with ``algorithm.lengthReward`` (examples/smollm2-thinking-budgets.yaml) also reports
how the responses kept their budgets: mean |l_target - l_y| per target and adherence, over the
first and last RL steps and on the held-out set after SFT and after RL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def summarize(metrics: list[dict]) -> dict[str, float]:
    """The figures of one run from its metrics records (pure, for reuse on any run folder)."""
    evals = {r["label"]: r["accuracy"] for r in metrics if r.get("type") == "eval"}
    rl = [r for r in metrics if r.get("type") == "rl"]
    trained_steps = [r for r in rl if not r.get("skipped")]  # a step whose groups all tie trains nothing
    sft = [r for r in metrics if r.get("type") == "sft"]
    gen_s = sum(r.get("rollout_seconds", 0.0) for r in rl)
    rest_s = sum(r["step_seconds"] - r.get("rollout_seconds", 0.0) for r in trained_steps)
    sampled = sum(r.get("response_length", 0.0) * r.get("rollouts", 0.0) for r in rl)
    trained = sum(r.get("tokens", 0.0) for r in trained_steps)
    return {
        "acc_after_sft": evals.get("sft", float("nan")),
        "acc_after_rl": evals.get("rl", float("nan")),
        "rl_steps": len(rl),
        "rl_steps_trained": len(trained_steps),
        "sft_steps": len(sft),
        "sft_seconds": sum(r["step_seconds"] for r in sft),
        "rl_step_seconds_mean": sum(r["step_seconds"] for r in rl) / len(rl) if rl else float("nan"),
        "rollout_tok_s": sampled / gen_s if gen_s else float("nan"),
        "update_tok_s": trained / rest_s if rest_s else float("nan"),
        "reward_first5": sum(r["reward_mean"] for r in rl[:5]) / max(1, len(rl[:5])),
        "reward_last5": sum(r["reward_mean"] for r in rl[-5:]) / max(1, len(rl[-5:])),
    }


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def budget_summary(metrics: list[dict], window: int = 10) -> list[tuple[str, dict[str, float]]]:
    """How responses kept their thinking budgets (pure): per row (eval after SFT, first and last
    ``window`` RL steps, eval after RL) the mean |l_target - l_y| overall and per target and the
    adherence; [] for a run without a length reward."""
    keys = sorted(
        {k for r in metrics for k in r if k.startswith("length_gap") or k.startswith("length_adherence")}
    )
    if not keys:
        return []
    rl = [r for r in metrics if r.get("type") == "rl"]
    evals = {r["label"]: r for r in metrics if r.get("type") == "eval"}
    rows = [
        ("held-out after SFT", [evals["sft"]] if "sft" in evals else []),
        (f"RL steps 1-{min(window, len(rl))}", rl[:window]),
        (f"RL steps {max(1, len(rl) - window + 1)}-{len(rl)}", rl[-window:]),
        ("held-out after RL", [evals["rl"]] if "rl" in evals else []),
    ]
    return [(label, {k: _mean(rs, k) for k in keys}) for label, rs in rows if rs]


def _budget_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    keys = list(rows[0][1])
    gaps = ["length_gap_mean"] + sorted(
        (k for k in keys if k.startswith("length_gap_t")), key=lambda k: int(k.removeprefix("length_gap_t"))
    )
    head = [
        "|l_target - l_y|" if k == "length_gap_mean" else f"target {k.removeprefix('length_gap_t')}"
        for k in gaps
    ]
    lines = [f"{'':22}" + "".join(f"{h:>18}" for h in head) + f"{'within 10 %':>14}"]
    for label, vals in rows:
        cells = "".join(f"{vals.get(k, float('nan')):>18.1f}" for k in gaps)
        lines.append(f"{label:22}{cells}{100 * vals.get('length_adherence', float('nan')):>13.1f}%")
    return "\n".join(lines)


def seeded_manifest(manifest: Path, seed: int, folder: Path) -> Path:
    """A copy of ``manifest`` with ``spec.seed`` set, written into ``folder``."""
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["seed"] = seed
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{manifest.stem}-seed{seed}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def report(out: Path, load: float | None, wall: float | None, code: int) -> None:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s = summarize(metrics)
    if wall is not None:
        print(f"\nload average at start {load:.2f}; kuberl run exit {code}; wall {wall:.0f} s")
    print(
        f"held-out sampled accuracy: after SFT {100 * s['acc_after_sft']:.1f} %, after "
        f"{s['rl_steps']} GRPO-RoC steps {100 * s['acc_after_rl']:.1f} % "
        f"({100 * (s['acc_after_rl'] - s['acc_after_sft']):+.1f} points; goal +10 within 45 min)"
    )
    print(
        f"SFT {s['sft_steps']} steps in {s['sft_seconds']:.0f} s; RL step {s['rl_step_seconds_mean']:.1f} s mean "
        f"({s['rl_steps_trained']} of {s['rl_steps']} steps had a group to train on); rollout "
        f"{s['rollout_tok_s']:.0f} tok/s sampled; update {s['update_tok_s']:.0f} tok/s trained "
        "(recompute + update + weight push)"
    )
    print(f"train reward: first 5 steps {s['reward_first5']:.3f}, last 5 {s['reward_last5']:.3f}")
    budgets = budget_summary(metrics)
    if budgets:
        print("thinking budgets (tokens the model wrote against the target its prompt named):")
        print(_budget_table(budgets))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=str(REPO / "examples" / "smollm2-cpu.yaml"))
    ap.add_argument("--out", default="/tmp/kuberl-real-model")
    ap.add_argument(
        "--keep", action="store_true", help="resume an existing run folder instead of starting afresh"
    )
    ap.add_argument("--report", action="store_true", help="only summarize the run folder --out (no run)")
    ap.add_argument("--seed", type=int, default=None, help="run the manifest with spec.seed set to this")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        report(out, None, None, 0)
        return 0
    if out.exists() and not args.keep:
        shutil.rmtree(out)
    manifest = Path(args.manifest)
    if args.seed is not None:
        manifest = seeded_manifest(manifest, args.seed, out.parent / f"{out.name}-manifest")
    # the manifest's checkpoint.uri is relative: inside the run folder
    load = os.getloadavg()
    t0 = time.monotonic()
    env = dict(os.environ, KUBERL_NO_RAY="1")
    done = subprocess.run([sys.executable, "-m", "kuberl", "run", str(manifest), "--out", str(out)], env=env)
    wall = time.monotonic() - t0
    report(out, load[0], wall, done.returncode)
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
