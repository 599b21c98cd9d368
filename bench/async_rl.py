"""Benchmark: synchronous RL vs asyncLevel 1 and 2 on the same work (INTELLECT-2 section 2.1).

One SFT run of the manifest (default examples/quickstart.yaml) makes a checkpoint; every arm
(asyncLevel 0, 1, 2) resumes a copy of it for the same RL steps, seeds and data, with the rollout
worker (a Ray actor: the engine and the scheduler) pinned to core 0 and the trainer to core 1, so
each side stands for its own hardware as trainer and fleet pods do on a cluster. Per arm: wall
time per RL step, trainer busy fraction (recompute + update over wall time), engine busy fraction
(time with a batch generating over wall time), held-out sampled accuracy after the stage and the
mean reward of the last steps, and each core's busy fraction over the arm (SFT included in the
synchronous arm). ``--ppo-epochs``, ``--mini-batches`` and ``--oversample`` change the balance
of update and generation, to find the configuration where they take similar time in the
synchronous run (the one where overlap can win most: ideal speed-up = (gen + update) /
max(gen, update)); ``--oversample 1 --mini-batches 1`` is one such, with one optimizer step
per batch (what INTELLECT-2 trains with, and what `kuberl validate` asks for at asyncLevel 2).
``--partial`` adds, for every asyncLevel above 0, an arm with ``algorithm.partialRollouts`` on
(a synchronous run pushes while nothing generates: its partial arm would be the same run).
``--together`` adds, for every asyncLevel above 1, an arm whose local engine lets the batches
in flight generate together, as paged engines do (``Engine.pads_rows`` off), instead of in turn
(the local engine's order): whether running ahead pays on it, and the staleness it runs at.

    python bench/async_rl.py [MANIFEST] [--steps 20] [--seeds 1] [--first-seed 0] [--levels 0,1,2]
        [--partial] [--together] [--ppo-epochs 1] [--mini-batches N] [--oversample N]
        [--out /tmp/async-rl]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.trainer.local import run_job

REPO = Path(__file__).resolve().parent.parent


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cpu_times() -> dict[str, tuple[int, int]]:
    """(busy, total) jiffies per core from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name != "cpu":
            v = [int(x) for x in vals]
            out[name] = (sum(v) - v[3] - v[4], sum(v))
    return out


def core_busy(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Busy fraction of each core between two :func:`cpu_times` (pure)."""
    return {
        f"{name}_busy": (after[name][0] - b[0]) / max(1, after[name][1] - b[1])
        for name, b in before.items()
        if name in ("cpu0", "cpu1")
    }


def batches_together(model, tokenizer):
    """The local engine as ``kuberl run`` builds it, marked as not padding rows, so the rollout
    worker lets the batches in flight generate together (``--together``). Module level: the
    Ray actor unpickles it."""
    from kuberl.rollout.local_engine import LocalEngine

    engine = LocalEngine(model, max_total_tokens=1 << 20, max_batch=512, seed=0)
    engine.pads_rows = False
    return engine


def arm_summary(records: list[dict]) -> dict[str, float]:
    """Figures of one arm's RL stage from its metrics records (pure)."""
    rl = [r for r in records if r.get("type") == "rl"]
    wall = sum(r["step_seconds"] for r in rl)
    upd = sum(r.get("update_seconds", 0.0) for r in rl)
    busy = sum(r.get("engine_busy_seconds", 0.0) for r in rl)
    evals = [r["accuracy"] for r in records if r.get("type") == "eval" and r.get("label") == "rl"]
    tail = rl[-5:]
    return {
        "steps": len(rl),
        "step_s": wall / max(1, len(rl)),
        "steps_per_hour": 3600 * len(rl) / wall if wall else float("nan"),
        "trainer_busy": upd / wall if wall else float("nan"),
        "engine_busy": busy / wall if wall else float("nan"),
        "gen_s_sync": sum(r["rollout_seconds"] for r in rl) / max(1, len(rl)),
        "update_s": upd / max(1, len(rl)),
        "accuracy": evals[-1] if evals else float("nan"),
        "reward_last5": sum(r["reward_mean"] for r in tail) / max(1, len(tail)),
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in rl) / max(1, len(rl)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifest", nargs="?", default=str(REPO / "examples" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=20, help="RL steps per arm")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0, help="seed offset of the first seed (to add seeds to a run)")
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--mini-batches", type=int, default=None, help="algorithm.miniBatches (default: the manifest's)")
    ap.add_argument("--oversample", type=int, default=None, help="algorithm.oversample (default: the manifest's)")
    ap.add_argument("--levels", default="0,1,2", help="asyncLevels to run; 0 always runs (the SFT and the baseline)")
    ap.add_argument("--partial", action="store_true", help="also each asyncLevel > 0 with partialRollouts on")
    ap.add_argument(
        "--together", action="store_true", help="also each asyncLevel > 1 with its batches generating together"
    )
    ap.add_argument("--out", default="/tmp/kuberl-async-rl")
    args = ap.parse_args(argv)
    base = find_one(load_manifests(args.manifest), AgenticRLJob)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.environ["KUBERL_ROLLOUT_CPUS"] = "0"  # the Ray actor (engine side) pins itself here
    # The sandbox answers the rollouts' tool calls: it belongs to the engine side (on a cluster it
    # is its own pods). Started by the trainer it would share the trainer's core, and tool calls
    # slowed by the update would stall generation (measured: 1.7x slower batches).
    from kuberl.rollout.worker import pin_to_cpus
    from kuberl.sandbox.service.local import running_sandbox

    sandbox = running_sandbox(workers=2, wrapper=["taskset", "-c", "0"])
    os.environ["KUBERL_SANDBOX_URL"] = sandbox.__enter__()
    pin_to_cpus("1")  # the trainer: every thread of this process (Ray workers set their own)
    levels = sorted({0, *(int(k) for k in args.levels.split(","))})
    arms = [(k, partial, False) for k in levels for partial in (False, True) if not partial or (args.partial and k > 0)]
    arms += [(k, False, True) for k in levels if args.together and k > 1]
    labels = {
        arm: f"async{arm[0]}" + ("+partial" if arm[1] else "") + ("+together" if arm[2] else "") for arm in arms
    }
    results: dict[tuple[int, bool, bool], list[dict[str, float]]] = {arm: [] for arm in arms}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        doc = base.model_dump(by_alias=True, exclude_none=True)
        spec = doc["spec"]
        spec["seed"] = base.spec.seed + seed
        spec["stages"][-1]["steps"] = args.steps
        spec["algorithm"]["ppoEpochs"] = args.ppo_epochs
        if args.mini_batches is not None:
            spec["algorithm"]["miniBatches"] = args.mini_batches
        if args.oversample is not None:
            spec["algorithm"]["oversample"] = args.oversample
        spec["trainer"]["threads"] = 1
        spec["checkpoint"].update(everySteps=10_000, keep=2, uri="checkpoints")  # in each run folder
        for arm in arms:
            k, partial, together = arm
            spec["algorithm"]["asyncLevel"] = k
            spec["algorithm"]["partialRollouts"] = partial
            job = AgenticRLJob.model_validate(doc)
            run = out / f"seed{seed}" / labels[arm]
            if k > 0:  # resume the synchronous arm's end-of-SFT checkpoint: same start for all
                sft = base.spec.stages[0].steps  # every stage ends with a checkpoint
                src = out / f"seed{seed}" / "async0" / "checkpoints" / f"ckpt-{sft:08d}.pt"
                (run / "checkpoints").mkdir(parents=True)
                shutil.copy(src, run / "checkpoints" / src.name)
            before = cpu_times()
            run_job(job, run, use_ray=True, quiet=True, engine_factory=batches_together if together else None)
            s = arm_summary(_records(run)) | core_busy(before, cpu_times())
            results[arm].append(s)
            print(
                f"seed {seed} {labels[arm]}: " + ", ".join(f"{key} {v:.3f}" for key, v in s.items()),
                flush=True,
            )
    print(f"\n{'':<28}" + "".join(f"{labels[arm]:>22}" for arm in arms))
    for key in (
        "step_s",
        "steps_per_hour",
        "trainer_busy",
        "engine_busy",
        "cpu0_busy",
        "cpu1_busy",
        "accuracy",
        "reward_last5",
        "staleness_mean",
    ):
        cells = []
        for arm in arms:
            vals = [r[key] for r in results[arm]]
            sd = f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else ""
            cells.append(f"{statistics.fmean(vals):.3f}{sd}")
        print(f"{key:<28}" + "".join(f"{c:>22}" for c in cells))
    sync = results[(0, False, False)]
    gen = statistics.fmean(r["gen_s_sync"] for r in sync)
    upd = statistics.fmean(r["update_s"] for r in sync)
    ideal = (gen + upd) / max(gen, upd)
    for arm in arms[1:]:
        speed = statistics.fmean(r["steps_per_hour"] for r in results[arm]) / statistics.fmean(
            r["steps_per_hour"] for r in sync
        )
        longer = max(gen, upd)
        step = statistics.fmean(r["step_s"] for r in results[arm])
        print(
            f"{labels[arm]}: {speed:.2f}x the synchronous steps/hour (ideal {ideal:.2f}x: generation "
            f"{gen:.2f} s + update {upd:.2f} s per synchronous step); step {step:.2f} s = "
            f"{step / longer:.2f}x the longer side (goal <= 1.1x)"
        )
    sandbox.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
