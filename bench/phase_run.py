"""Paper scale, simulated: a whole run whose phases change, on fixed fleets and on the autoscaled one.

    python bench/phase_run.py                      # 8 GPUs (1/8 of the paper's), asyncLevel 2
    python bench/phase_run.py --gpus 64            # the paper's 64 GPUs (~8x the CPU time)

rStar2-Agent's recipe (paper section 4) as an asynchronous split run: the trainer on half the
GPUs for the whole run, a RolloutFleet of up to the other half (one engine a GPU):

* SFT: 222K examples x 3 epochs of ``--sft-tokens`` tokens (an assumption) on the trainer alone,
  at the same FLOPs model as the RL update (clustersim.workload.TrainerModel); the data scaled
  with ``--gpus``/64 like the RL batches, so every figure is per-GPU the paper's;
* RL stage 1 at an 8K budget (300 steps; mean responses 1K, 2.5K, 4K over its thirds), stage 2 at
  12K (85 steps, 6K), stage 3 at 12K on harder problems with 15 turns (125 steps, 8K).

For each RL phase the event simulation (clustersim.step, the real Scheduler, sandbox service and
client) generates ``--batches`` batches of the phase's workload at asyncLevel ``--level`` on a
few fleet sizes; a batch's generation time is fitted as a + b/F (clustersim.phaserun). The
trainer's update is the FLOPs model of the phase's trained tokens, its push goes on a thread.

Then the whole run is played step by step (clustersim.phaserun): on every fixed fleet size
(engines held from start to end, SFT included), and on a fleet the operator's own autoscaler
sizes (kuberl.operator.decide.autoscale, from one engine; engines serve 120 s after they are created):
once with the asynchronous trainer's pipeline ratios deciding, once without them (KV usage and
the trainer's backlog only, how the operator decided before); and the floor no autoscaler can go
under (each phase's smallest fleet within 1 % of its fastest, from the phase's first step).
Goal (issue 31): the autoscaled fleet within 5 % of the best fixed fleet's steps/hour with at
least 25 % fewer GPU-hours.

Not modelled: the offline difficulty filter before stage 3, evaluation, checkpoints, the
learning effect of a different fleet size (staleness stays within asyncLevel either way).
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

from clustersim.asyncmodel import fleet_generation  # noqa: E402
from clustersim.phaserun import PhaseCosts, fit_generation, play_autoscaled, play_fixed, play_per_phase  # noqa: E402
from clustersim.step import MI300X_14B, SimConfig, simulate  # noqa: E402
from clustersim.workload import TrainerModel, WorkloadSpec, make_plans, trained_tokens  # noqa: E402

from kuberl.api.rollout_fleet import FleetAutoscaling  # noqa: E402

# (name, steps, response budget, mean response tokens, max turns): paper section 4, fig. 8
RL_PHASES = (
    ("stage1-1K", 100, 8192, 1000, 10),
    ("stage1-2.5K", 100, 8192, 2500, 10),
    ("stage1-4K", 100, 8192, 4000, 10),
    ("stage2-6K", 85, 12288, 6000, 10),
    ("stage3-8K", 125, 12288, 8000, 15),
)
SFT_EXAMPLES, SFT_EPOCHS = 222_000, 3  # 165K function calls + 30K instructions + 27K chat, 3 epochs
GOAL_STEPS, GOAL_GPU_HOURS = 0.95, 0.75


def mean_response(spec: WorkloadSpec, seed: int) -> float:
    return float(np.mean([p.response_tokens for p in make_plans(spec, seed)]))


def spec_for(base: WorkloadSpec, budget: int, mean_tokens: float, turns: int, seed: int) -> WorkloadSpec:
    """``base`` with the budget and turns given and the per-turn length that makes the mean
    response ``mean_tokens`` (bisection on the seeded plans; the budget caps what it can reach)."""
    lo, hi = 10.0, 20_000.0
    spec = replace(base, max_response_tokens=budget, max_turns=turns)
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if mean_response(replace(spec, turn_tokens_median=mid), seed) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return replace(spec, turn_tokens_median=math.sqrt(lo * hi))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--trainer-gpus", type=int, help="default: half of --gpus")
    ap.add_argument("--level", type=int, default=2, help="asyncLevel (>= 1)")
    ap.add_argument("--batches", type=int, default=3, help="batches simulated per phase and fleet size (>= 3)")
    ap.add_argument("--sim-fleets", help="fleet sizes simulated per phase (default: 1/4, 1/2, 1 of the fleet's GPUs)")
    ap.add_argument("--sft-tokens", type=float, default=1500.0, help="mean tokens of an SFT example (assumption)")
    ap.add_argument("--startup-s", type=float, default=120.0, help="an engine's start: pod and weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    trainer_gpus = args.trainer_gpus or args.gpus // 2
    max_fleet = args.gpus - trainer_gpus
    if trainer_gpus < 1 or max_fleet < 1 or args.level < 1 or args.batches < 3:
        ap.error("--gpus must leave >= 1 GPU to each side; --level >= 1; --batches >= 3")
    sim_fleets = sorted(
        {int(x) for x in args.sim_fleets.split(",")} if args.sim_fleets
        else {max(1, round(max_fleet * x)) for x in (0.25, 0.5, 1.0)}
    )  # fmt: skip
    if len(sim_fleets) < 2:
        ap.error("--sim-fleets needs >= 2 sizes")
    prompts = max(1, round(512 * args.gpus / 64))
    base = WorkloadSpec(prompts=prompts)
    trainer = TrainerModel(gpus=trainer_gpus)
    snapshot = trainer.params * trainer.bytes_per_param / 10e9  # bench/async_sim.py's --snapshot-gbps 10
    sft_tokens = SFT_EXAMPLES * SFT_EPOCHS * args.sft_tokens * args.gpus / 64
    sft_hours = trainer.update_seconds(sft_tokens) / 3600.0 * 6.0 / 8.0  # no pi_old forward in SFT
    print(
        f"{args.gpus} GPUs: trainer {trainer_gpus}, fleet 1..{max_fleet} engines; {prompts} prompts x "
        f"{base.rollouts_per_prompt} rollouts a step, asyncLevel {args.level}, seed {args.seed}; "
        f"SFT {sft_hours:.2f} h on the trainer"
    )
    phases: list[PhaseCosts] = [PhaseCosts("sft", hours=sft_hours)]
    rows = []
    print(f"\n{'phase':>12}{'steps':>6}{'budget':>7}{'mean':>6}" + "".join(f"{f'gen F={f}':>10}" for f in sim_fleets)
          + f"{'update':>8}{'push':>6}")  # fmt: skip
    for name, steps, budget, mean_tokens, turns in RL_PHASES:
        t0 = time.perf_counter()
        spec = spec_for(base, budget, mean_tokens, turns, args.seed)
        plans = [make_plans(spec, args.seed * 1000 + b) for b in range(args.batches)]
        gens = []
        for f in sim_fleets:
            cfg = SimConfig(
                workload=spec, seed=args.seed, engines=f, steps=args.batches, plans=plans, ahead=args.level,
                pool_replicas=max(1, math.ceil(2.0 * args.gpus / 32)), pool_autoscaling=None,
            )  # fmt: skip
            res = simulate(cfg)
            ends = [st.rollouts_done - res.steps[0].start for st in res.steps]
            gens.append((f, fleet_generation(ends, args.level)))
        tokens = float(np.mean([trained_tokens(p, spec, trainer.kept_per_prompt) for p in plans]))
        slots = MI300X_14B.capacity // (sum(spec.prompt_range) // 2 + budget)
        ph = PhaseCosts(
            name, steps, generation=fit_generation(gens), update_s=trainer.update_seconds(tokens),
            push_s=trainer.sync_seconds(), reload_s=trainer.reload_s, snapshot_s=snapshot,
            batch_rollouts=spec.rollouts, slots_per_engine=slots,
        )  # fmt: skip
        phases.append(ph)
        real_mean = float(np.mean([p.response_tokens for p in plans[0]]))
        rows.append({"phase": name, "steps": steps, "budget": budget, "mean_response": real_mean,
                     "generation_s": dict(gens), "update_s": ph.update_s, "push_s": ph.push_s,
                     "sim_cpu_s": time.perf_counter() - t0})  # fmt: skip
        print(f"{name:>12}{steps:>6}{budget:>7}{real_mean:>6.0f}" + "".join(f"{g:>10.0f}" for _, g in gens)
              + f"{ph.update_s:>8.0f}{ph.push_s:>6.0f}   [{time.perf_counter() - t0:.0f} s]")  # fmt: skip

    fixed = {f: play_fixed(phases, trainer_gpus, f, args.level) for f in range(1, max_fleet + 1)}
    best_f = max(fixed, key=lambda f: (round(fixed[f].steps_per_hour, 6), -fixed[f].gpu_hours))
    best = fixed[best_f]
    auto = FleetAutoscaling(minReplicas=1, maxReplicas=max_fleet)
    scaled = play_autoscaled(phases, trainer_gpus, auto, args.level, startup_s=args.startup_s)
    before = play_autoscaled(phases, trainer_gpus, auto, args.level, startup_s=args.startup_s, pipeline=False)
    floor = play_per_phase(phases, trainer_gpus, max_fleet, args.level, min_engines=auto.min_replicas)
    print(f"\n{'fleet':>22}{'hours':>8}{'steps/h':>9}{'GPU-h':>9}{'x best steps/h':>16}{'x best GPU-h':>14}"
          + "".join(f"{p.name:>13}" for p in phases))  # fmt: skip

    def line(label: str, r) -> str:
        means = "".join(f"{p['engines_mean']:>13.1f}" for p in r.phases)
        return (f"{label:>22}{r.hours:>8.1f}{r.steps_per_hour:>9.2f}{r.gpu_hours:>9.0f}"
                f"{r.steps_per_hour / best.steps_per_hour:>16.3f}{r.gpu_hours / best.gpu_hours:>14.3f}{means}")  # fmt: skip

    for f, r in fixed.items():
        print(line(f"fixed {f}" + (" (best)" if f == best_f else ""), r))
    print(line("autoscaled", scaled))
    print(line("autoscaled, no pipeline", before))
    print(line("per-phase floor", floor))
    print("(per phase: mean engines held)")
    steps_ratio = scaled.steps_per_hour / best.steps_per_hour
    gpu_ratio = scaled.gpu_hours / best.gpu_hours
    met = steps_ratio >= GOAL_STEPS and gpu_ratio <= GOAL_GPU_HOURS
    print(
        f"\nautoscaled vs the best fixed fleet ({best_f} engines): {steps_ratio:.3f}x its steps/hour "
        f"(goal >= {GOAL_STEPS}), {gpu_ratio:.3f}x its GPU-hours (goal <= {GOAL_GPU_HOURS}): "
        + ("goal met" if met else "goal missed")
    )
    near = [f for f, r in fixed.items() if r.steps_per_hour >= GOAL_STEPS * best.steps_per_hour]
    cheapest = min(near, key=lambda f: fixed[f].gpu_hours)
    print(
        f"the cheapest fixed fleet within 5 % of the best: {cheapest} engines, "
        f"{fixed[cheapest].gpu_hours / best.gpu_hours:.3f}x the best's GPU-hours; "
        f"autoscaled {scaled.gpu_hours / fixed[cheapest].gpu_hours:.3f}x of that"
    )
    print(
        f"the floor for any autoscaler (each phase's smallest fleet within 1 % of its fastest, sized at "
        f"the phase's first step, none starting): {floor.steps_per_hour / best.steps_per_hour:.3f}x the "
        f"best's steps/hour at {floor.gpu_hours / best.gpu_hours:.3f}x its GPU-hours; autoscaled "
        f"{scaled.gpu_hours / floor.gpu_hours:.3f}x the floor's GPU-hours"
    )
    if args.json:
        doc = {"gpus": args.gpus, "trainer_gpus": trainer_gpus, "level": args.level, "seed": args.seed,
               "sft_hours": sft_hours, "phases": rows, "best_fixed": best_f,
               "fixed": {f: {"hours": r.hours, "gpu_hours": r.gpu_hours} for f, r in fixed.items()},
               "autoscaled": {"hours": scaled.hours, "gpu_hours": scaled.gpu_hours, "phases": scaled.phases,
                              "engines_over_time": scaled.engines_over_time},
               "autoscaled_no_pipeline": {"hours": before.hours, "gpu_hours": before.gpu_hours},
               "per_phase_floor": {"hours": floor.hours, "gpu_hours": floor.gpu_hours, "phases": floor.phases},
               "goal_met": met}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
