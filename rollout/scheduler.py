"""Assigning multi-turn rollouts to inference engines (paper section 3.2).

A rollout holds its engine for all of its turns (the KV cache of earlier turns stays useful
via prefix caching), so assignment happens once per rollout through :meth:`Scheduler.session`.

Policies:

* ``kv-aware`` (the paper's load-balanced scheduler): each rollout reserves
  ``prompt_tokens + max_response_tokens`` KV tokens on the engine with the most free capacity
  that fits. If none fits, the rollout waits (FIFO) until a running rollout releases its
  reservation. The sum of reservations on an engine never exceeds its ``max_total_tokens``,
  so the engine never has to evict and recompute (no KV overflow), and fast engines that free
  capacity sooner automatically receive more rollouts.
* ``least-requests``: the engine with the fewest in-flight rollouts, capacity-blind.
* ``round-robin``: engines in turn, capacity-blind.
* ``static`` (verl style, the baseline): the rollouts of a batch are partitioned into equal
  contiguous chunks, one per engine, regardless of speed or load (call :meth:`start_batch`
  with the batch size first; without it, rollouts are dealt out modulo the engine count).

``max_active`` caps the rollouts in flight over all engines (every policy). Admission is FIFO,
so an older batch's rollouts take their places before a later batch's. The rollout worker sets
it to the batches allowed in flight (``algorithm.asyncLevel`` k: k batches' rollouts), so a
batch submitted ahead starts at once beside the one before it and samples the version served
then; with the cap at one batch's size it would take only the places the older batch frees as
its rollouts finish (fill its tail), start after the next push, and run one version ahead
whatever k is.

The capacity-blind policies admit immediately unless ``max_inflight_per_engine`` is set, in
which case they wait for a free slot. Reservations are tracked for every policy, so overflow
(reserved > capacity) is observable; only ``kv-aware`` prevents it.

Shared fleets: reservations only cover this scheduler's own rollouts, so two jobs on one fleet
would each assume the whole KV cache. For engines marked ``shared`` (SGLang servers), the
scheduler therefore polls ``load_metrics()`` (sglang:token_usage) every ``load_refresh_s``
seconds while it has work, and counts the tokens in use beyond its own reservations as taken
by someone else: ``external = max(0, token_usage * capacity - reserved)`` at the time of the
poll, and ``kv-aware`` admits only into ``capacity - reserved - external``. With one job on the
fleet its own usage never exceeds its reservations, so ``external`` is 0 and nothing changes.
It is a floor, not a guarantee: usage by others that hides inside this job's unused
reservation headroom cannot be told apart from its own, and it is up to ``load_refresh_s``
old. An engine whose metrics cannot be read (SGLang without --enable-metrics) counts as
having no external load, with a warning.

Capacities are read before the first assignment and again whenever an engine's
``capacity_version`` changes (SGLang: new weights loaded from disk).

If every engine is drained or gone (a scale-to-zero, an empty EndpointSlice), waiting rollouts
fail with :class:`NoEngineError` after ``no_engine_timeout_s`` without one, instead of waiting
forever; ``None`` waits forever.

Per-engine gauges in the prometheus-client default registry:
``kuberl_rollout_kv_cache_utilization{engine}`` (reserved / capacity) and
``kuberl_rollout_requests_inflight{engine}``; and ``kuberl_rollout_requests_waiting``, the
rollouts waiting here for an engine with room. The engines cannot see those (their KV usage
and queues cover admitted rollouts only), so the fleet autoscaler reads it from the trainers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import Gauge

from kuberl.rollout.engine import Engine

POLICIES = ("kv-aware", "least-requests", "round-robin", "static")

log = logging.getLogger(__name__)

KV_UTILIZATION = Gauge(
    "kuberl_rollout_kv_cache_utilization",
    "Reserved KV-cache tokens / engine capacity, as seen by the rollout scheduler",
    ["engine"],
)
REQUESTS_INFLIGHT = Gauge(
    "kuberl_rollout_requests_inflight", "Rollouts currently assigned to the engine", ["engine"]
)
REQUESTS_WAITING = Gauge(
    "kuberl_rollout_requests_waiting", "Rollouts waiting in the trainer's scheduler for an engine with room"
)


@dataclass
class EngineStats:
    """The scheduler's book-keeping for one engine."""

    name: str
    capacity: int = 0
    reserved: int = 0
    inflight: int = 0
    sessions_total: int = 0
    peak_reserved: int = 0
    overflow_events: int = 0  # admissions that pushed reserved above capacity
    draining: bool = False  # gets no new rollouts; removed once its in-flight ones finish
    failed: bool = False  # drained for a fault (a failed push): rejoins only as a new engine
    capacity_version: int = 0  # the engine's capacity_version when capacity was read
    external: int = 0  # KV tokens others use on a shared engine (see the module docstring)
    load_error: str | None = None  # why load_metrics() last failed
    engine: Engine | None = field(default=None, repr=False, compare=False)

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.external

    @property
    def utilization(self) -> float:
        return self.reserved / self.capacity if self.capacity else 0.0


@dataclass(eq=False)  # identity equality: queue.remove() must find exactly this waiter
class _Waiter:
    need: int
    seq: int
    future: asyncio.Future


class NoEngineError(RuntimeError):
    """Rollouts waited ``no_engine_timeout_s`` while no engine was in service."""


class Scheduler:
    """Assigns rollouts to engines; see the module docstring for the policies."""

    def __init__(
        self,
        engines: Sequence[Engine],
        policy: str = "kv-aware",
        max_response_tokens_default: int = 4096,
        *,
        max_inflight_per_engine: int | None = None,
        no_engine_timeout_s: float | None = 300.0,
        load_refresh_s: float = 5.0,
    ):
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {policy!r}; choose one of {', '.join(POLICIES)}")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        if max_inflight_per_engine is not None and max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1, got {max_inflight_per_engine}")
        if no_engine_timeout_s is not None and no_engine_timeout_s < 0:
            raise ValueError(f"no_engine_timeout_s must be >= 0 or None, got {no_engine_timeout_s}")
        if load_refresh_s <= 0:
            raise ValueError(f"load_refresh_s must be > 0, got {load_refresh_s}")
        self.engines = list(engines)
        self.policy = policy
        self.max_response_tokens_default = max_response_tokens_default
        self.max_inflight_per_engine = max_inflight_per_engine
        self.max_active: int | None = None  # rollouts in flight over all engines (None: no cap)
        self.no_engine_timeout_s = no_engine_timeout_s
        self.load_refresh_s = load_refresh_s
        self.stats = [EngineStats(e.name, engine=e) for e in self.engines]
        self._refresh_lock = asyncio.Lock()
        self._capacities_known = False
        self._queue: deque[_Waiter] = deque()
        self._counter = itertools.count()
        self._batch_total: int | None = None
        self._batch_start = 0
        self._no_engine_timer: asyncio.TimerHandle | None = None
        self._poller: asyncio.Task | None = None
        self._loads_known = False

    async def refresh_capacities(self) -> list[int]:
        """Ask every engine for its KV capacity (before the first assignment, and after an
        engine's ``capacity_version`` changed)."""
        stats = list(self.stats)
        engines = [st.engine for st in stats]
        assert all(e is not None for e in engines)
        versions = [e.capacity_version for e in engines]
        caps = await asyncio.gather(*(e.max_total_tokens() for e in engines))
        for st, cap, version in zip(stats, caps, versions, strict=True):
            if cap < 1:
                raise ValueError(f"engine {st.name} reports max_total_tokens={cap}")
            st.capacity, st.capacity_version = int(cap), version
            self._export(st)
        self._capacities_known = True
        self._dispatch()  # a larger capacity may admit waiting rollouts
        return [st.capacity for st in self.stats]

    def _capacities_stale(self) -> bool:
        return not self._capacities_known or any(
            st.engine is not None and st.engine.capacity_version != st.capacity_version for st in self.stats
        )

    async def refresh_loads(self) -> None:
        """Read the observed KV usage of shared engines (see the module docstring)."""
        stats = [st for st in self.stats if st.engine is not None and st.engine.shared]
        loads = await asyncio.gather(*(st.engine.load_metrics() for st in stats), return_exceptions=True)
        for st, load in zip(stats, loads, strict=True):
            if isinstance(load, asyncio.CancelledError):
                raise load
            if isinstance(load, BaseException):
                if st.load_error is None:
                    log.warning(
                        "engine %s: cannot read its load, so its use by others is unknown: %s", st.name, load
                    )
                st.load_error, st.external = str(load), 0
                continue
            st.load_error = None
            used = round(min(max(load.kv_cache_utilization, 0.0), 1.0) * st.capacity)
            st.external = max(0, used - st.reserved)
        self._loads_known = True
        self._dispatch()

    def _busy(self) -> bool:
        return bool(self._queue) or any(st.inflight for st in self.stats)

    async def _poll_loads(self) -> None:
        """While this scheduler has work: re-read capacities that changed and shared engines' loads."""
        try:
            while self._busy():
                await asyncio.sleep(self.load_refresh_s)
                try:
                    if self._capacities_stale():
                        async with self._refresh_lock:
                            if self._capacities_stale():
                                await self.refresh_capacities()
                    await self.refresh_loads()
                except Exception as err:  # keep polling: waiters depend on fresh numbers
                    log.warning("rollout scheduler: refreshing engine capacities/loads failed: %s", err)
        finally:
            self._poller = None

    def _has_shared(self) -> bool:
        return any(st.engine is not None and st.engine.shared for st in self.stats)

    def _start_poller(self) -> None:
        if self._poller is None and self._has_shared():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loads())

    async def close(self) -> None:
        """Stop the background load polling and the no-engine clock (engines are the caller's)."""
        if self._no_engine_timer is not None:
            self._no_engine_timer.cancel()
            self._no_engine_timer = None
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass

    def start_batch(self, total: int) -> None:
        """Announce that the next ``total`` sessions form one batch (used by ``static``)."""
        if total < 1:
            raise ValueError(f"batch size must be >= 1, got {total}")
        self._batch_total = total
        self._batch_start = next(self._counter)
        self._counter = itertools.count(self._batch_start)

    @asynccontextmanager
    async def session(
        self, prompt_tokens: int, max_response_tokens: int | None = None
    ) -> AsyncIterator[Engine]:
        """Reserve ``prompt_tokens + max_response_tokens`` on an engine for one whole rollout."""
        if max_response_tokens is None:
            max_response_tokens = self.max_response_tokens_default
        if prompt_tokens < 0 or max_response_tokens < 0:
            raise ValueError(
                f"prompt_tokens and max_response_tokens must be >= 0, got {prompt_tokens}, {max_response_tokens}"
            )
        need = prompt_tokens + max_response_tokens
        st = await self._acquire(need)
        try:
            assert st.engine is not None
            yield st.engine
        finally:
            self._release(st, need)

    async def add_engine(self, engine: Engine) -> None:
        """Add an engine (a new RolloutFleet replica); waiting rollouts may start on it at once."""
        if any(st.name == engine.name for st in self.stats):
            raise ValueError(f"engine {engine.name!r} is already scheduled")
        cap = await engine.max_total_tokens()
        if cap < 1:
            raise ValueError(f"engine {engine.name} reports max_total_tokens={cap}")
        st = EngineStats(
            engine.name, capacity=int(cap), capacity_version=engine.capacity_version, engine=engine
        )
        self.engines.append(engine)
        self.stats.append(st)
        self._export(st)
        self._dispatch()

    def drain_engine(self, name: str, *, failed: bool = False) -> None:
        """Stop assigning rollouts to ``name`` (scale-down, failed health checks); ``failed``:
        for a fault, so that it is never put back as it is (it holds weights of no known version)."""
        st = self._stats_of(name)
        st.draining = True
        st.failed = st.failed or failed
        self._dispatch()  # with no engine left in service, the no-engine clock starts

    def undrain_engine(self, name: str) -> None:
        """Put a draining engine back into service; waiting rollouts may start on it at once."""
        self._stats_of(name).draining = False
        self._dispatch()

    def in_service(self, name: str) -> bool:
        """Whether ``name`` takes new rollouts (known here and not draining)."""
        return any(st.name == name and not st.draining for st in self.stats)

    def others_in_service(self, name: str) -> bool:
        """Whether an engine other than ``name`` takes new rollouts."""
        return any(st.name != name and not st.draining for st in self.stats)

    def _stats_of(self, name: str) -> EngineStats:
        for st in self.stats:
            if st.name == name:
                return st
        raise KeyError(f"no engine named {name!r}")

    def remove_drained(self) -> list[Engine]:
        """Forget drained engines with nothing in flight; returns them for the caller to close."""
        gone = [st for st in self.stats if st.draining and st.inflight == 0]
        for st in gone:
            self.stats.remove(st)
            self.engines.remove(st.engine)
            KV_UTILIZATION.remove(st.name)
            REQUESTS_INFLIGHT.remove(st.name)
        return [st.engine for st in gone if st.engine is not None]

    async def _acquire(self, need: int) -> EngineStats:
        # Join the FIFO before the first await, so arrival order is admission order.
        waiter = _Waiter(need, next(self._counter), asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        REQUESTS_WAITING.set(len(self._queue))
        try:
            if self._capacities_stale():
                async with self._refresh_lock:
                    if self._capacities_stale():
                        await self.refresh_capacities()
            if not self._loads_known and self._has_shared():
                async with self._refresh_lock:
                    if not self._loads_known:
                        await self.refresh_loads()
            self._start_poller()
            if self.policy == "kv-aware":
                biggest = max((st.capacity for st in self.stats if not st.draining), default=need)
                if need > biggest:
                    raise ValueError(
                        f"a rollout needs {need} KV tokens but the largest engine holds {biggest}; "
                        "lower maxResponseTokens or use engines with a larger KV cache"
                    )
            self._dispatch()
            return await waiter.future
        except BaseException:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), need)  # admitted, but the caller went away
            else:
                fut.cancel()
                if waiter in self._queue:
                    self._queue.remove(waiter)
                self._dispatch()  # the next waiter may fit now
            raise

    def _dispatch(self) -> None:
        """Admit waiters from the head of the FIFO while the policy finds them an engine.

        One pass per admission or release, so thousands of waiting rollouts cost O(1) each
        instead of waking every waiter on every release.
        """
        if not self._capacities_known or (not self._loads_known and self._has_shared()):
            return
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            index = self._pick(head.need, head.seq)
            if index is None:
                break
            self._queue.popleft()
            st = self.stats[index]
            assert not st.draining
            st.reserved += head.need
            st.inflight += 1
            st.sessions_total += 1
            st.peak_reserved = max(st.peak_reserved, st.reserved)
            if st.reserved > st.capacity:
                st.overflow_events += 1
            self._export(st)
            head.future.set_result(st)
        # len, not ``waiting``: O(1) per admission; a waiter that gave up leaves the queue at once
        REQUESTS_WAITING.set(len(self._queue))
        self._watch_no_engines()

    def _watch_no_engines(self) -> None:
        """Start the no-engine clock when rollouts wait and no engine is in service; stop it otherwise."""
        idle = (
            self.no_engine_timeout_s is None or any(not st.draining for st in self.stats) or not self.waiting
        )
        if idle:
            if self._no_engine_timer is not None:
                self._no_engine_timer.cancel()
                self._no_engine_timer = None
            return
        if self._no_engine_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the event loop: the next dispatch starts it
                return
            self._no_engine_timer = loop.call_later(self.no_engine_timeout_s, self._fail_waiters)

    def _fail_waiters(self) -> None:
        self._no_engine_timer = None
        if any(not st.draining for st in self.stats):
            return
        waiting = [w for w in self._queue if not w.future.done()]
        self._queue.clear()
        REQUESTS_WAITING.set(0)
        for w in waiting:
            w.future.set_exception(
                NoEngineError(
                    f"no inference engine in service for {self.no_engine_timeout_s:g} s "
                    f"(all drained or gone); {len(waiting)} rollouts were waiting for one"
                )
            )

    def _release(self, st: EngineStats, need: int) -> None:
        st.reserved -= need
        st.inflight -= 1
        self._export(st)
        self._dispatch()

    @property
    def waiting(self) -> int:
        """Rollouts waiting for an engine."""
        return sum(not w.future.done() for w in self._queue)

    def _pick(self, need: int, seq: int) -> int | None:
        """The engine for the next rollout, or None to wait. Pure function of the stats."""
        active = [i for i, st in enumerate(self.stats) if not st.draining]
        n = len(active)
        if not n:
            return None  # every engine is draining: wait for add_engine
        if self.max_active is not None and sum(st.inflight for st in self.stats) >= self.max_active:
            return None  # a release admits the head of the FIFO
        cap = self.max_inflight_per_engine
        if self.policy == "kv-aware":
            fits = [i for i in active if self.stats[i].free >= need]
            if not fits:
                return None
            return max(fits, key=lambda i: (self.stats[i].free, -self.stats[i].inflight, -i))
        open_ = [i for i in active if cap is None or self.stats[i].inflight < cap]
        if not open_:
            return None
        if self.policy == "least-requests":
            return min(open_, key=lambda i: (self.stats[i].inflight, i))
        if self.policy == "round-robin":
            want = active[seq % n]
        else:  # static: equal contiguous chunks of the announced batch
            k = seq - self._batch_start
            total = self._batch_total
            want = active[(k * n // total) % n if total and k < total else seq % n]
        return want if want in open_ else None

    def _export(self, st: EngineStats) -> None:
        KV_UTILIZATION.labels(engine=st.name).set(st.utilization)
        REQUESTS_INFLIGHT.labels(engine=st.name).set(st.inflight)

    @property
    def overflow_events(self) -> int:
        return sum(st.overflow_events for st in self.stats)

    def snapshot(self) -> list[dict]:
        """Per-engine book-keeping as plain dicts (for logs and the bench)."""
        return [
            {
                "engine": st.name,
                "capacity": st.capacity,
                "reserved": st.reserved,
                "inflight": st.inflight,
                "utilization": st.utilization,
                "sessions_total": st.sessions_total,
                "peak_reserved": st.peak_reserved,
                "overflow_events": st.overflow_events,
                "external": st.external,
            }
            for st in self.stats
        ]
