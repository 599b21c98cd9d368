"""The rollout worker: engines, the KV-aware scheduler and the sandbox client, producing scored
rollout groups for the trainer (:mod:`kuberl.trainer.grpo` does the update).

The trainer reaches it through a :class:`~kuberl.rollout.client.RolloutClient` (the worker as a
Ray actor, or in-process with ``--no-ray``). Its asyncio loop runs in a thread of its own, so a
batch submitted for a later step generates while the trainer updates; which batches go out
when is the :class:`~kuberl.rollout.orchestrator.Orchestrator`'s decision.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch
from torch import nn

from kuberl.rollout.engine import ENGINE_FAULTS
from kuberl.rollout.loop import BatchRequest, Tokenizer, ToolExecutor, rollout_group
from kuberl.rollout.scored import Scored
from kuberl.rollout.tool_stats import ToolTally


class SftBuilder(Protocol):
    """Writes SFT traces of ``problems`` whose tool outputs come from ``executor`` (the sandbox)."""

    def __call__(
        self, problems: list, executor: ToolExecutor, *, seed: int, error_fraction: float, style: str
    ) -> Awaitable[list]: ...


def parse_cpus(spec: str) -> set[int]:
    """The cores of a cpuset string ("0", "0,2", "1-3"); a malformed one names itself."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"KUBERL_ROLLOUT_CPUS={spec!r}: expected cores like '0', '0,2' or '1-3'") from None
    return cpus


def pin_to_cpus(spec: str | None) -> None:
    """Restrict every thread of this process to the cores of ``spec``; None or "" leaves it.

    ``sched_setaffinity(0, ...)`` moves only the calling thread. In a Ray actor that is one
    executor thread; the process's main thread (which receives every call), Ray's gRPC and IO
    threads and the GC thread keep the mask the actor was started with and run Python too, so
    every thread listed in /proc/self/task is moved. Threads started later inherit the mask of
    the thread that starts them.
    """
    if not spec:
        return
    cpus = parse_cpus(spec)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended since the listing
            pass


class RolloutWorker:
    """Owns the engines, Scheduler and sandbox client; one persistent event loop.

    Engines: a LocalEngine serving a private copy of the policy (``make_policy()``, the
    default), ``engine_factory(model, tokenizer)``'s engine (tests script what the policy
    writes), or, with ``fleet``, the SGLang engines of a RolloutFleet, kept current by a
    FleetWatcher; a fleet takes new weights as a published folder (:meth:`load_weights`), the
    local engine as a state dict (:meth:`set_weights`).

    The trainer hands in what the worker builds from it: ``make_policy`` and
    ``make_tokenizer`` run in the worker's process, ``sft_builder`` writes SFT traces with the
    worker's sandbox executor (:meth:`build_sft`). Under Ray every argument is pickled, so
    they are module-level functions or partials of them.

    ``executor_factory`` returns an async context manager yielding a ToolExecutor with
    ``verify_batch`` (``SandboxClient`` by default), so tests can substitute a fake sandbox.
    ``partial_rollouts`` (``algorithm.partialRollouts``): what a weight push does to the
    generations in flight on the local engine and the fleet's engines (``Engine.partial_rollouts``).
    ``batches_in_flight`` (``algorithm.asyncLevel``, at least 1): how many submitted batches may
    generate at once (see :meth:`submit_rollouts`).
    """

    def __init__(
        self,
        make_policy: Callable[[], nn.Module] | None,
        make_tokenizer: Callable[[], Tokenizer],
        sandbox_url: str | None,
        *,
        device: str = "cpu",
        threads: int | None = None,
        max_total_tokens: int = 65536,
        max_batch: int = 256,
        executor_factory: Callable[[], Any] | None = None,
        engine_factory: Callable[[nn.Module, Any], Any] | None = None,
        fleet: Any = None,
        scheduler_policy: str = "kv-aware",
        sft_builder: SftBuilder | None = None,
        partial_rollouts: bool = False,
        batches_in_flight: int = 1,
    ):
        if batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be >= 1, got {batches_in_flight}")
        self.batches_in_flight = batches_in_flight
        if threads:
            torch.set_num_threads(threads)
        pin_to_cpus(os.environ.get("KUBERL_ROLLOUT_CPUS"))  # benches: the engine on its own cores
        from kuberl.rollout.local_engine import LocalEngine
        from kuberl.rollout.scheduler import Scheduler

        self.tokenizer = make_tokenizer()
        self.sft_builder = sft_builder
        self.device = device
        if executor_factory is None:
            if sandbox_url is None:
                raise ValueError("RolloutWorker needs a sandbox_url or an executor_factory")
            from kuberl.sandbox.service.client import SandboxClient

            def executor_factory():
                return SandboxClient(sandbox_url)

        # A private event loop on its own thread: Ray actors (and Jupyter) already run a loop on
        # the calling thread, so run_until_complete() there is not an option.
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()
        self._tickets = itertools.count()
        self._inflight: dict[int, concurrent.futures.Future] = {}
        self._active = 0  # rollout batches in flight, and the time any was: the engine side's busy time
        self._last_batch_end: asyncio.Future | None = None  # engines that pad rows: batches in turn
        self._busy_since = 0.0
        self.busy_total = 0.0
        self._kv_peak: float | None = None  # highest KV-cache use sampled since the last step_stats
        self._fault_totals: dict[str, int] = {}  # engines' fault counters at the last step_stats
        self._sampler: asyncio.Task | None = None
        self.engine: Any = None
        self.fleet: Any = None
        if fleet is not None:
            from kuberl.rollout.fleet import FleetWatcher

            self.fleet = FleetWatcher(
                fleet, policy=scheduler_policy, engine_kwargs={"partial_rollouts": partial_rollouts}
            )
            self.scheduler = self._run(self.fleet.start())
        else:
            if make_policy is None:
                raise ValueError("RolloutWorker needs a make_policy or a fleet")
            self.model = make_policy()
            if engine_factory is None:
                self.engine = LocalEngine(
                    self.model, max_total_tokens=max_total_tokens, max_batch=max_batch, device=device, seed=0,
                    partial_rollouts=partial_rollouts,
                )  # fmt: skip
            else:
                self.engine = engine_factory(self.model, self.tokenizer)
            self.scheduler = Scheduler([self.engine], policy=scheduler_policy)
            # Learn the engines' capacities now rather than inside the first rollouts() call, so a
            # worker started by a resume schedules its first batch exactly like a long-lived one.
            self._run(self.scheduler.refresh_capacities())
        self._cm = executor_factory()
        self.executor = ToolTally(self._run(self._cm.__aenter__()))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        if self.engine is None:
            raise RuntimeError(
                "this worker rolls out on a fleet of HTTP engines: new weights go through load_weights"
            )
        self.engine.set_weights({k: v.to(self.device) for k, v in state_dict.items()}, version=version)

    def load_weights(self, path: str, version: int | None = None) -> None:
        """Every fleet engine loads the HF folder ``path`` (engines that join later, too)."""
        if self.fleet is None:
            raise RuntimeError("this worker rolls out on a local engine: new weights go through set_weights")
        self._run(self.fleet.load_weights(path, version))

    def rollouts(self, request: BatchRequest) -> list[list[Scored]]:
        """:meth:`submit_rollouts` and wait for them: the synchronous path."""
        return self.collect_rollouts(self.submit_rollouts(request))

    def submit_rollouts(self, request: BatchRequest) -> int:
        """Start ``request.n`` scored rollouts per prompt (reward = sandbox verify of the extracted
        answer) in the background; returns a ticket for :meth:`collect_rollouts`.

        With ``request.seed`` every rollout samples from its own seed derived from (seed, prompt
        index, sample index, turn), so the result does not depend on tool latency or batching.
        The worker's event loop keeps serving weight pushes and other calls meanwhile.

        Up to ``batches_in_flight`` batches' rollouts generate at once (``Scheduler.max_active``;
        FIFO admission gives the older batch its places first): a batch submitted ahead starts at
        once on the version the engines serve then, beside the one before it, so on engines whose
        throughput grows with the rows they decode together (paged KV caches: vLLM, SGLang) the
        fleet generates more per second, and asyncLevel k really runs k versions ahead. On
        engines that pad rows it waits for the batch before it to end instead
        (:meth:`_batches_in_turn`).
        """
        self._run(self._limit_active(len(request.prompts) * request.n))
        ticket = next(self._tickets)
        self._inflight[ticket] = asyncio.run_coroutine_threadsafe(self._rollouts(request), self.loop)
        return ticket

    async def _limit_active(self, rollouts: int) -> None:
        if rollouts > 0:
            self.scheduler.max_active = rollouts * self.batches_in_flight

    def collect_rollouts(self, ticket: int) -> list[list[Scored]]:
        """The groups of a :meth:`submit_rollouts` call (waits for them)."""
        return self._inflight.pop(ticket).result()

    def discard_rollouts(self, ticket: int) -> None:
        """Cancel a submitted batch (a run stopping early does not wait for batches it won't train)."""
        fut = self._inflight.pop(ticket, None)
        if fut is not None:
            fut.cancel()

    def step_stats(self) -> dict[str, float]:
        """Tool-call outcomes and latency, the engines in service, the peak KV-cache use of the
        engines and their fault counts (:data:`ENGINE_FAULTS`), since the last call (taken on the loop thread, where they
        are recorded)."""

        async def take() -> dict[str, float]:
            out = self.executor.take()
            # the fleet's size as this trainer sees it at the step's end (replicas join and leave)
            out["engines_in_service"] = float(sum(not st.draining for st in self.scheduler.stats))
            if self._kv_peak is not None:
                out["kv_cache_utilization"] = self._kv_peak
            self._kv_peak = None
            for attr, key, _ in ENGINE_FAULTS:
                total = sum(getattr(e, attr, 0) for e in self.scheduler.engines)
                if total or key in self._fault_totals:
                    out[key] = float(max(0, total - self._fault_totals.get(key, 0)))
                    self._fault_totals[key] = total
            return out

        return self._run(take())

    async def _sample_kv(self, every: float = 0.05) -> None:
        """While rollouts run, keep the highest KV-cache use of any engine (the engines' own
        gauge is instantaneous: idle, 0, whenever a step ends)."""
        try:
            while self._active > 0:
                use = max((st["utilization"] for st in self.scheduler.snapshot()), default=None)
                if use is not None:
                    self._kv_peak = max(use, self._kv_peak or 0.0)
                await asyncio.sleep(every)
        finally:
            if self._sampler is asyncio.current_task():
                self._sampler = None

    def busy_seconds(self) -> float:
        """Wall time during which at least one rollout batch was generating (up to now)."""
        return self.busy_total + (time.monotonic() - self._busy_since if self._active else 0.0)

    def _batches_in_turn(self) -> bool:
        """Whether a batch submitted ahead waits for the one before it to end instead of
        generating beside it: on engines that pad every row to the longest (``Engine.pads_rows``:
        the local engine), fresh short rows beside an old batch's long ones pay for its long
        context in every decode step, and on a CPU a decode step costs the same per row from 64
        rows up (bench/README.md, "asyncLevel 2 runs ahead"), so more rows at once buy no
        throughput and a batch in turn is the faster order. There a batch two steps ahead starts
        when the one before it ends, by when the next version is out when generation is the
        longer side: asyncLevel 2 runs one version ahead, as 1 does. Paged KV caches (vLLM,
        SGLang) charge each row its own context: there the batches generate together."""
        engines = self.scheduler.engines
        return bool(engines) and all(getattr(e, "pads_rows", False) for e in engines)

    async def _rollouts(self, request: BatchRequest) -> list[list[Scored]]:
        before = done = None
        if self._batches_in_turn():
            before, done = self._last_batch_end, self.loop.create_future()
            self._last_batch_end = done
        try:
            if before is not None:
                await asyncio.shield(before)  # a batch cancelled while it waits leaves the one before alone
            return await self._timed_rollouts(request)
        finally:
            if done is not None:  # ends no earlier than the batch before it (a cancelled one included)
                if before is None or before.done():
                    done.set_result(None)
                else:
                    before.add_done_callback(lambda _f: done.done() or done.set_result(None))

    async def _timed_rollouts(self, request: BatchRequest) -> list[list[Scored]]:
        if self._active == 0:
            self._busy_since = time.monotonic()
        self._active += 1
        if self._sampler is None:
            self._sampler = asyncio.ensure_future(self._sample_kv())
        try:
            return await self._scored_rollouts(request)
        finally:
            self._active -= 1
            if self._active == 0:
                self.busy_total += time.monotonic() - self._busy_since
                if self._sampler is not None:  # not left sleeping on a loop that may close next
                    self._sampler.cancel()
                    self._sampler = None

    async def _scored_rollouts(self, request: BatchRequest) -> list[list[Scored]]:
        groups = await rollout_group(
            self.scheduler,
            self.tokenizer,
            self.executor,
            request.prompts,
            request.n,
            seed=request.seed,
            max_turns=request.max_turns,
            max_response_tokens=request.max_response_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
        )
        golds = request.golds
        pairs, where = [], []
        for i, group in enumerate(groups):
            for j, t in enumerate(group):
                if t.answer is not None and not t.truncated:
                    pairs.append((t.answer, golds[i]))
                    where.append((i, j))
        ok = await self.executor.verify_batch(pairs) if pairs else []
        rewards = [[0.0] * len(g) for g in groups]
        for (i, j), good in zip(where, ok, strict=True):
            rewards[i][j] = 1.0 if good else 0.0
        targets = request.length_targets or [None] * len(groups)
        return [
            [Scored(t, r, target) for t, r in zip(g, rw, strict=True)]
            for g, rw, target in zip(groups, rewards, targets, strict=True)
        ]

    def rollout_metrics(self) -> list[dict[str, Any]]:
        """Per-engine load and generated tokens, for a driver whose exporter this process is not.

        Under Ray the Scheduler's gauges live in the actor's registry, which nothing serves;
        the driver polls this and mirrors it (``kuberl.rollout.mirror.RolloutMirror``).
        """

        async def snap() -> list[dict[str, Any]]:  # on the loop thread: no torn reads
            engines = {e.name: e for e in self.scheduler.engines}
            waiting = self.scheduler.waiting
            return [
                {
                    "engine": st["engine"],
                    "kv_cache_utilization": st["utilization"],
                    "requests_inflight": st["inflight"],
                    "requests_waiting": waiting,  # the scheduler's, repeated on every row
                    "generated_tokens": getattr(engines.get(st["engine"]), "generated_tokens", None),
                }
                for st in self.scheduler.snapshot()
            ]

        return self._run(snap())

    def score_on_engines(self, seqs: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        """Every engine of the fleet scores sequences with the weights it serves now.

        Sequence i goes to engine ``i % len(engines)`` (engines in name order), so a handful of
        sequences looks at every engine. Returns one record per sequence: ``engine``,
        ``logprobs`` (of ``seq[start:]``), ``version`` (what the engine served), or ``error``
        for an engine that could not score (it is reported, the step goes on). The spot check
        of asynchronous runs: the trainer compares these with its own pi_old of the same
        sequences, valid whatever version sampled them (paper-free; INTELLECT-2's TOPLOC checks
        untrusted workers the same way, by recomputation).
        """

        async def run() -> list[dict[str, Any]]:
            engines = sorted(self.scheduler.engines, key=lambda e: e.name)
            if not engines:
                return []

            async def one(i: int) -> dict[str, Any]:
                engine = engines[i % len(engines)]
                try:
                    out = await engine.score(seqs[i], starts[i])
                except Exception as err:  # noqa: BLE001 - one engine's failure is a finding, not a crash
                    return {"engine": engine.name, "error": f"{type(err).__name__}: {err}"}
                return {"engine": engine.name, "logprobs": out.logprobs, "version": out.weight_version}

            return list(await asyncio.gather(*(one(i) for i in range(len(seqs)))))

        return self._run(run())

    def build_sft(self, problems: list, *, seed: int, error_fraction: float, style: str = "compact") -> list:
        """``sft_builder``'s traces of ``problems``, their tool outputs from this worker's sandbox."""
        if self.sft_builder is None:
            raise RuntimeError("this worker was given no sft_builder")
        return self._run(
            self.sft_builder(problems, self.executor, seed=seed, error_fraction=error_fraction, style=style)
        )

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self._run(self.scheduler.close())  # its load poller, before the engines it polls
            self._run(self.engine.close() if self.fleet is None else self.fleet.close())
            self._run(self._cm.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
