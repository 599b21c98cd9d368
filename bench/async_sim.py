"""Paper scale, simulated: synchronous colocated vs asynchronous split RL steps on the same GPUs.

    python bench/async_sim.py                          # 64 GPUs, 512 prompts x 32 rollouts
    python bench/async_sim.py --gpus 16 --splits 8/8,10/6,12/4,14/2
    python bench/async_sim.py --gpus 8 --prompts 8 --splits 4/4,6/2 --batches 3   # a quick check

Same workload (seeded plans), engines, sandbox and trainer models as bench/cluster_sim.py
(bench/clustersim), on a fixed, pre-warmed sandbox pool (``--pool-cores-per-gpu`` of the
whole cluster, the same for every run) so that the comparison is about GPUs, not the pool.

* Synchronous colocated (asyncLevel 0): ``--sync-steps`` closed-loop steps on all G GPUs:
  rollout phase (simulated), update (8 FLOPs/param/token at 35 % MFU on G GPUs) and weight
  sync (2 GB/s write + read, 5 s reload), back to back.
* Asynchronous, for each split F engines / T = G - F trainer GPUs: the training state must fit
  T GPUs (``clustersim.asyncmodel.split_refusal``: 16 bytes a parameter sharded, 40 GB a GPU
  reserved; refused splits are printed with the reason). The fleet side is simulated: a run
  of ``--batches`` batches on F engines (``SimConfig.ahead`` = k: batch 0 at once, batches
  1..k at its end, then batch i at batch i-k's end, ``Scheduler.max_active`` at k batches and
  FIFO admission, as rollout/orchestrator.py and the rollout worker do with a trainer that keeps
  up), through the real Scheduler, SandboxClient and SandboxService, so the tail of long
  multi-turn rollouts is in it (``clustersim.asyncmodel.fleet_generation``):
  - asyncLevel 1: generation = batch 0's end; it runs alone, as every batch does at level 1
    (batch n+1 is submitted once batch n is collected). No extra run.
  - asyncLevel k >= 2 (one run each): the mean interval between batch ends after the first,
    each batch generating beside its predecessors: the fleet running ahead across a step.
  The trainer side is the model: update on T GPUs (the mean trained tokens of the simulated
  batches), then the push (the sync model, blocking the trainer); the fleet pauses for the
  reload. Step = max(update + push, generation + reload): the push in line, as the trainer did
  before ``BackgroundPush``. The "bg step" columns: the push on a thread from the step's start
  (trainer/weight_sync.py), the trainer waiting only for a copy of the weights
  (``--snapshot-gbps``, an assumption), the batches ahead submitted once the push and the
  collection are done; the step loop played out event by event
  (``clustersim.asyncmodel.timeline_step``, which gives the closed form above for the in-line
  push).
* Not modelled: the operator starting pods, evaluation, checkpoints, stragglers among trainer
  ranks, a push's network contending with the sandbox, and the learning effect of staleness
  (the one-machine run, bench/README.md, found accuracy inside the synchronous spread).

Cost: about linear in the rollouts simulated ((sync steps + batches x splits) x prompts): 44 s
of CPU at ``--gpus 8`` (2 + 3 x 4 batches of 2,048 rollouts), so ~2 min at ``--gpus 16`` and
~7-10 min at 64 GPUs (2 + 4 x 4 batches of 16,384).

Prints the per-phase times, steps/hour and the ratio to synchronous for every split and level,
then the best split per level with its ratio, the ideal (clustersim.asyncmodel.ideal_ratio)
and the staleness bound.
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

from clustersim.asyncmodel import (  # noqa: E402
    GpuSpec,
    TrainingMemory,
    bound_side,
    fleet_generation,
    ideal_ratio,
    max_staleness,
    pipelined_step,
    split_refusal,
    steps_per_hour,
    sync_step,
    timeline_step,
)
from clustersim.step import SimConfig, simulate  # noqa: E402
from clustersim.workload import TOOL_MIXES, TrainerModel, WorkloadSpec, make_plans, trained_tokens  # noqa: E402


def parse_splits(text: str, gpus: int) -> list[tuple[int, int]]:
    """ "32/32,48/16" -> [(32, 32), (48, 16)] (engines / trainer GPUs), each summing to ``gpus``."""
    out = []
    for part in text.split(","):
        try:
            f, t = (int(x) for x in part.strip().split("/"))
        except ValueError:
            raise ValueError(f"--splits wants ENGINES/TRAINER pairs like 48/16, got {part!r}") from None
        if f + t != gpus:
            raise ValueError(f"--splits {part}: {f} + {t} != --gpus {gpus}")
        out.append((f, t))
    return out


def default_splits(gpus: int) -> str:
    """The brief's 32/32, 40/24, 48/16, 56/8 at 64 GPUs, scaled to ``gpus``."""
    fleets = sorted({min(gpus - 1, max(1, round(gpus * x / 8))) for x in (4, 5, 6, 7)})
    return ",".join(f"{f}/{gpus - f}" for f in fleets)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--prompts", type=int, help="prompts per step (default 512 * gpus / 64)")
    ap.add_argument("--splits", help="ENGINES/TRAINER GPUs, comma separated (default: 1/2..7/8 of --gpus)")
    ap.add_argument("--levels", default="1,2", help="asyncLevels to report (1 or 2 and up)")
    ap.add_argument("--sync-steps", type=int, default=2)
    ap.add_argument("--batches", type=int, default=4, help="batches of each fleet run (>= 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tool-mix", choices=sorted(TOOL_MIXES), default="measured")
    ap.add_argument("--workers-per-pod", type=int, default=32)
    ap.add_argument("--pool-cores-per-gpu", type=float, default=2.0, help="fixed sandbox pool, of all GPUs")
    ap.add_argument(
        "--snapshot-gbps", type=float, default=10.0,
        help="GB/s at which the trainer copies the bf16 weights for a background push (an assumption)",
    )  # fmt: skip
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.gpus < 2 or args.sync_steps < 1 or args.batches < 3:
        ap.error("--gpus >= 2, --sync-steps >= 1 and --batches >= 3 are needed")
    try:
        splits = parse_splits(args.splits or default_splits(args.gpus), args.gpus)
        levels = [int(x) for x in args.levels.split(",")]
        if any(k < 1 for k in levels):
            raise ValueError(f"--levels must be >= 1, got {args.levels}")
    except ValueError as e:
        ap.error(str(e))
    prompts = args.prompts or max(1, round(512 * args.gpus / 64))
    spec = WorkloadSpec(prompts=prompts, tool_mix=TOOL_MIXES[args.tool_mix])
    pods = max(1, math.ceil(args.pool_cores_per_gpu * args.gpus / args.workers_per_pod))
    n_plans = max(args.sync_steps, args.batches)
    plans = [make_plans(spec, args.seed * 1000 + s) for s in range(n_plans)]
    base = SimConfig(
        workload=spec,
        seed=args.seed,
        workers_per_pod=args.workers_per_pod,
        pool_replicas=pods,
        pool_autoscaling=None,
    )
    print(
        f"{args.gpus} GPUs, {prompts} prompts x {spec.rollouts_per_prompt} rollouts, tool mix {args.tool_mix}, "
        f"fixed sandbox pool {pods}x{args.workers_per_pod} cores, seed {args.seed}"
    )

    t0 = time.perf_counter()
    sync_trainer = TrainerModel(gpus=args.gpus)
    sync = simulate(
        replace(
            base,
            engines=args.gpus,
            steps=args.sync_steps,
            plans=plans[: args.sync_steps],
            trainer=sync_trainer,
        )
    )
    roll = float(np.mean([st.rollout_s for st in sync.steps]))
    upd = float(np.mean([st.update_s for st in sync.steps]))
    syn = float(np.mean([st.sync_s for st in sync.steps]))
    sync_s = sync_step(roll, upd, syn)
    print(
        f"[synchronous: {args.sync_steps} steps simulated in {time.perf_counter() - t0:.0f} s]\n"
        f"synchronous colocated, {args.gpus} GPUs: rollout {roll:.0f} s + update {upd:.0f} s + sync {syn:.0f} s "
        f"= {sync_s:.0f} s a step, {steps_per_hour(sync_s):.2f} steps/h"
    )
    tokens = float(
        np.mean([trained_tokens(p, spec, sync_trainer.kept_per_prompt) for p in plans[: args.batches]])
    )
    mem, gpu = TrainingMemory(params=sync_trainer.params), GpuSpec()
    rows: list[dict] = []
    print(
        f"\n{'F/T':>7}{'GB/GPU':>8}"
        + "".join(f"{f'gen k{k}':>8}" for k in levels)
        + f"{'update':>8}{'push':>6}"
        + "".join(f"{f'step k{k}':>9}{'steps/h':>9}{'x sync':>8}{'bound':>9}{'bg step':>9}{'x sync':>8}" for k in levels)
    )
    # One fleet run per asyncLevel >= 2; batch 0 of any of them is asyncLevel 1's batch alone
    runs = sorted({k for k in levels if k >= 2}) or [1]
    for fleet, trainer in splits:
        refusal = split_refusal(args.gpus, fleet, mem, gpu)
        if refusal:
            print(f"{fleet:>3}/{trainer:<3}  refused: {refusal}")
            rows.append({"fleet": fleet, "trainer": trainer, "refused": refusal})
            continue
        t1 = time.perf_counter()
        ends: dict[int, list[float]] = {}
        for ahead in runs:
            n = args.batches if ahead > 1 else 1
            res = simulate(replace(base, engines=fleet, steps=n, plans=plans[:n], ahead=ahead))
            ends[ahead] = [st.end - res.steps[0].start for st in res.steps]  # collected, in order
        gen = {k: fleet_generation(ends[k if k > 1 else runs[0]], k) for k in levels}
        tm = TrainerModel(gpus=trainer)
        u, p, r = tm.update_seconds(tokens), tm.sync_seconds(), tm.reload_s
        row = {"fleet": fleet, "trainer": trainer, "gb_per_gpu": mem.per_gpu_gb(trainer), "batch_ends_s": ends,
               "generation_s": gen, "update_s": u, "push_s": p, "reload_s": r,
               "sim_cpu_s": time.perf_counter() - t1}  # fmt: skip
        line = f"{fleet:>3}/{trainer:<3}{row['gb_per_gpu']:>8.0f}" + "".join(
            f"{gen[k]:>8.0f}" for k in levels
        )
        line += f"{u:>8.0f}{p:>6.0f}"
        snap = tm.params * tm.bytes_per_param / (args.snapshot_gbps * 1e9)
        row["snapshot_s"] = snap
        for k in levels:
            step = pipelined_step(gen[k], u, p, r)
            bg = timeline_step(gen[k], u, p, r, k, snapshot_s=snap)
            row[f"k{k}"] = {"step_s": step, "steps_per_hour": steps_per_hour(step), "ratio": sync_s / step,
                            "bound": bound_side(gen[k], u, p, r), "background_push_step_s": bg,
                            "background_push_ratio": sync_s / bg}  # fmt: skip
            line += f"{step:>9.0f}{steps_per_hour(step):>9.2f}{sync_s / step:>8.2f}{row[f'k{k}']['bound']:>9}"
            line += f"{bg:>9.0f}{sync_s / bg:>8.2f}"
        print(line + f"   [{row['sim_cpu_s']:.0f} s]")
        rows.append(row)
    ideal = ideal_ratio(roll, upd, syn)
    print(
        "\n(gen k1: one batch alone on F engines; gen k2+: steady interval between batches that fill each "
        "other's tail; push blocks the trainer, the fleet pauses its reload; bg step: the push on a thread, "
        f"the trainer waits only for a {args.snapshot_gbps:g} GB/s copy of the weights, clustersim.asyncmodel.timeline_step)"
    )
    for k in levels:
        ok = [r for r in rows if "refused" not in r]
        if not ok:
            print(f"asyncLevel {k}: every split refused")
            continue
        best = max(ok, key=lambda r: r[f"k{k}"]["steps_per_hour"])
        b = best[f"k{k}"]
        print(
            f"asyncLevel {k}: best split {best['fleet']} engines / {best['trainer']} trainer GPUs, "
            f"{b['steps_per_hour']:.2f} steps/h = {b['ratio']:.2f}x synchronous ({b['bound']}-bound); "
            f"ideal {ideal:.2f}x (linear scaling, perfect overlap, free sync); staleness <= {max_staleness(k)}"
        )
        bgbest = max(ok, key=lambda r: r[f"k{k}"]["background_push_ratio"])
        print(
            f"asyncLevel {k}, push on a thread: best split {bgbest['fleet']} engines / {bgbest['trainer']} "
            f"trainer GPUs, {bgbest[f'k{k}']['background_push_ratio']:.2f}x synchronous"
        )
    if args.json:
        out = {"gpus": args.gpus, "prompts": prompts, "seed": args.seed, "tool_mix": args.tool_mix,
               "sync": {"rollout_s": roll, "update_s": upd, "sync_s": syn, "step_s": sync_s}, "ideal": ideal,
               "splits": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
