"""A whole run whose phases change, played step by step on a fixed or an autoscaled fleet (pure;
bench/phase_run.py).

An asynchronous split run (docs/cluster.md): the trainer holds T GPUs for the whole run, the
RolloutFleet F engines (one GPU each). The run is a list of phases: SFT (the trainer alone,
``hours`` long: no rollouts) and RL phases of ``steps`` steps whose response budgets and lengths
differ. An RL phase's costs come from the event simulation (``clustersim.step``): the fleet's
generation per batch on F engines at the phase's asyncLevel, the trainer's update, its push
(on a thread: the trainer waits for a copy of the weights) and the engines' reload; a step is
``asyncmodel.timeline_step`` of them.

The fleet is either fixed (F engines from start to end, SFT included) or autoscaled by the
operator's own decisions (``kuberl.operator.decide.autoscale``: ``recommend_fleet``, then ``decide``
with the fleet's bounds and stabilization window), read once a step from what the trainer
exports (its rollout wait and engine idle ratios) and, before the first RL step reports, from
its backlog. An engine it adds serves ``startup_s`` later (pod start and weight load) but holds
its GPU from the moment it is created; one it removes is gone at once (its rollouts are handed
to the others, rollout/loop.py). GPU-hours are the trainer's T for the whole run plus every
engine's time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.operator.decide import autoscale

from .asyncmodel import timeline_step


@dataclass(frozen=True)
class PhaseCosts:
    """One phase of the run. SFT: ``steps`` 0 and ``hours``. RL: ``generation`` maps engines to
    one batch's generation seconds (from the event simulation, :func:`fit_generation`)."""

    name: str
    steps: int = 0
    hours: float = 0.0
    generation: Callable[[int], float] | None = None
    update_s: float = 0.0
    push_s: float = 0.0
    reload_s: float = 0.0
    snapshot_s: float = 0.0
    batch_rollouts: int = 0  # rollouts of one step's batch
    slots_per_engine: int = 1  # rollouts an engine admits at once (KV capacity / reservation)

    @property
    def is_rl(self) -> bool:
        return self.steps > 0


def fit_generation(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """gen(F) = a + b / F through the simulated (engines, seconds) points (least squares in 1/F):
    a batch's work divided over the engines plus what does not shrink with them (the tail of
    the longest multi-turn rollouts). Refuses fewer than two points."""
    if len(points) < 2:
        raise ValueError(f"a generation curve needs >= 2 simulated fleet sizes, got {len(points)}")
    xs = [1.0 / f for f, _ in points]
    ys = [g for _, g in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mx

    def gen(engines: int) -> float:
        if engines < 1:
            raise ValueError(f"a fleet generates with >= 1 engine, got {engines}")
        return max(0.0, a + b / engines)

    return gen


def step_seconds(phase: PhaseCosts, engines: int, level: int) -> float:
    """Steady step time of ``phase`` on ``engines`` at asyncLevel ``level`` (push on a thread)."""
    assert phase.generation is not None
    return timeline_step(
        phase.generation(engines), phase.update_s, phase.push_s, phase.reload_s, level, snapshot_s=phase.snapshot_s
    )


def pipeline_ratios(phase: PhaseCosts, engines: int, step_s: float) -> tuple[float, float]:
    """What the trainer exports after such a step: the fraction it waited for rollouts (its step
    beyond its own work: the weights' copy and the update) and the fraction the engines had no
    batch to generate (the step beyond one batch and its reload)."""
    assert phase.generation is not None
    trainer = phase.snapshot_s + phase.update_s
    fleet = phase.generation(engines) + phase.reload_s
    return max(0.0, step_s - trainer) / step_s, max(0.0, step_s - fleet) / step_s


@dataclass
class RunRecord:
    """What a run cost: hours, GPU-hours, and per phase the steps/hour and mean engines."""

    hours: float = 0.0
    gpu_hours: float = 0.0
    rl_steps: int = 0
    phases: list[dict[str, float | str]] = field(default_factory=list)
    engines_over_time: list[tuple[float, int]] = field(default_factory=list)  # (hour, engines held)

    @property
    def steps_per_hour(self) -> float:
        return self.rl_steps / self.hours if self.hours > 0 else math.nan


def play_fixed(phases: Sequence[PhaseCosts], trainer_gpus: int, engines: int, level: int) -> RunRecord:
    """The run on a fleet of ``engines`` held from start to end."""
    rec = RunRecord()
    for ph in phases:
        seconds = ph.hours * 3600.0 if not ph.is_rl else ph.steps * step_seconds(ph, engines, level)
        rec.hours += seconds / 3600.0
        rec.rl_steps += ph.steps
        rec.phases.append({"phase": ph.name, "hours": seconds / 3600.0, "engines_mean": float(engines)})
    rec.gpu_hours = rec.hours * (trainer_gpus + engines)
    rec.engines_over_time = [(0.0, engines), (rec.hours, engines)]
    return rec


def play_per_phase(
    phases: Sequence[PhaseCosts], trainer_gpus: int, max_engines: int, level: int, *,
    min_engines: int = 1, within: float = 0.01,
) -> RunRecord:
    """The floor for any autoscaler: in each RL phase the smallest fleet whose steps are within
    ``within`` of that phase's fastest (up to ``max_engines``), ``min_engines`` through SFT, each
    change made at the phase's first step with no start-up. An autoscaler that must measure a
    phase before it knows it, and waits for engines to start, holds at least this."""
    rec = RunRecord()
    for ph in phases:
        if not ph.is_rl:
            engines, seconds = min_engines, ph.hours * 3600.0
        else:
            steps = {f: step_seconds(ph, f, level) for f in range(min_engines, max_engines + 1)}
            fastest = min(steps.values())
            engines = min(f for f, s in steps.items() if s <= fastest * (1.0 + within))
            seconds = ph.steps * steps[engines]
        rec.engines_over_time.append((rec.hours, engines))
        rec.hours += seconds / 3600.0
        rec.gpu_hours += seconds / 3600.0 * (trainer_gpus + engines)
        rec.rl_steps += ph.steps
        rec.phases.append({"phase": ph.name, "hours": seconds / 3600.0, "engines_mean": float(engines)})
    return rec


@dataclass
class _Fleet:
    """The autoscaled fleet's engines: creation and ready times (seconds), desired count, history."""

    auto: FleetAutoscaling
    startup_s: float
    created: list[float]
    desired: int
    history: tuple = ()
    engine_seconds: float = 0.0

    def ready(self, now: float) -> int:
        return max(1, sum(1 for c in self.created if c + self.startup_s <= now))

    def advance(self, start: float, end: float) -> None:
        """Engines held between ``start`` and ``end`` (each from its creation)."""
        self.engine_seconds += sum(max(0.0, end - max(start, c)) for c in self.created)

    def apply(self, recommendation: int | None, now: float) -> None:
        d = autoscale.decide(
            self.desired,
            recommendation,
            self.history,
            min_replicas=self.auto.min_replicas,
            max_replicas=self.auto.max_replicas,
            stabilization_s=self.auto.scale_down_stabilization_seconds,
            now=now,
        )
        self.history = d.history
        if d.desired > len(self.created):
            self.created += [now] * (d.desired - len(self.created))
        elif d.desired < len(self.created):  # the newest go first (the Deployment's choice)
            self.created = sorted(self.created)[: d.desired]
        self.desired = d.desired


def play_autoscaled(
    phases: Sequence[PhaseCosts],
    trainer_gpus: int,
    auto: FleetAutoscaling,
    level: int,
    *,
    startup_s: float = 120.0,
    interval_s: float = 15.0,
    pipeline: bool = True,
) -> RunRecord:
    """The run on a fleet the operator's autoscaler sizes, starting at ``auto.minReplicas``.

    SFT: engines report an empty KV cache and no trainer reports, so the fleet falls to its
    minimum once the stabilization window has passed (decisions every ``interval_s``). RL: until
    the first step of a run reports, the trainer's scheduler holds its ``level`` batches beyond
    what the engines admit (its backlog); from then on its pipeline ratios, once a step. With
    ``pipeline`` False the trainer's ratios are not read (only KV usage, saturated, and the
    backlog of the batches ahead: the operator's rule before asynchronous trainers decided).
    """
    fleet = _Fleet(auto, startup_s, [0.0] * auto.min_replicas, auto.min_replicas)
    rec = RunRecord()
    now = 0.0
    reported = False
    rec.engines_over_time.append((0.0, len(fleet.created)))
    for ph in phases:
        start, engine_s0 = now, fleet.engine_seconds
        if not ph.is_rl:
            end = now + ph.hours * 3600.0
            while now < end:  # idle engines: KV usage 0, nothing waits
                nxt = min(end, now + interval_s)
                fleet.advance(now, nxt)
                now = nxt
                n = len(fleet.created)
                fleet.apply(autoscale.recommend_fleet(n, autoscale.FleetLoad((0.0,) * n, (0.0,) * n), auto), now)
                rec.engines_over_time.append((now / 3600.0, len(fleet.created)))
        else:
            for _ in range(ph.steps):
                engines = fleet.ready(now)
                step = step_seconds(ph, engines, level)
                end = now + step
                if not reported or not pipeline:  # the backlog: decisions every interval in the step
                    t = now
                    while t + interval_s <= end:
                        fleet.advance(t, t + interval_s)
                        t += interval_s
                        n = len(fleet.created)
                        queued = ph.batch_rollouts * max(1, level)
                        inflight = min(queued, fleet.ready(t) * ph.slots_per_engine)
                        load = autoscale.FleetLoad((0.95,) * n, (0.0,) * n, queued - inflight, inflight)
                        fleet.apply(autoscale.recommend_fleet(n, load, auto), t)
                        rec.engines_over_time.append((t / 3600.0, len(fleet.created)))
                    fleet.advance(t, end)
                else:
                    fleet.advance(now, end)
                now = end
                if pipeline:
                    reported = True
                    wait, idle = pipeline_ratios(ph, engines, step)
                    n = len(fleet.created)
                    load = autoscale.FleetLoad((0.95,) * n, (0.0,) * n, rollout_wait=wait, engine_idle=idle,
                                               engines_served=engines)
                    fleet.apply(autoscale.recommend_fleet(n, load, auto), now)
                rec.engines_over_time.append((now / 3600.0, len(fleet.created)))
            rec.rl_steps += ph.steps
        hours = (now - start) / 3600.0
        mean = (fleet.engine_seconds - engine_s0) / max(1e-9, now - start)
        rec.phases.append({"phase": ph.name, "hours": hours, "engines_mean": mean})
    rec.hours = now / 3600.0
    rec.gpu_hours = trainer_gpus * rec.hours + fleet.engine_seconds / 3600.0
    return rec
