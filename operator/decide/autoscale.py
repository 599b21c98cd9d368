"""Autoscaling decisions as pure functions: desired = f(current, metrics history, spec, now).

The operator's timer only scrapes metrics and writes ``spec.replicas`` (as an HPA would
through the scale subresource); everything that decides lives here and is unit-tested
without a cluster. The algorithm follows the HorizontalPodAutoscaler's:

* a *recommendation* per sample from the load signal (proportional, like HPA's
  ``ceil(current * metric / target)``), with a 10% tolerance band against flapping;
* scale-up takes effect at once (bounded to doubling, min +1, per decision);
* scale-down is *stabilized*: the applied value is the highest recommendation of the last
  ``scaleDownStabilizationSeconds``, so a short lull never drains a pool that is needed
  again seconds later; the window's recommendations are kept in the object's
  ``status.recommendations`` (``history_to_status``), so a restarted operator honours it too;
* the result is clamped to ``[minReplicas, maxReplicas]``; no metrics = no change.

A RolloutFleet's engines only report the rollouts they admitted. The trainer's KV-aware
scheduler reserves ``prompt + maxResponseTokens`` per rollout, so during a synchronous RL step
thousands of rollouts wait in the trainer while the engines show low KV usage and empty
queues; seen from the engines alone, the autoscaler would shrink the fleet mid-step. The
trainers' ``kuberl_rollout_requests_waiting``
(and their in-flight count) is therefore part of the fleet's load: while rollouts wait, the
fleet grows in proportion (``ceil(engines * (inflight + waiting) / inflight)``) and never
shrinks.

A SandboxPool's tool calls come in bursts the trainers see coming: before each rollout phase
they announce the sandbox workers it asks for (``rollout.phases``), and the pool is held at
least that large (:func:`phase_floor`, as the decision's minimum) until the phase is over; then
the stabilization window is dropped, so the phase's pods do not wait out the update.

An asynchronous run (asyncLevel > 0) says which side of its pipeline waits: the trainers
export, over their last RL step, the fraction they waited for rollouts and the fraction no
rollout batch was generating. A trainer starved for rollouts above ``PIPELINE_WAIT_TARGET``
means generation is the longer side: the fleet grows so that generation would fit the update
(``ceil(engines / (1 - wait))``). Engines idle above ``PIPELINE_IDLE_TARGET`` while no trainer
waits mean the update is the longer side: the fleet shrinks to the engines that keep
``1 - PIPELINE_IDLE_TARGET`` busy (``ceil(engines * busy / (1 - target))``). ``engines`` is
the count that served the measured step (the trainers export it): replicas still starting did
not shorten it, and counting them would grow the fleet again for the same wait. Where such trainers
report, their pipeline is the fleet's demand, not its KV usage, queues or their backlog: their
schedulers keep the batches ahead waiting and fill every engine's KV cache by design, so those
signals would hold any fleet at its maximum. Synchronous
runs wait for their rollouts by design and do not vote; their backlog still grows the fleet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.api.sandbox_pool import SandboxAutoscaling
from kuberl.operator.render.engines import ENGINE_METRICS
from kuberl.operator.render.signals import (
    PIPELINE_IDLE_TARGET,
    PIPELINE_WAIT_TARGET,
    SANDBOX_BUSY,
    SANDBOX_QUEUE,
    TRAINER_ENGINE_IDLE,
    TRAINER_ENGINES_SERVED,
    TRAINER_INFLIGHT,
    TRAINER_PHASE_WORKERS,
    TRAINER_ROLLOUT_WAIT,
    TRAINER_WAITING,
)

TOLERANCE = 0.1

SGLANG_TOKEN_USAGE, SGLANG_QUEUE = ENGINE_METRICS["sglang"]
# A scrape is read with whichever (KV usage, queue) pair it carries, so one fleet's autoscaler
# works for both engines (spec.engine.type).
ENGINE_GAUGES = ENGINE_METRICS


@dataclass(frozen=True)
class Recommendation:
    """One past recommendation: what the load asked for at ``time`` (epoch seconds)."""

    time: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    desired: int
    recommendation: int
    history: tuple[Recommendation, ...]
    reason: str

    @property
    def changed(self) -> bool:
        return self.reason != "hold"


@dataclass(frozen=True)
class PoolLoad:
    """Sum over the pool's pods of the sandbox gauges (one scrape)."""

    queue_depth: float
    workers_busy: float
    pods: int


@dataclass(frozen=True)
class FleetLoad:
    """Per-engine gauges of one scrape (one entry per engine that answered): KV-cache usage
    (SGLang ``token_usage``, vLLM ``kv_cache_usage_perc``) and queued requests."""

    token_usage: tuple[float, ...]
    queued: tuple[float, ...]
    waiting: float = 0.0  # rollouts waiting in the trainers' schedulers (no engine had room)
    inflight: float = 0.0  # rollouts the trainers have on the engines
    # asynchronous trainers' last step: the most any waited for rollouts, the least engines idled
    rollout_wait: float | None = None
    engine_idle: float | None = None
    engines_served: float | None = None  # the engines that served that step (replicas start late)

    @property
    def mean_token_usage(self) -> float:
        return sum(self.token_usage) / len(self.token_usage) if self.token_usage else 0.0

    @property
    def queued_per_engine(self) -> float:
        return sum(self.queued) / len(self.queued) if self.queued else 0.0


def _proportional(current: int, ratio: float) -> int:
    """HPA's rule: keep ``current`` inside the tolerance band, else ceil(current * ratio)."""
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(current * ratio - 1e-9)


def recommend_pool(current: int, load: PoolLoad, workers_per_pod: int, auto: SandboxAutoscaling) -> int:
    """Pods needed so queued calls per worker stay at or below ``targetQueuePerWorker``.

    Two demands, the larger wins: the queue (``queue / (workersPerPod * target)`` pods, the
    same number KEDA's AverageValue trigger computes) and the work in flight (every busy
    worker keeps its pod: ``ceil(busy / workersPerPod)``), so a pool with a short queue but
    all workers busy holds steady instead of shrinking under running calls.
    """
    if current <= 0:
        # Scaled to zero: anything queued or running needs at least one pod.
        demand = load.queue_depth + load.workers_busy
        return math.ceil(demand / (workers_per_pod * auto.target_queue_per_worker)) if demand > 0 else 0
    per_worker = load.queue_depth / (current * workers_per_pod)
    by_queue = _proportional(current, per_worker / auto.target_queue_per_worker)
    by_busy = math.ceil(load.workers_busy / workers_per_pod - 1e-9)
    return max(by_queue, by_busy)


def phase_floor(workers: float, workers_per_pod: int) -> int:
    """Pods that hold the sandbox workers the pool's trainers announced for their rollout phase
    (``rollout.phases``): the pool stays at least this large until the phase is over."""
    return math.ceil(workers / workers_per_pod - 1e-9) if workers > 0 else 0


def recommend_fleet(current: int, load: FleetLoad, auto: FleetAutoscaling) -> int:
    """Engines needed for mean KV-cache usage <= target and queued requests/engine <= target,
    and, while the trainers hold rollouts no engine had room for, enough engines to run them
    at today's rollouts per engine (never fewer than now). Where asynchronous trainers report
    their pipeline, it decides instead of KV usage and queues (the module docstring);
    ``load.waiting`` is then the synchronous trainers' backlog only."""
    base = max(current, 1)
    by_backlog = 0
    if load.waiting > 0:
        ratio = (load.inflight + load.waiting) / load.inflight if load.inflight > 0 else 2.0
        by_backlog = max(base, math.ceil(base * ratio - 1e-9))
    if load.rollout_wait is not None or load.engine_idle is not None:
        by_pipeline = recommend_by_pipeline(base, load.rollout_wait, load.engine_idle, load.engines_served)
        return max(current if by_pipeline is None else by_pipeline, by_backlog)
    by_kv = _proportional(base, load.mean_token_usage / auto.target_kv_cache_utilization)
    by_queue = 0
    if auto.target_queued_requests > 0 and load.queued_per_engine > auto.target_queued_requests:
        # A queue under target is no reason to shrink; only KV usage decides scale-down.
        by_queue = _proportional(base, load.queued_per_engine / auto.target_queued_requests)
    return max(by_kv, by_queue, by_backlog)


def recommend_by_pipeline(
    engines: int, wait: float | None, idle: float | None, served: float | None = None
) -> int | None:
    """Engines for an asynchronous run's pipeline (the module docstring); None: no opinion.

    The ratios were measured on the ``served`` engines (those in the trainer's rotation at the
    step's end; today's ``engines`` where unknown): replicas still starting did not shorten that
    step, so growth counts from the engines that served it and never asks for fewer than today's."""
    base = served if served and served > 0 else engines
    if wait is not None and wait > PIPELINE_WAIT_TARGET:
        return max(engines, math.ceil(base / max(1.0 - wait, 0.5) - 1e-9))
    if idle is not None and idle > PIPELINE_IDLE_TARGET and (wait is None or wait <= PIPELINE_WAIT_TARGET):
        return max(1, math.ceil(base * (1.0 - idle) / (1.0 - PIPELINE_IDLE_TARGET) - 1e-9))
    return None


def decide(
    current: int,
    recommendation: int | None,
    history: Iterable[Recommendation],
    *,
    min_replicas: int,
    max_replicas: int,
    stabilization_s: float,
    now: float,
) -> Decision:
    """Turn the latest recommendation into a replica count (stabilized, rate-limited, clamped).

    ``recommendation=None`` means the metrics could not be read: hold, and do not record it.
    """
    window = compact(h for h in history if now - h.time <= stabilization_s)
    if recommendation is None:
        clamped = min(max(current, min_replicas), max_replicas)
        return Decision(clamped, current, window, "hold" if clamped == current else "bounds")
    window = compact((*window, Recommendation(now, recommendation)))
    if recommendation > current:
        # Scale up at once, at most doubling (min +1) per decision, like the HPA's default policy.
        desired = min(recommendation, max(current * 2, current + 1))
    else:
        # Scale down only as far as the highest recommendation inside the window allows.
        desired = max(r.replicas for r in window)
        desired = min(desired, current)
    desired = min(max(desired, min_replicas), max_replicas)
    if desired > current:
        reason = "scale-up"
    elif desired < current:
        reason = "scale-down"
    else:
        reason = "hold"
    return Decision(desired, recommendation, window, reason)


def compact(history: Iterable[Recommendation]) -> tuple[Recommendation, ...]:
    """The recommendations that can still be the window's maximum, oldest first.

    An entry followed by a later one with at least as many replicas never decides again (the
    later one stays in the window longer), so it is dropped: the history kept in the object's
    status stays a few entries long however often the autoscaler runs.
    """
    out: list[Recommendation] = []
    for rec in sorted(history, key=lambda r: r.time):
        while out and out[-1].replicas <= rec.replicas:
            out.pop()
        out.append(rec)
    return tuple(out)


def history_to_status(history: Iterable[Recommendation]) -> list[dict[str, float | int]]:
    """``status.recommendations``: the stabilization window survives an operator restart."""
    return [{"time": round(r.time, 3), "replicas": r.replicas} for r in history]


def history_from_status(raw: object) -> tuple[Recommendation, ...]:
    """Parse ``status.recommendations``; malformed entries (hand edits) are skipped."""
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(Recommendation(float(item["time"]), int(item["replicas"])))
        except (KeyError, TypeError, ValueError):
            continue
    return compact(out)


# --- metrics parsing -----------------------------------------------------------------------


def parse_gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of every sample of each named metric in a Prometheus text exposition.

    A pod exports one series per label set (e.g. one per served model in SGLang); summing
    gives the pod's total. Absent metrics are absent from the result.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and not math.isnan(sample.value):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def pool_load(scrapes: Sequence[str]) -> PoolLoad | None:
    """Aggregate the sandbox gauges of every pod that answered; None if none had them."""
    queue = busy = 0.0
    pods = 0
    for text in scrapes:
        g = parse_gauges(text, (SANDBOX_QUEUE, SANDBOX_BUSY))
        if SANDBOX_QUEUE not in g and SANDBOX_BUSY not in g:
            continue
        pods += 1
        queue += g.get(SANDBOX_QUEUE, 0.0)
        busy += g.get(SANDBOX_BUSY, 0.0)
    return PoolLoad(queue, busy, pods) if pods else None


TRAINER_GAUGES = (TRAINER_WAITING, TRAINER_INFLIGHT, TRAINER_ROLLOUT_WAIT, TRAINER_ENGINE_IDLE, TRAINER_ENGINES_SERVED)


def _asynchronous(g: Mapping[str, float]) -> bool:
    """A trainer page of an asynchronous run: it exports its pipeline's ratios."""
    return TRAINER_ROLLOUT_WAIT in g or TRAINER_ENGINE_IDLE in g


def trainer_backlog(trainers: Sequence[Mapping[str, float]]) -> tuple[float, float]:
    """(waiting, in flight) rollouts summed over the trainer pages (:data:`TRAINER_GAUGES`) of a
    fleet's synchronous jobs (an asynchronous one's backlog is its batches ahead, by design)."""
    sync = [g for g in trainers if not _asynchronous(g)]
    return sum(g.get(TRAINER_WAITING, 0.0) for g in sync), sum(g.get(TRAINER_INFLIGHT, 0.0) for g in sync)


def phase_workers(scrapes: Sequence[str]) -> float:
    """Sandbox workers the pool's trainers announced for their coming or current rollout
    phases, summed (0 between phases, or where none announces)."""
    return sum(parse_gauges(text, (TRAINER_PHASE_WORKERS,)).get(TRAINER_PHASE_WORKERS, 0.0) for text in scrapes)


def trainer_pipeline(trainers: Sequence[Mapping[str, float]]) -> tuple[float | None, float | None, float | None]:
    """(the largest rollout wait, the smallest engine idle, the most engines in service) over the
    asynchronous trainers of a fleet (those that export the ratios); None where none does. One
    starved trainer is reason to grow; the fleet is idle only when every trainer's engines are."""
    waits = [g[TRAINER_ROLLOUT_WAIT] for g in trainers if TRAINER_ROLLOUT_WAIT in g]
    idles = [g[TRAINER_ENGINE_IDLE] for g in trainers if TRAINER_ENGINE_IDLE in g]
    served = [g[TRAINER_ENGINES_SERVED] for g in trainers if TRAINER_ENGINES_SERVED in g]
    return (max(waits) if waits else None), (min(idles) if idles else None), (max(served) if served else None)


def fleet_load(scrapes: Sequence[str], trainer_scrapes: Sequence[str] = ()) -> FleetLoad | None:
    """Aggregate the engine gauges of every pod that answered (SGLang or vLLM), with the backlog
    of the trainers using the fleet; None if no engine had them."""
    usage: list[float] = []
    queued: list[float] = []
    for text in scrapes:
        names = [n for pair in ENGINE_GAUGES.values() for n in pair]
        g = parse_gauges(text, names)
        for usage_name, queue_name in ENGINE_GAUGES.values():
            if usage_name in g or queue_name in g:
                usage.append(g.get(usage_name, 0.0))
                queued.append(g.get(queue_name, 0.0))
                break
    if not usage:
        return None
    trainers = [parse_gauges(text, TRAINER_GAUGES) for text in trainer_scrapes]  # each page parsed once
    waiting, inflight = trainer_backlog(trainers)
    wait, idle, served = trainer_pipeline(trainers)
    return FleetLoad(tuple(usage), tuple(queued), waiting, inflight, wait, idle, served)
