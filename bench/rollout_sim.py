"""Discrete-event simulation of multi-turn rollouts on a fleet of inference engines.

It exists to measure the real :class:`kuberl.rollout.scheduler.Scheduler`: the simulation runs
the scheduler's own code on an asyncio event loop whose clock is virtual (sleeps advance the
clock instantly), against simulated engines that model what matters for scheduling:

* decode speed that slows with batch size (roofline: a step takes ``t0`` seconds up to
  ``b_sat`` sequences, then grows linearly, so throughput saturates at ``b_sat / t0`` tok/s);
* prefill of the tokens that are not in the prefix cache (first turn: the prompt; later turns:
  the tool response, plus whatever of the rollout's earlier context was evicted meanwhile;
  after a retraction: everything past the cached prefix);
* a finite KV cache managed like SGLang's (details in :class:`SimEngine`): a finished turn's
  tokens stay in a radix cache, evictable least-recently-used, so a rollout that waits on a
  tool while others need the space loses its prefix and prefills it again; admission is
  optimistic (SGLang's ``new_token_ratio`` estimate of how much of ``max_new_tokens`` running
  requests will still use, not their budget); when decode runs out of KV the engine retracts
  requests and recomputes them later. A scheduler that relies on the engine's own admission
  (static, round-robin, least-requests) can therefore overcommit an engine and pay
  recomputation; one that reserves each rollout's whole budget (kv-aware) keeps every live
  rollout's context resident.

Rollouts are driven exactly like :func:`kuberl.rollout.loop.rollout_one` drives them: one
scheduler session for the whole rollout, one ``generate`` per turn, a tool call between turns
(random latency), and tool-response tokens appended to the context. ``turn_sync=True`` models
verl v0.2's synchronous batch rollout on top of static allocation: the rollouts of an engine
advance turn by turn together and the turn's tool calls are collected and executed as a batch.

Everything is seeded; the same inputs give the same numbers on any machine.
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kuberl.rollout.engine import Engine, EngineLoad, GenerateOutput, GenerateRequest
from kuberl.rollout.scheduler import Scheduler

# -- virtual time -------------------------------------------------------------------------------


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer instead of sleeping.

    The selector is polled without blocking; when nothing is ready the virtual clock advances
    by the timeout the loop asked for (the delay to its next timer). A loop with no timers and
    nothing ready would block forever, which in a simulation is a deadlock: raise instead.
    """

    def __init__(self) -> None:
        super().__init__(selectors.SelectSelector())
        self._now = 0.0
        selector = self._selector  # type: ignore[attr-defined]
        poll = selector.select

        def select(timeout: float | None = None):
            events = poll(0)
            if events:
                return events
            if timeout is None:
                raise RuntimeError("simulation deadlock: no timers and nothing ready")
            self._now += max(0.0, timeout)
            return []

        selector.select = select

    def time(self) -> float:
        return self._now


def run_virtual(coro_factory: Callable[[], object]):
    """Run ``coro_factory()`` to completion on a fresh VirtualTimeLoop; return its result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro_factory())
    finally:
        loop.close()


# -- engines ------------------------------------------------------------------------------------

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION default
RETRACT_DECODE_STEPS = 20  # SGLang's retract_decode_steps: room kept per request after retracting


@dataclass(frozen=True)
class EngineSpec:
    """One simulated inference engine."""

    name: str
    capacity: int  # KV-cache tokens (SGLang max_total_num_tokens)
    t0: float  # seconds per decode step while memory-bound (batch <= b_sat)
    b_sat: int  # batch size where decode becomes compute-bound
    prefill_per_token: float  # seconds per prefilled token
    max_running: int = 512
    init_new_token_ratio: float = 0.7  # SGLang defaults
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per decode step

    def step_time(self, batch: int) -> float:
        return self.t0 * max(1.0, batch / self.b_sat)

    @property
    def peak_throughput(self) -> float:
        """Decode tokens per second at or beyond saturation."""
        return self.b_sat / self.t0

    def scaled(self, b_sat_scale: float) -> EngineSpec:
        """The same engine with ``b_sat`` scaled, prefill cost per token scaled to match (prefill is
        compute-bound like saturated decode, so its token rate grows with the same compute)."""
        b_sat = max(1, round(self.b_sat * b_sat_scale))
        return replace(self, b_sat=b_sat, prefill_per_token=self.prefill_per_token * self.b_sat / b_sat)


@dataclass
class _SimReq:
    rid: str
    session: str
    context: int  # tokens of input + output so far (all in the KV cache while running)
    remaining: int  # tokens still to generate (known to the workload, not to the engine)
    max_new: int  # what the engine knows: the request's max_new_tokens
    output: int = 0
    hit: int = 0  # prefix found in the cache at admission (locked while running)
    prefill: int = 0  # tokens to prefill before the next decode step
    future: asyncio.Future | None = None


@dataclass
class EngineStats:
    busy_s: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0  # prefilled again: retracted requests, prefixes evicted mid-rollout
    overflow_events: int = 0  # decode ran out of KV and requests were retracted
    evicted_requests: int = 0  # requests retracted
    prefix_evictions: int = 0  # a rollout came back from a tool call to find its prefix evicted
    peak_kv_tokens: int = 0  # tokens held by running requests
    last_busy_end: float = 0.0


class SimEngine(Engine):
    """A simulated continuous-batching engine with SGLang's KV management.

    * Radix cache: a finished request's tokens stay in the KV cache, evictable, until space is
      needed; eviction is least-recently-used and from the tail of a sequence. A rollout's next
      turn (same session, the rid before its last "/") reuses what is left of its prefix and
      prefills the rest; prefix tokens it lost to eviction count as recomputed.
    * Admission (SGLang's PrefillAdder): a waiting request, first come first served, is admitted
      when ``extend + min(max_new_tokens, 4096)`` is below the free plus evictable tokens minus
      ``new_token_ratio * min(remaining max_new_tokens, 4096)`` of every running request (and
      the full estimate of those admitted in the same round). ``new_token_ratio`` starts at 0.7
      and decays by 0.001 per decode step to 0.1, so admission becomes optimistic.
    * Retraction (SGLang's retract_decode): when a decode step finds fewer free plus evictable
      tokens than running requests, requests with the fewest output tokens (longest input on
      ties) are retracted until every remaining one has 20 steps of room; their KV beyond the
      cached prefix is freed and they return to the head of the queue to be prefilled again.
      ``new_token_ratio`` becomes (decoded + 20 per request) / max_new_tokens of the remaining
      ones. Each retraction is an overflow event.

    How many tokens the "model" generates for a request comes from ``oracle(req)``: the
    workload decides, the engine only enforces ``max_new_tokens``.
    """

    def __init__(self, spec: EngineSpec, oracle: Callable[[GenerateRequest], int]):
        self.name = spec.name
        self.spec = spec
        self.oracle = oracle
        self.stats = EngineStats()
        self._waiting: deque[_SimReq] = deque()
        self._running: list[_SimReq] = []
        self._cache: OrderedDict[str, int] = OrderedDict()  # session -> cached tokens, LRU first
        self._cached_tokens = 0
        self._lost: dict[str, int] = {}  # session -> prefix tokens evicted since it last ran
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ratio = spec.init_new_token_ratio

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        want = max(1, self.oracle(req))
        n = min(want, req.max_new_tokens)
        finish = "stop" if want <= req.max_new_tokens else "length"
        if n <= 0:
            return GenerateOutput([], [], "length")
        session = req.rid.rsplit("/", 1)[0]
        sim = _SimReq(req.rid, session, len(req.input_ids), n, req.max_new_tokens)
        sim.future = asyncio.get_running_loop().create_future()
        self._waiting.append(sim)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        if await sim.future == "abort":  # a single sequence outgrew the whole cache
            return GenerateOutput([0] * sim.output, [0.0] * sim.output, "abort")
        return GenerateOutput([0] * n, [0.0] * n, finish)  # type: ignore[arg-type]

    async def max_total_tokens(self) -> int:
        return self.spec.capacity

    async def health(self) -> bool:
        return True

    async def load_metrics(self) -> EngineLoad:
        return EngineLoad(self._usage() / self.spec.capacity, len(self._running), len(self._waiting))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # KV book-keeping: capacity = running (locked) + cached (evictable) + free.

    def _usage(self) -> int:
        return sum(r.context for r in self._running)

    def _free(self) -> int:
        return self.spec.capacity - self._usage() - self._cached_tokens

    def _evict(self, tokens: int) -> None:
        """Free ``tokens`` cached tokens, least recently used first, from the tail of each entry."""
        while tokens > 0 and self._cache:
            session, held = next(iter(self._cache.items()))
            take = min(held, tokens)
            tokens -= take
            self._cached_tokens -= take
            self._lost[session] = self._lost.get(session, 0) + take
            if take == held:
                del self._cache[session]
            else:
                self._cache[session] = held - take

    def _allocate(self, tokens: int) -> None:
        short = tokens - self._free()
        if short > 0:
            self._evict(short)
        assert self._free() >= tokens, "allocation beyond the KV cache"

    def _cache_put(self, session: str, tokens: int) -> None:
        self._cached_tokens -= self._cache.pop(session, 0)
        if tokens > 0:
            self._cache[session] = tokens
            self._cached_tokens += tokens

    def _admit(self) -> None:
        """One scheduling round of SGLang's PrefillAdder (see the class docstring)."""
        spec = self.spec
        offset = sum(self._ratio * min(r.max_new - r.output, CLIP_MAX_NEW_TOKENS) for r in self._running)
        rem = self._free() + self._cached_tokens - offset
        while self._waiting and len(self._running) < spec.max_running:
            req = self._waiting[0]
            hit = min(self._cache.get(req.session, 0), req.context)
            extend = req.context - hit
            need = extend + min(req.max_new - req.output, CLIP_MAX_NEW_TOKENS)
            if need >= rem - hit and self._running:
                break
            self._waiting.popleft()
            if extend > self._free() + self._cached_tokens - hit:  # larger than the whole cache
                assert req.future is not None
                req.future.set_result("abort")
                continue
            rem -= need + hit
            held = self._cache.pop(req.session, 0)
            self._cached_tokens -= held
            if held > hit:  # a cached tail beyond this request's input: give it back
                self._cache_put(req.session, held - hit)
            lost = min(self._lost.pop(req.session, 0), extend)
            if lost:  # prefix tokens evicted while the rollout waited (on a tool, or retracted)
                self.stats.prefix_evictions += req.output == 0
                self.stats.recomputed_tokens += lost
            req.hit, req.prefill = hit, extend
            self._running.append(req)  # holds its hit now; the extend tokens are allocated below
            req_context, req.context = req.context, hit
            self._allocate(extend)
            req.context = req_context

    def _retract(self) -> None:
        """Out of KV in decode: retract requests until the rest have RETRACT_DECODE_STEPS of room."""
        self.stats.overflow_events += 1
        order = sorted(self._running, key=lambda r: (r.output, -(r.context - r.output)), reverse=True)
        retracted: list[_SimReq] = []
        while len(order) > 1 and (
            not retracted or self._free() + self._cached_tokens < len(order) * RETRACT_DECODE_STEPS
        ):
            r = order.pop()
            self._running.remove(r)
            retracted.append(r)
            self.stats.recomputed_tokens += r.context - r.hit
            self._cache_put(r.session, r.hit)  # the cached prefix stays, unlocked; the rest is freed
            self._lost.pop(r.session, None)
        self.stats.evicted_requests += len(retracted)
        self._waiting.extendleft(reversed(retracted))
        decoded = sum(r.output for r in self._running)
        budget = sum(r.max_new for r in self._running)
        if budget:
            self._ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self._running)) / budget)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        spec = self.spec
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            b = len(self._running)
            room = self._free() + self._cached_tokens
            if room < b:
                if b == 1:  # one sequence outgrew the whole cache: SGLang aborts it
                    r = self._running.pop()
                    self._cache_put(r.session, r.hit)
                    assert r.future is not None
                    r.future.set_result("abort")
                    continue
                self._retract()
                continue
            # Prefill what was just admitted, as part of the next step.
            prefill = sum(r.prefill for r in self._running)
            self.stats.prefill_tokens += prefill
            for r in self._running:
                r.prefill = 0
            dt = spec.step_time(b)
            # Run k decode steps at once: until the first request finishes or the KV is full.
            k = min(min(r.remaining for r in self._running), room // b)
            if self._waiting:  # re-check admission regularly while requests wait
                k = min(k, 16)
            self._wake.clear()
            start = loop.time()
            planned = prefill * spec.prefill_per_token + k * dt
            try:
                await asyncio.wait_for(self._wake.wait(), planned)
                # A new request arrived: finish the step in flight, then admit it.
                elapsed = loop.time() - start - prefill * spec.prefill_per_token
                done = min(k, max(1, math.ceil(max(0.0, elapsed) / dt)))
                rest = prefill * spec.prefill_per_token + done * dt - (loop.time() - start)
                if rest > 0:
                    await asyncio.sleep(rest)
            except TimeoutError:
                done = k
            self.stats.busy_s += loop.time() - start
            self.stats.last_busy_end = loop.time()
            self.stats.decode_tokens += done * b
            self._ratio = max(spec.min_new_token_ratio, self._ratio - spec.new_token_ratio_decay * done)
            self._allocate(done * b)
            finished = []
            for r in self._running:
                r.context += done
                r.output += done
                r.remaining -= done
                if r.remaining <= 0:
                    finished.append(r)
            self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self._usage())
            for r in finished:
                self._running.remove(r)
                self._cache_put(r.session, r.context)  # stays cached (evictable) for the next turn
                assert r.future is not None
                r.future.set_result("done")


# -- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutPlan:
    """What one rollout will do: tokens per assistant turn, tool latency and response per call."""

    prompt: int
    turns: tuple[int, ...]
    tool_latency: tuple[float, ...]  # after turn i (len(turns) - 1 entries)
    tool_tokens: tuple[int, ...]

    @property
    def decode_tokens(self) -> int:
        return sum(self.turns)


@dataclass(frozen=True)
class WorkloadSpec:
    rollouts: int = 2048
    max_turns: int = 8
    max_response_tokens: int = 4096
    prompt_range: tuple[int, int] = (200, 600)
    turn_tokens_median: float = 300.0
    turn_tokens_sigma: float = 1.0  # lognormal: heavy tail of long turns
    continue_prob: float = 0.6  # chance of another tool turn (geometric number of turns)
    tool_tokens_median: float = 60.0
    tool_tokens_sigma: float = 0.8
    tool_latency_median_s: float = 0.3
    tool_latency_sigma: float = 1.0
    tool_timeout_s: float = 10.0


def make_workload(spec: WorkloadSpec, seed: int) -> list[RolloutPlan]:
    """Seeded rollouts whose response (turns + tool responses) fits ``max_response_tokens``."""
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(spec.rollouts):
        prompt = int(rng.integers(spec.prompt_range[0], spec.prompt_range[1] + 1))
        budget = spec.max_response_tokens
        turns: list[int] = []
        lat: list[float] = []
        tools: list[int] = []
        while True:
            want = max(8, int(rng.lognormal(math.log(spec.turn_tokens_median), spec.turn_tokens_sigma)))
            turns.append(min(want, budget))
            budget -= turns[-1]
            more = len(turns) < spec.max_turns and rng.random() < spec.continue_prob
            if not more or budget <= 1:
                break
            resp = max(4, int(rng.lognormal(math.log(spec.tool_tokens_median), spec.tool_tokens_sigma)))
            resp = min(resp, budget - 1)
            tools.append(resp)
            budget -= resp
            lat.append(
                min(
                    spec.tool_timeout_s,
                    rng.lognormal(math.log(spec.tool_latency_median_s), spec.tool_latency_sigma),
                )
            )
        plans.append(RolloutPlan(prompt, tuple(turns), tuple(lat), tuple(tools)))
    return plans


# -- driving rollouts through the real Scheduler -------------------------------------------------


class TurnSync:
    """A barrier whose party count shrinks as rollouts finish (verl's per-turn synchronization)."""

    def __init__(self) -> None:
        self.parties = 0
        self._arrived = 0
        self._generation = 0
        self._cond = asyncio.Condition()

    def join(self) -> None:
        self.parties += 1

    async def arrive(self) -> None:
        async with self._cond:
            self._arrived += 1
            gen = self._generation
            if self._arrived >= self.parties:
                self._release()
            else:
                await self._cond.wait_for(lambda: self._generation != gen)

    async def leave(self) -> None:
        async with self._cond:
            self.parties -= 1
            if self.parties and self._arrived >= self.parties:
                self._release()

    def _release(self) -> None:
        self._arrived = 0
        self._generation += 1
        self._cond.notify_all()


@dataclass
class SimResult:
    policy: str
    makespan_s: float
    idle_fraction: float  # share of engine-seconds in [0, makespan] with nothing running
    overflow_events: int  # decode ran out of KV and the engine retracted requests
    recomputed_tokens: int  # prefilled again after a retraction or an evicted prefix
    prefix_evictions: int  # turns that found their rollout's earlier context evicted
    scheduler_overflow_events: int  # reservations beyond capacity (kv-aware: always 0)
    per_engine: list[dict] = field(default_factory=list)


async def _simulate(
    plans: list[RolloutPlan],
    engines: list[EngineSpec],
    policy: str,
    max_response_tokens: int,
    turn_sync: bool,
    max_inflight_per_engine: int | None,
) -> SimResult:
    loop = asyncio.get_running_loop()
    lengths: dict[str, int] = {}

    def oracle(req: GenerateRequest) -> int:
        return lengths[req.rid]

    sims = [SimEngine(s, oracle) for s in engines]
    sched = Scheduler(sims, policy=policy, max_inflight_per_engine=max_inflight_per_engine)
    sched.start_batch(len(plans))
    syncs = {s.name: TurnSync() for s in sims}

    async def rollout(i: int, plan: RolloutPlan) -> None:
        async with sched.session(plan.prompt, max_response_tokens) as engine:
            sync = syncs[engine.name] if turn_sync else None
            if sync:
                sync.join()
            context = plan.prompt
            try:
                for t, tokens in enumerate(plan.turns):
                    rid = f"r{i}/t{t}"
                    lengths[rid] = tokens
                    out = await engine.generate(
                        GenerateRequest([0] * context, max_response_tokens - (context - plan.prompt), rid=rid)
                    )
                    context += len(out.output_ids)
                    if t == len(plan.turns) - 1:
                        break
                    if sync:
                        await sync.arrive()  # the whole batch finishes the turn ...
                    await asyncio.sleep(plan.tool_latency[t])
                    if sync:
                        await sync.arrive()  # ... and its tool calls, before anyone goes on
                    context += plan.tool_tokens[t]
            finally:
                if sync:
                    await sync.leave()

    start = loop.time()
    await asyncio.gather(*(rollout(i, p) for i, p in enumerate(plans)))
    makespan = loop.time() - start
    for s in sims:
        await s.close()
    idle = sum(max(0.0, makespan - s.stats.busy_s) for s in sims) / (makespan * len(sims))
    return SimResult(
        policy=policy + ("+turn-sync" if turn_sync else ""),
        makespan_s=makespan,
        idle_fraction=idle,
        overflow_events=sum(s.stats.overflow_events for s in sims),
        recomputed_tokens=sum(s.stats.recomputed_tokens for s in sims),
        prefix_evictions=sum(s.stats.prefix_evictions for s in sims),
        scheduler_overflow_events=sched.overflow_events,
        per_engine=[
            {
                "engine": s.name,
                "sessions": st["sessions_total"],
                "busy_s": s.stats.busy_s,
                "decode_tokens": s.stats.decode_tokens,
                "overflow_events": s.stats.overflow_events,
                "recomputed_tokens": s.stats.recomputed_tokens,
                "peak_kv_tokens": s.stats.peak_kv_tokens,
                "capacity": s.spec.capacity,
            }
            for s, st in zip(sims, sched.snapshot(), strict=True)
        ],
    )


def simulate(
    plans: list[RolloutPlan],
    engines: list[EngineSpec],
    policy: str,
    *,
    max_response_tokens: int,
    turn_sync: bool = False,
    max_inflight_per_engine: int | None = None,
) -> SimResult:
    """Run all ``plans`` through a Scheduler with ``policy`` over simulated ``engines``."""
    return run_virtual(
        lambda: _simulate(plans, engines, policy, max_response_tokens, turn_sync, max_inflight_per_engine)
    )


def lower_bound(plans: list[RolloutPlan], engines: list[EngineSpec]) -> float:
    """No schedule can finish sooner than this.

    The larger of (a) all necessary work at the fleet's peak rate: every decode token, plus
    every prompt and tool-response token prefilled once, priced in decode-token equivalents at
    the cheapest engine's prefill/decode cost ratio, over the sum of peak decode throughputs;
    and (b) the longest rollout alone: its decode steps at the fastest single-sequence speed
    plus its tool calls. Recomputation after evictions is waste and is not counted.
    """
    decode = sum(p.decode_tokens for p in plans)
    prefill = sum(p.prompt + sum(p.tool_tokens) for p in plans)
    ratio = min(e.prefill_per_token * e.peak_throughput for e in engines)
    work = (decode + ratio * prefill) / sum(e.peak_throughput for e in engines)
    t0 = min(e.t0 for e in engines)
    critical = max(p.decode_tokens * t0 + sum(p.tool_latency) for p in plans)
    return max(work, critical)
