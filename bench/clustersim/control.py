"""The operator's autoscaling loop and the Deployment controller's pod life cycle, in virtual time.

Every ``interval_s`` (the operator's ``autoscale_interval``, 15 s by default) the loop does
what ``kuberl.operator.runtime.loops.autoscale_once`` does: scrape the ready pods' gauges
(Prometheus text), aggregate them with ``autoscale.pool_load`` / ``autoscale.fleet_load``,
recommend with ``recommend_pool`` / ``recommend_fleet`` and decide with ``decide``, keeping the
stabilization history between decisions as the object's status would. The replica count it
writes is then reconciled like a Deployment: new pods become ready after ``startup_s``;
removed pods are the not-yet-ready ones first, then the newest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_sim import EngineSpec, SimEngine

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.api.sandbox_pool import SandboxAutoscaling
from kuberl.operator.decide import autoscale
from kuberl.operator.render import signals
from kuberl.operator.render.engines import ENGINE_METRICS
from kuberl.rollout.scheduler import Scheduler
from kuberl.sandbox.config import ServiceConfig

from .pods import SandboxPod, Service


@dataclass
class ScaleLog:
    """Every decision: (time, replicas before, desired, recommendation, reason)."""

    decisions: list[tuple[float, int, int, int, str]] = field(default_factory=list)


class PoolController:
    """A SandboxPool: its pods behind ``service``, scaled by the operator's autoscaler (or fixed)."""

    def __init__(
        self,
        service: Service,
        cfg: ServiceConfig,
        replicas: int,
        autoscaling: SandboxAutoscaling | None,
        startup_s: float,
    ) -> None:
        self.service = service
        self.cfg = cfg
        self.replicas = replicas
        self.autoscaling = autoscaling
        self.startup_s = startup_s
        self.pods: list[SandboxPod] = []
        self.history: tuple[autoscale.Recommendation, ...] = ()
        self.log = ScaleLog()
        self.blind_history: tuple[autoscale.Recommendation, ...] = ()
        self.blind_log = ScaleLog()  # dry run: the same decisions without the trainer's backlog
        self._names = 0
        self._tasks: set[asyncio.Task] = set()
        self.floor: int | None = None  # pods an announced rollout phase asks for, until released

    @property
    def ready_pods(self) -> list[SandboxPod]:
        return [p for p in self.pods if p.ready]

    async def start(self) -> None:
        """The pool as it stands before the run: ``replicas`` pods, all ready."""
        for _ in range(self.replicas):
            pod = self._new_pod(ready_in=None)
            await pod.start()

    def _new_pod(self, ready_in: float | None) -> SandboxPod:
        loop = asyncio.get_running_loop()
        self._names += 1
        pod = SandboxPod(f"sbx-{self._names}", self.cfg, loop.time())
        self.pods.append(pod)
        self.service.endpoints.append(pod)
        if ready_in is not None:
            task = loop.create_task(self._start_later(pod, ready_in))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return pod

    async def _start_later(self, pod: SandboxPod, delay: float) -> None:
        await asyncio.sleep(delay)
        if not pod.stopped:
            await pod.start()

    async def _remove(self, pod: SandboxPod) -> None:
        self.pods.remove(pod)
        self.service.endpoints.remove(pod)
        await pod.stop()

    async def reconcile(self) -> None:
        while len(self.pods) < self.replicas:
            self._new_pod(ready_in=self.startup_s)
        excess = len(self.pods) - self.replicas
        if excess > 0:
            # ReplicaSet order: pods that are not ready first, then the newest
            order = sorted(self.pods, key=lambda p: (p.ready, p.created), reverse=False)
            victims = [p for p in order if not p.ready][:excess]
            victims += sorted((p for p in self.pods if p.ready), key=lambda p: -p.created)[
                : excess - len(victims)
            ]
            await asyncio.gather(*(self._remove(p) for p in victims))

    async def announce(self, pods: int, now: float) -> None:
        """A trainer announced a rollout phase that asks for ``pods``: have them ready before
        it starts (the operator's next pass applies the floor at once)."""
        self.floor = pods
        if pods > self.replicas:
            self.log.decisions.append((now, self.replicas, pods, pods, "announced"))
            self.replicas = pods
            await self.reconcile()

    async def release(self, now: float) -> None:
        """The announced phase's calls are done: back to what the load asks for, without the
        stabilization window holding the phase's pods through the update."""
        self.floor = None
        self.history = ()
        auto = self.autoscaling
        low = auto.min_replicas if auto is not None else self.replicas
        if low < self.replicas:
            self.log.decisions.append((now, self.replicas, low, low, "released"))
            self.replicas = low
            await self.reconcile()

    async def autoscale_once(self, now: float) -> None:
        auto = self.autoscaling
        if auto is None:
            return
        load = autoscale.pool_load([p.metrics_text() for p in self.ready_pods])
        rec = None
        if load is not None:
            rec = autoscale.recommend_pool(self.replicas, load, self.cfg.workers, auto)
        decision = autoscale.decide(
            self.replicas,
            rec,
            self.history,
            min_replicas=max(auto.min_replicas, self.floor or 0),
            max_replicas=auto.max_replicas,
            stabilization_s=auto.scale_down_stabilization_seconds,
            now=now,
        )
        self.history = decision.history
        self.log.decisions.append(
            (now, self.replicas, decision.desired, decision.recommendation, decision.reason)
        )
        self.replicas = decision.desired
        await self.reconcile()

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(p.stop() for p in self.pods))


class FleetController:
    """A RolloutFleet: engines in the scheduler, scaled by the operator's autoscaler (or fixed).

    A new engine joins the scheduler (``Scheduler.add_engine``, as the trainer's EndpointSlice
    watch does) after ``startup_s``; a removed one is drained and forgotten once idle. With
    ``dry_run`` the decisions are only logged (a colocated fleet keeps every GPU's engine):
    what the autoscaler would do, seen from the engines' own gauges.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        make_engine: Callable[[str], SimEngine],
        engine_spec: EngineSpec,
        autoscaling: FleetAutoscaling | None,
        startup_s: float,
        dry_run: bool = False,
    ) -> None:
        self.dry_run = dry_run
        self.scheduler = scheduler
        self.make_engine = make_engine
        self.engine_spec = engine_spec
        self.autoscaling = autoscaling
        self.startup_s = startup_s
        self.replicas = len(scheduler.engines)
        self.starting = 0
        self.history: tuple[autoscale.Recommendation, ...] = ()
        self.log = ScaleLog()
        self.blind_history: tuple[autoscale.Recommendation, ...] = ()
        self.blind_log = ScaleLog()  # dry run: the same decisions without the trainer's backlog
        self.observed: list[tuple[float, float, int]] = []  # time, mean KV usage, rollouts waiting
        self._names = len(scheduler.engines)
        self._tasks: set[asyncio.Task] = set()

    @property
    def in_service(self) -> int:
        return sum(not st.draining for st in self.scheduler.stats)

    async def _add_later(self) -> None:
        self.starting += 1
        try:
            await asyncio.sleep(self.startup_s)
        finally:
            self.starting -= 1
        self._names += 1
        await self.scheduler.add_engine(self.make_engine(f"engine-{self._names}"))

    def reconcile(self) -> None:
        have = self.in_service + self.starting
        loop = asyncio.get_running_loop()
        for _ in range(self.replicas - have):
            task = loop.create_task(self._add_later())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        excess = have - self.replicas
        for st in reversed(self.scheduler.stats):
            if excess <= 0:
                break
            if not st.draining:
                self.scheduler.drain_engine(st.name)
                excess -= 1
        self.scheduler.remove_drained()

    async def autoscale_once(self, now: float) -> None:
        auto = self.autoscaling
        self.scheduler.remove_drained()
        if auto is None:
            return
        usage_name, queue_name = ENGINE_METRICS["sglang"]
        texts = []
        for st in self.scheduler.stats:
            if st.draining or st.engine is None:
                continue
            load = await st.engine.load_metrics()
            texts.append(f"{usage_name} {load.kv_cache_utilization}\n{queue_name} {load.queued}\n")
        # the trainer's /metrics as the operator scrapes it: its scheduler's backlog and in-flight
        inflight = sum(st.inflight for st in self.scheduler.stats)
        trainer = f"{signals.TRAINER_WAITING} {self.scheduler.waiting}\n{signals.TRAINER_INFLIGHT} {inflight}\n"
        fload = autoscale.fleet_load(texts, [trainer])
        decision = self._decide(fload, self.history, now)
        self.history = decision.history
        self.log.decisions.append(
            (now, self.replicas, decision.desired, decision.recommendation, decision.reason)
        )
        if self.dry_run:  # before issue 18's fix, side by side: the engines' gauges only
            blind = self._decide(autoscale.fleet_load(texts), self.blind_history, now)
            self.blind_history = blind.history
            self.blind_log.decisions.append((now, self.replicas, blind.desired, blind.recommendation, blind.reason))
        self.observed.append((now, fload.mean_token_usage if fload else 0.0, self.scheduler.waiting))
        if self.dry_run:
            return
        self.replicas = decision.desired
        self.reconcile()

    def _decide(self, fload: autoscale.FleetLoad | None, history: tuple, now: float) -> autoscale.Decision:
        auto = self.autoscaling
        assert auto is not None
        rec = autoscale.recommend_fleet(self.replicas, fload, auto) if fload is not None else None
        return autoscale.decide(
            self.replicas,
            rec,
            history,
            min_replicas=auto.min_replicas,
            max_replicas=auto.max_replicas,
            stabilization_s=auto.scale_down_stabilization_seconds,
            now=now,
        )

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()


async def autoscaler_loop(controllers: list, interval_s: float, stop: asyncio.Event) -> None:
    """The operator's autoscale loop: one decision per controller every ``interval_s``."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        for c in controllers:
            await c.autoscale_once(loop.time())
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
