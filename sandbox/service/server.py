"""The sandbox service: central bounded queue, batching dispatch to warm fork-servers (its
HTTP/JSON routes and the process entry point are in ``app.py``).

Every accepted call is answered exactly once: calls carry an idempotency id, answers are
remembered by (operation, id) and payload digest (``idempotency``), a retried id joins the
in-flight call instead of running again and an id reused for a different call gets 409.
A full queue answers 429 with Retry-After (backpressure, not unbounded memory).

A worker that dies or stops answering is replaced (with backoff while it cannot start): the
call it was running is answered with an error, the calls queued behind it in its batch run
again once on the new worker, and /readyz says 503 while fewer workers are up than
configured. The server is a child subreaper, so whatever a dead worker's calls left behind
is reparented to it and killed before the replacement starts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kuberl.sandbox.config import ServiceConfig
from kuberl.sandbox.containment.procs import kill_children
from kuberl.sandbox.service.idempotency import Conflict, Key, ResultMemory, answer_size, payload_digest
from kuberl.sandbox.service.progress import Window
from kuberl.sandbox.service.workers import WorkerLost, WorkerProc
from kuberl.sandbox.types import ExecResult, valid_text

log = logging.getLogger("kuberl.sandbox")

TOOL_LATENCY = Histogram(
    "kuberl_tool_call_latency_seconds",
    "Wall time of one tool call from submission to result, by outcome",
    ["pool", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TOOL_CALLS = Counter("kuberl_tool_calls", "Tool calls answered", ["pool", "outcome"])
QUEUE_DEPTH = Gauge("kuberl_sandbox_queue_depth", "Calls waiting for a worker", ["pool"])
WORKERS_BUSY = Gauge("kuberl_sandbox_workers_busy", "Workers executing a call", ["pool"])
VERIFY_CALLS = Counter(
    "kuberl_sandbox_verify_calls",
    "Answer verifications by result (correct, wrong, timeout, error)",
    ["pool", "outcome"],
)

_INT_RE = re.compile(r"^[+-]?\d+$")


def build_result(raw: dict[str, Any], timeout: float) -> ExecResult:
    """Map a worker's raw report to one of the five outcomes (pure; unit-tested)."""
    meta = raw.get("meta") or {}
    duration = float(raw.get("duration_s", 0.0))
    result = _build_result(raw, meta, duration, timeout)
    # whatever a call wrote, the client gets valid UTF-8 (no lone surrogates in the JSON)
    return ExecResult(result.outcome, valid_text(result.output), result.truncated, result.duration_s)


def _build_result(raw: dict[str, Any], meta: dict[str, Any], duration: float, timeout: float) -> ExecResult:
    stdout = raw.get("stdout", "")
    truncated = bool(raw.get("stdout_truncated")) or bool(meta.get("truncated"))
    if raw.get("disk_exceeded_mb"):
        msg = f"OSError: disk quota exceeded: the call's files grew beyond {raw['disk_exceeded_mb']} MB"
        return ExecResult("error", f"{stdout}{msg}" if stdout else msg, truncated, duration)
    if raw.get("timed_out"):
        msg = f"TimeoutError: execution exceeded {timeout:g} s"
        return ExecResult("timeout", f"{stdout}{msg}" if stdout else msg, truncated, duration)
    status = meta.get("status")
    if status == "memory" or (status is None and raw.get("oom")):
        return ExecResult("memory_limit", "MemoryError: memory limit exceeded", truncated, duration)
    if status == "error":
        tb = meta.get("traceback", "")
        text = f"{stdout}{tb}" if stdout else tb
        return ExecResult("error", text, truncated or bool(raw.get("stderr_truncated")), duration)
    if status is None:
        sig = raw.get("signal")
        why = f"killed by signal {sig}" if sig else f"exited with code {raw.get('exit_code')}"
        stderr = raw.get("stderr", "")
        text = f"{stdout}{stderr}RuntimeError: the program was {why}"
        return ExecResult("error", text, truncated, duration)
    if stdout:
        return ExecResult("stdout", stdout, truncated, duration)
    value = meta.get("repr")
    return ExecResult("no_stdout", value if value is not None else "", truncated, duration)


def integer_fast_path(prediction: str, gold: str) -> bool | None:
    """Both plain integers (after trivial cleanup): compare exactly without math-verify."""

    def clean(s: str) -> str:
        s = s.strip().strip("$").strip()
        m = re.fullmatch(r"\\boxed\{(.*)\}", s)
        if m:
            s = m.group(1).strip()
        return s.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+", s) else s

    p, g = clean(prediction), clean(gold)
    if _INT_RE.match(p) and _INT_RE.match(g):
        # digit strings, not int(): CPython refuses to convert more than 4300 digits
        return _canonical_int(p) == _canonical_int(g)
    return None


def _canonical_int(s: str) -> str:
    """``"+007"`` -> ``"7"``, ``"-0"`` -> ``"0"``: equal integers get equal strings."""
    sign = "-" if s[0] == "-" else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


class ServiceUnavailable(RuntimeError):
    """The service stopped before it could answer the call (the client retries elsewhere)."""


@dataclass
class _Call:
    key: Key
    digest: str
    payload: dict[str, Any]
    future: asyncio.Future
    submitted: float
    retried: bool = False


def _failure(why: str) -> dict[str, Any]:
    """A worker-style raw report for a call the worker could not answer."""
    return {"meta": {"status": "error", "traceback": f"RuntimeError: {why}\n"}}


class SandboxService:
    """Queue, dispatch, idempotency and metrics; HTTP handlers are thin shells over it."""

    # The worker implementation; a simulation swaps in one whose calls take modelled time, so
    # the queue, batching and backpressure below run unchanged.
    worker_class: type[WorkerProc] = WorkerProc

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.queue: collections.deque[_Call] = collections.deque()
        self.nonempty = asyncio.Event()  # for a batch's flush window (_take_batch)
        # One future per idle worker, woken one per queued call (_wake): a shared event would wake
        # every idle worker per call, up to the paper's 1024 workers per node.
        self._idle: collections.deque[asyncio.Future] = collections.deque()
        self.inflight: dict[Key, _Call] = {}
        self.memory = ResultMemory(cfg.remember, cfg.remember_bytes, cfg.remember_ttl_s)
        self.workers: list[WorkerProc] = []
        self.tasks: list[asyncio.Task] = []
        self.ready = False
        self.busy = 0
        self.restarts = 0
        self.answered = 0  # calls answered since start (the line printed at exit reports it)
        self._spawn_lock = asyncio.Lock()
        self.window = Window()  # for the periodic log line (sandbox/service/progress.py)
        # the pool's metric children, looked up once (labels() costs ~5 us, several times a call)
        self._queue_depth = QUEUE_DEPTH.labels(cfg.pool)
        self._workers_busy = WORKERS_BUSY.labels(cfg.pool)
        self._by_outcome: dict[str, tuple[Any, Any]] = {}

    async def start(self) -> None:
        self.workers = [self.worker_class(i, self.cfg) for i in range(self.cfg.workers)]
        await asyncio.gather(*(w.start(self._spawn_lock) for w in self.workers))
        self.tasks = [asyncio.create_task(self._worker_loop(w)) for w in self.workers]
        self.ready = True
        log.warning(
            "sandbox pool %s ready: %d workers, protections %s",
            self.cfg.pool,
            len(self.workers),
            self.protections(),
        )

    def protections(self) -> dict[str, bool]:
        return self.workers[0].protections if self.workers else {}

    def workers_up(self) -> int:
        return sum(1 for w in self.workers if w.up)

    def is_ready(self) -> bool:
        return self.ready and self.workers_up() == self.cfg.workers

    async def drain(self, timeout: float) -> int:
        """Take no more calls and let the running ones finish (a pod being deleted): a call still
        queued, never started, is answered 503 at once (its client retries it on another pod,
        where it runs for the first time); the running ones are waited for up to ``timeout``.
        How many calls were still running then (0: no call was cut off mid-run)."""
        self.ready = False  # new calls: 503 (the handlers), /readyz: 503
        while self.queue:
            call = self.queue.popleft()
            self.inflight.pop(call.key, None)
            if not call.future.done():
                call.future.set_exception(ServiceUnavailable("the sandbox service is stopping"))
        self._queue_depth.set(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return len(self.inflight)

    async def stop(self) -> None:
        self.ready = False
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for call in list(self.inflight.values()):
            if not call.future.done():
                call.future.set_exception(ServiceUnavailable("the sandbox service is stopping"))
        self.inflight.clear()
        self.queue.clear()
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def capacity_left(self) -> int:
        return self.cfg.queue_limit - len(self.queue)

    def lookup(self, key: Key, payload: dict[str, Any], digest: str | None = None) -> tuple[str, Any]:
        """("done", answer), ("inflight", future) or ("new", digest); raises Conflict when the
        key is known with a different payload. No side effects: a batch is checked whole first.
        ``digest``: the payload's, where the caller has it already."""
        digest = digest or payload_digest(payload)
        found, value = self.memory.recall(key, digest)
        if found:
            return "done", value
        call = self.inflight.get(key)
        if call is not None:
            if call.digest != digest:
                raise Conflict(f"{key[0]} id {key[1]!r} is already running a different call")
            return "inflight", call.future
        return "new", digest

    def submit(self, key: Key, payload: dict[str, Any], digest: str | None = None) -> asyncio.Future:
        """Enqueue (or join/recall) one call; caller has checked conflicts and capacity."""
        loop = asyncio.get_running_loop()
        state, found = self.lookup(key, payload, digest)
        if state == "inflight":
            return found
        fut = loop.create_future()
        if state == "done":
            fut.set_result(found)
            return fut
        call = _Call(key, found, payload, fut, loop.time())
        if payload["op"] == "verify":
            fast = _fast_verify(payload)
            if fast is not None:
                self._finish(call, {"meta": {"status": "ok", "correct": fast}})
                return fut
        self.inflight[key] = call
        self.queue.append(call)
        self._queue_depth.set(len(self.queue))
        self._wake(1)
        return fut

    def _wake(self, calls: int) -> None:
        """``calls`` were queued: wake that many idle workers (and any flush window waiting)."""
        self.nonempty.set()
        while calls > 0 and self._idle:
            idle = self._idle.popleft()
            if not idle.done():  # a worker that died or stopped while idle left a cancelled one
                idle.set_result(None)
                calls -= 1

    async def _take_batch(self) -> list[_Call]:
        while not self.queue:
            self.nonempty.clear()
            await self.nonempty.wait()
        batch = [self.queue.popleft()]
        clock = asyncio.get_running_loop().time  # the loop's clock: virtual in a simulation
        deadline = clock() + self.cfg.flush_ms / 1000
        limit = self.cfg.batch_size
        if self.cfg.flush_ms <= 0:
            # without a flush window, take a fair share: a worker that grabbed the only three
            # queued calls would run them one after another while another worker sits idle
            limit = min(limit, -(-(len(self.queue) + 1) // max(1, len(self.workers))))
        while len(batch) < limit:
            if self.queue:
                batch.append(self.queue.popleft())
                continue
            left = deadline - clock()
            if left <= 0:
                break
            self.nonempty.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.nonempty.wait(), left)
        self._queue_depth.set(len(self.queue))
        return batch

    def _protected_pids(self) -> list[int]:
        """What no call may signal: this process and its threads, and every worker and zygote."""
        pids = {os.getpid()}
        with contextlib.suppress(OSError):
            pids |= {int(t) for t in os.listdir("/proc/self/task")}
        for w in self.workers:
            pids |= {p for p in (w.pid, w.proc.pid if w.proc else None, *getattr(w, "zygote_pids", ())) if p}
        return sorted(pids)

    async def _work_or_death(self, w: WorkerProc) -> bool:
        """Wait until calls are queued (True) or ``w`` dies while idle (False). Idle, the worker
        waits on its own future, which ``_wake`` resolves for one queued call."""
        while not self.queue:
            if w.proc is None or w.proc.returncode is not None:
                if self.queue:
                    self._wake(1)  # it may have been woken for a call: hand the call on
                return False
            wake = asyncio.get_running_loop().create_future()
            self._idle.append(wake)
            death = asyncio.ensure_future(w.proc.wait())
            try:
                await asyncio.wait({wake, death}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                death.cancel()
                wake.cancel()  # no-op once woken; else _wake skips it
        return True

    async def _worker_loop(self, w: WorkerProc) -> None:
        while True:
            if not await self._work_or_death(w):
                await self._replace(w, WorkerLost("sandbox worker died while idle", blame=False))
                continue
            batch = await self._take_batch()
            self.busy += 1
            self._workers_busy.set(self.busy)
            try:
                lost = await self._dispatch(w, batch)
            finally:
                self.busy -= 1
                self._workers_busy.set(self.busy)
            if lost is not None:
                await self._replace(w, lost)

    async def _dispatch(self, w: WorkerProc, batch: list[_Call]) -> Exception | None:
        """Run ``batch`` on ``w``; every call of it is answered or requeued, whatever happens."""
        answered = 0
        try:
            async for raw in w.run([c.payload for c in batch], self._protected_pids()):
                self._finish(batch[answered], raw)
                answered += 1
            return None
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a dead worker, or a bug: never strand the batch
            blame = err.blame if isinstance(err, WorkerLost) else True
            self._worker_lost(batch[answered:], err, blame)
            return err

    def _worker_lost(self, pending: list[_Call], err: Exception, blame: bool) -> None:
        """The call that was running is answered with an error (it may have killed the worker;
        running it again could kill the next one); those behind it run once more elsewhere."""
        retry = []
        for i, call in enumerate(pending):
            if call.future.done():
                continue
            if i == 0 and blame:
                self._finish(call, _failure(f"the sandbox worker died running this call: {err}"))
            elif call.retried:
                self._finish(call, _failure(f"the sandbox worker died twice before this call ran: {err}"))
            else:
                call.retried = True
                retry.append(call)
        self.queue.extendleft(reversed(retry))
        if retry:
            self._wake(len(retry))
        self._queue_depth.set(len(self.queue))

    async def _replace(self, w: WorkerProc, err: Exception) -> None:
        """Kill ``w``, sweep what its calls left, start a new one; back off while that fails."""
        log.warning("sandbox worker %d lost (%s); replacing it", w.slot, err)
        self.restarts += 1
        delay = 0.5
        while True:
            await w.stop(grace=1.0)
            await self.sweep_orphans()
            try:
                await w.start(self._spawn_lock)
                return
            except Exception as start_err:  # noqa: BLE001 - keep trying; /readyz says 503 meanwhile
                log.error(
                    "sandbox worker %d failed to start (%s); retrying in %.1f s", w.slot, start_err, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def sweep_orphans(self) -> int:
        """Kill our children that are not workers: a dead worker's calls (setsid daemons
        included) are reparented to us, the subreaper."""
        if not self.cfg.sweep_orphans:
            return 0
        async with self._spawn_lock:
            keep = frozenset(
                w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None
            )
            killed = kill_children(keep)
        if killed:
            log.warning("killed %d processes a lost sandbox worker left behind", killed)
        return killed

    def _finish(self, call: _Call, raw: dict[str, Any]) -> None:
        if call.payload["op"] == "exec":
            result = build_result(raw, float(call.payload["timeout"]))
            value: Any = result.to_json()
            elapsed = asyncio.get_running_loop().time() - call.submitted  # the loop's clock (simulations)
            metrics = self._by_outcome.get(result.outcome)
            if metrics is None:
                metrics = self._by_outcome[result.outcome] = (
                    TOOL_LATENCY.labels(self.cfg.pool, result.outcome),
                    TOOL_CALLS.labels(self.cfg.pool, result.outcome),
                )
            metrics[0].observe(elapsed)
            metrics[1].inc()
            self.window.add_exec(result.outcome, elapsed)
        else:
            meta = raw.get("meta") or {}
            timed_out = bool(raw.get("timed_out"))
            correct = bool(meta.get("correct", False)) and not timed_out
            value = {"correct": correct, "timed_out": timed_out}
            if timed_out:
                outcome = "timeout"
            elif meta.get("status") != "ok":
                outcome = "error"
            else:
                outcome = "correct" if correct else "wrong"
            VERIFY_CALLS.labels(self.cfg.pool, outcome).inc()
            self.window.add_verify(outcome)
        self.inflight.pop(call.key, None)
        self.answered += 1
        self.memory.remember(call.key, call.digest, value, answer_size(value))
        if not call.future.done():
            call.future.set_result(value)


def _fast_verify(payload: dict[str, Any]) -> bool | None:
    """Integer answers without a worker; any surprise just sends the pair to math-verify."""
    try:
        return integer_fast_path(payload["prediction"], payload["gold"])
    except Exception:  # noqa: BLE001 - one odd pair must not fail its batch
        log.exception("integer fast path failed; using math-verify")
        return None
