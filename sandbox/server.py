"""HTTP/JSON sandbox service: central bounded queue, batching dispatch to warm fork-servers.

Every accepted call is answered exactly once: calls carry an idempotency id, results are
remembered (bounded LRU) and a retried id joins the in-flight future instead of running
again. A full queue answers 429 with Retry-After (backpressure, not unbounded memory).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.cgroups import remove_cgroup_dirs
from kuberl.sandbox.types import ExecResult

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

# Every call forks the ~100 MB preloaded worker; fork and exit cost scales with the number of
# anonymous pages mapped. glibc malloc on transparent huge pages (instead of pymalloc's 4 KiB
# pages) halves that cost where THP is "madvise" or "always" (bench/sandbox_throughput.py).
FORK_FRIENDLY_MALLOC = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}

_INT_RE = re.compile(r"^[+-]?\d+$")


@dataclass
class ServiceConfig:
    workers: int
    pool: str = "local"
    limits: SandboxLimits | None = None
    batch_size: int = 4
    flush_ms: float = 0.0
    queue_limit: int = 4096
    remember: int = 200_000
    verify_timeout_seconds: float = 5.0
    # "full": namespaces, slot uids and cgroups where this process may create them (root);
    # "basic": only what an unprivileged container allows (rlimits, setsid, seccomp, the
    # subreaper sweep) - what a SandboxPool pod running as non-root gets anyway.
    isolation: str = "full"
    # per-service block of slot uids (RLIMIT_NPROC and kill(-1) are per uid host-wide)
    uid_base: int = field(default_factory=lambda: 100_000 + secrets.randbelow(1_000_000) * 256)

    @property
    def lim(self) -> SandboxLimits:
        return self.limits or SandboxLimits()


def build_result(raw: dict[str, Any], timeout: float) -> ExecResult:
    """Map a worker's raw report to one of the five outcomes (pure; unit-tested)."""
    meta = raw.get("meta") or {}
    duration = float(raw.get("duration_s", 0.0))
    stdout = raw.get("stdout", "")
    truncated = bool(raw.get("stdout_truncated")) or bool(meta.get("truncated"))
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
        return int(p) == int(g)
    return None


class WorkerProc:
    """One fork-server subprocess (in its own net+PID namespace when possible)."""

    def __init__(self, slot: int, cfg: ServiceConfig) -> None:
        self.slot = slot
        self.cfg = cfg
        self.proc: asyncio.subprocess.Process | None = None
        self.protections: dict[str, bool] = {}
        self.leftovers: dict[str, Any] = {}

    async def start(self) -> None:
        lim = self.cfg.lim
        wcfg = {
            "slot": self.slot,
            "pool": re.sub(r"[^A-Za-z0-9_.-]", "_", self.cfg.pool),
            "timeout_seconds": lim.timeout_seconds,
            "memory_mb": lim.memory_mb,
            "max_output_bytes": lim.max_output_bytes,
            "max_processes": lim.max_processes,
        }
        ns = _namespace_prefix() if self.cfg.isolation == "full" else []
        wcfg["in_namespace"] = bool(ns)
        wcfg["isolation"] = self.cfg.isolation
        wcfg["uid_base"] = self.cfg.uid_base
        cmd = [sys.executable, "-m", "kuberl.sandbox.worker", json.dumps(wcfg)]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for key, value in FORK_FRIENDLY_MALLOC.items():
            env.setdefault(key, value)
        self.proc = await asyncio.create_subprocess_exec(
            *(ns + cmd), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sandbox worker {self.slot} failed to start")
        hello = json.loads(line)
        self.protections = dict(hello.get("protections", {}), namespaces=bool(ns))
        self.leftovers = hello.get("leftovers", {})

    async def run(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"calls": calls}).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError("sandbox worker died")
        return json.loads(line)["results"]

    async def stop(self, grace: float = 3.0) -> None:
        """Let the worker clean up (EOF on its protocol pipe), kill it after ``grace`` seconds,
        then remove what a killed worker could not: its slot cgroups and scratch directory."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(Exception):
                    proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
        if self.leftovers:
            await asyncio.to_thread(_remove_leftovers, self.leftovers)
            self.leftovers = {}


def _remove_leftovers(leftovers: dict[str, Any]) -> None:
    remove_cgroup_dirs(list(leftovers.get("cgroups", [])))
    path = leftovers.get("dir")
    if isinstance(path, str) and os.path.basename(path).startswith("kuberl-sbx-"):
        shutil.rmtree(path, ignore_errors=True)


_NS_CACHE: list[list[str]] = []


def _namespace_prefix() -> list[str]:
    """``unshare`` net+PID(+mount for /proc) prefix if it works here, else [] (reported)."""
    if _NS_CACHE:
        return _NS_CACHE[0]
    prefix: list[str] = []
    exe = shutil.which("unshare")
    if exe and os.geteuid() == 0:
        cand = [exe, "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
        import subprocess

        try:
            ok = subprocess.run([*cand, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            prefix = cand
    _NS_CACHE.append(prefix)
    return prefix


@dataclass
class _Call:
    id: str
    payload: dict[str, Any]
    future: asyncio.Future
    submitted: float


class SandboxService:
    """Queue, dispatch, idempotency and metrics; HTTP handlers are thin shells over it."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.queue: collections.deque[_Call] = collections.deque()
        self.nonempty = asyncio.Event()
        self.inflight: dict[str, asyncio.Future] = {}
        self.done: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.workers: list[WorkerProc] = []
        self.tasks: list[asyncio.Task] = []
        self.ready = False
        self.busy = 0

    async def start(self) -> None:
        self.workers = [WorkerProc(i, self.cfg) for i in range(self.cfg.workers)]
        await asyncio.gather(*(w.start() for w in self.workers))
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

    async def stop(self) -> None:
        self.ready = False
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def capacity_left(self) -> int:
        return self.cfg.queue_limit - len(self.queue)

    def submit(self, call_id: str, payload: dict[str, Any]) -> asyncio.Future:
        """Enqueue (or join/recall) one call; caller has checked capacity."""
        loop = asyncio.get_running_loop()
        if call_id in self.done:
            fut = loop.create_future()
            fut.set_result(self.done[call_id])
            return fut
        if call_id in self.inflight:
            return self.inflight[call_id]
        fut = loop.create_future()
        self.inflight[call_id] = fut
        self.queue.append(_Call(call_id, payload, fut, time.monotonic()))
        QUEUE_DEPTH.labels(self.cfg.pool).set(len(self.queue))
        self.nonempty.set()
        return fut

    def needs_slot(self, call_id: str) -> bool:
        return call_id not in self.done and call_id not in self.inflight

    async def _take_batch(self) -> list[_Call]:
        while not self.queue:
            self.nonempty.clear()
            await self.nonempty.wait()
        batch = [self.queue.popleft()]
        deadline = time.monotonic() + self.cfg.flush_ms / 1000
        limit = self.cfg.batch_size
        if self.cfg.flush_ms <= 0:
            # without a flush window, take a fair share: a worker that grabbed the only three
            # queued calls would run them one after another while another worker sits idle
            limit = min(limit, -(-(len(self.queue) + 1) // max(1, len(self.workers))))
        while len(batch) < limit:
            if self.queue:
                batch.append(self.queue.popleft())
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.nonempty.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.nonempty.wait(), left)
        QUEUE_DEPTH.labels(self.cfg.pool).set(len(self.queue))
        return batch

    async def _worker_loop(self, w: WorkerProc) -> None:
        while True:
            batch = await self._take_batch()
            self.busy += 1
            WORKERS_BUSY.labels(self.cfg.pool).set(self.busy)
            try:
                raws = await w.run([c.payload for c in batch])
            except Exception as err:  # noqa: BLE001 - worker died: answer, restart, go on
                log.warning("sandbox worker %d failed (%s); restarting", w.slot, err)
                raws = [
                    {
                        "meta": {
                            "status": "error",
                            "traceback": f"RuntimeError: sandbox worker failed: {err}\n",
                        }
                    }
                    for _ in batch
                ]
                await w.stop()
                await w.start()
            finally:
                self.busy -= 1
                WORKERS_BUSY.labels(self.cfg.pool).set(self.busy)
            for call, raw in zip(batch, raws, strict=True):
                self._finish(call, raw)

    def _finish(self, call: _Call, raw: dict[str, Any]) -> None:
        if call.payload["op"] == "exec":
            result: Any = build_result(raw, float(call.payload["timeout"]))
            outcome = result.outcome
            value: Any = result.to_json()
        else:
            meta = raw.get("meta") or {}
            value = bool(meta.get("correct", False))
            outcome = "verify_timeout" if raw.get("timed_out") else "verify"
        if call.payload["op"] == "exec":
            TOOL_LATENCY.labels(self.cfg.pool, outcome).observe(time.monotonic() - call.submitted)
            TOOL_CALLS.labels(self.cfg.pool, outcome).inc()
        self.inflight.pop(call.id, None)
        self.done[call.id] = value
        while len(self.done) > self.cfg.remember:
            self.done.popitem(last=False)
        if not call.future.done():
            call.future.set_result(value)


def _exec_payload(item: dict[str, Any], lim: SandboxLimits) -> dict[str, Any]:
    code = item.get("code")
    if not isinstance(code, str):
        raise web.HTTPBadRequest(text="each call needs a string 'code' field")
    stdin = item.get("stdin", "")
    if not isinstance(stdin, str):
        raise web.HTTPBadRequest(text="'stdin' must be a string")
    timeout = item.get("timeout", lim.timeout_seconds)
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise web.HTTPBadRequest(text="'timeout' must be a positive number of seconds")
    return {"op": "exec", "code": code, "stdin": stdin, "timeout": min(float(timeout), lim.timeout_seconds)}


def make_app(svc: SandboxService) -> web.Application:
    lim = svc.cfg.lim

    async def body(request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise web.HTTPBadRequest(text=f"request body is not JSON: {err}") from err

    def too_busy() -> web.Response:
        return web.json_response({"error": "queue full"}, status=429, headers={"Retry-After": "0.05"})

    async def run_many(items: list[tuple[str, dict[str, Any]]]) -> list[Any] | web.Response:
        if not svc.ready:
            return web.json_response({"error": "not ready"}, status=503, headers={"Retry-After": "1"})
        new = sum(1 for cid, _ in items if svc.needs_slot(cid))
        if new > svc.capacity_left():
            return too_busy()
        futs = []
        for cid, payload in items:
            if payload["op"] == "verify":
                fast = integer_fast_path(payload["prediction"], payload["gold"])
                if fast is not None:
                    f = asyncio.get_running_loop().create_future()
                    f.set_result(fast)
                    futs.append(f)
                    continue
            futs.append(svc.submit(cid, payload))
        return list(await asyncio.gather(*(asyncio.shield(f) for f in futs)))

    def call_id(item: dict[str, Any]) -> str:
        cid = item.get("id")
        return str(cid) if cid is not None else uuid.uuid4().hex

    async def execute(request: web.Request) -> web.StreamResponse:
        item = await body(request)
        if not isinstance(item, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        res = await run_many([(call_id(item), _exec_payload(item, lim))])
        return res if isinstance(res, web.Response) else web.json_response(res[0])

    async def execute_batch(request: web.Request) -> web.StreamResponse:
        data = await body(request)
        calls = data.get("calls") if isinstance(data, dict) else None
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise web.HTTPBadRequest(text="expected {'calls': [{'code': ..., 'stdin': ..., 'id': ...}, ...]}")
        res = await run_many([(call_id(c), _exec_payload(c, lim)) for c in calls])
        return res if isinstance(res, web.Response) else web.json_response({"results": res})

    def verify_payload(item: dict[str, Any]) -> dict[str, Any]:
        pred, gold = item.get("prediction"), item.get("gold")
        if not isinstance(pred, str) or not isinstance(gold, str):
            raise web.HTTPBadRequest(text="verify needs string 'prediction' and 'gold' fields")
        return {"op": "verify", "prediction": pred, "gold": gold, "timeout": svc.cfg.verify_timeout_seconds}

    async def verify(request: web.Request) -> web.StreamResponse:
        item = await body(request)
        if not isinstance(item, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        res = await run_many([(call_id(item), verify_payload(item))])
        return res if isinstance(res, web.Response) else web.json_response({"correct": res[0]})

    async def verify_batch(request: web.Request) -> web.StreamResponse:
        data = await body(request)
        pairs = data.get("pairs") if isinstance(data, dict) else None
        if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
            raise web.HTTPBadRequest(
                text="expected {'pairs': [{'prediction': ..., 'gold': ..., 'id': ...}, ...]}"
            )
        res = await run_many([(call_id(p), verify_payload(p)) for p in pairs])
        return res if isinstance(res, web.Response) else web.json_response({"correct": res})

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def readyz(_: web.Request) -> web.StreamResponse:
        status = 200 if svc.ready else 503
        uids = [svc.cfg.uid_base + w.slot for w in svc.workers] if svc.protections().get("uid") else []
        info = {
            "ready": svc.ready,
            "uids": uids,
            "workers": len(svc.workers),
            "worker_pids": [w.proc.pid for w in svc.workers if w.proc is not None],
            "isolation": svc.cfg.isolation,
            "pool": svc.cfg.pool,
            "protections": svc.protections(),
            "queue_depth": len(svc.queue),
        }
        return web.json_response(info, status=status)

    async def metrics(_: web.Request) -> web.StreamResponse:
        QUEUE_DEPTH.labels(svc.cfg.pool).set(len(svc.queue))
        WORKERS_BUSY.labels(svc.cfg.pool).set(svc.busy)
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=256 * 2**20)
    app.router.add_post("/v1/execute", execute)
    app.router.add_post("/v1/execute_batch", execute_batch)
    app.router.add_post("/v1/verify", verify)
    app.router.add_post("/v1/verify_batch", verify_batch)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def _serve(host: str, port: int, cfg: ServiceConfig) -> None:
    svc = SandboxService(cfg)
    QUEUE_DEPTH.labels(cfg.pool).set(0)
    WORKERS_BUSY.labels(cfg.pool).set(0)
    app = make_app(svc)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - port 0 -> the real port
    print(f"kuberl sandbox listening on http://{host}:{bound}", flush=True)
    try:
        await svc.start()
        print(f"kuberl sandbox ready; protections {json.dumps(svc.protections())}", flush=True)
        await asyncio.Event().wait()
    finally:
        await svc.stop()
        await runner.cleanup()


def serve(
    host: str,
    port: int,
    workers: int | None,
    pool: str,
    limits: SandboxLimits | None = None,
    batch_size: int = 4,
    flush_ms: float = 0.0,
    queue_limit: int = 4096,
    verify_timeout_seconds: float = 5.0,
    isolation: str = "full",
) -> int:
    """Run the service until SIGTERM/SIGINT (``kuberl sandbox serve``)."""
    import signal

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    n = workers if workers and workers > 0 else (os.cpu_count() or 1)
    cfg = ServiceConfig(
        workers=n,
        pool=pool,
        limits=limits,
        batch_size=max(1, batch_size),
        flush_ms=max(0.0, flush_ms),
        queue_limit=max(1, queue_limit),
        verify_timeout_seconds=verify_timeout_seconds,
        isolation=isolation,
    )
    loop = asyncio.new_event_loop()
    main = loop.create_task(_serve(host, port, cfg))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(main)
    loop.close()
    return 0
