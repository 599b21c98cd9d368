"""The sandbox's HTTP face and process entry point, split from ``server.py`` (the service):
``make_app`` (the aiohttp routes: /v1/execute, /v1/verify, /readyz, /healthz, /metrics, with
the pool's bearer token on /v1/*), and ``serve`` (`kuberl sandbox serve`: process-wide guards,
the service, a progress line per window).

The front is bounded so that no client can take the service's memory or connections: a body
over ``limits.maxRequestMB`` is refused with 413 from its Content-Length (or once that much has
arrived), code and stdin over ``maxCodeKB``/``maxStdinKB`` with 413 naming the field; a body
that does not arrive within ``body_timeout_s`` gets 408 and its connection closed, a connection
without a complete request head for ``idle_timeout_s`` is closed, and connections beyond
``max_connections`` are closed as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import uuid
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.config import ServiceConfig
from kuberl.sandbox.libc import LIBC
from kuberl.sandbox.service.auth import require_token, token_from_env
from kuberl.sandbox.service.idempotency import Conflict, Key, payload_digest
from kuberl.sandbox.service.progress import every_seconds, format_window
from kuberl.sandbox.service.server import (
    QUEUE_DEPTH,
    WORKERS_BUSY,
    SandboxService,
    ServiceUnavailable,
)

R = TypeVar("R", bound=web.StreamResponse)

# Deepest nesting of arrays and objects a request body may have. A call needs three levels
# ({"calls": [{...}]}); the bound keeps parsing, hashing and printing a body off the
# interpreter's recursion limit, which a few KB of "[[[[" reach.
MAX_JSON_DEPTH = 32


def _nested_deeper_than(doc: Any, limit: int) -> bool:
    """Whether ``doc`` nests arrays/objects more than ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in node if isinstance(child, dict | list))
    return False


def _parse_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400 that says what is wrong with it."""
    too_deep = f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels"
    try:
        doc = json.loads(raw)
    except RecursionError:  # the parser's own recursion ran out first
        raise web.HTTPBadRequest(text=too_deep) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {err}") from err
    if _nested_deeper_than(doc, MAX_JSON_DEPTH):
        raise web.HTTPBadRequest(text=too_deep)
    return doc


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_size(field: str, text: str, limit_kb: int, setting: str) -> None:
    """413 for a text over ``limit_kb`` KiB of UTF-8 (a str holds at most 4 bytes a character)."""
    limit = limit_kb * 1024
    if 4 * len(text) <= limit:  # fits however it encodes: no need to encode it
        return
    size = _utf8_size(text)
    if size > limit:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit,
            actual_size=size,
            text=f"'{field}' is {size} bytes, over the pool's limits.{setting} ({limit_kb} KiB)",
        )


def _exec_payload(item: dict[str, Any], lim: SandboxLimits) -> dict[str, Any]:
    code = item.get("code")
    if not isinstance(code, str):
        raise web.HTTPBadRequest(text="each call needs a string 'code' field")
    stdin = item.get("stdin", "")
    if not isinstance(stdin, str):
        raise web.HTTPBadRequest(text="'stdin' must be a string")
    _check_size("code", code, lim.max_code_kb, "maxCodeKB")
    _check_size("stdin", stdin, lim.max_stdin_kb, "maxStdinKB")
    timeout = item.get("timeout", lim.timeout_seconds)
    # JSON's NaN and Infinity parse as floats here, and true as an int: none is a deadline
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise web.HTTPBadRequest(text=f"'timeout' must be a positive number of seconds, not {timeout!r}")
    return {"op": "exec", "code": code, "stdin": stdin, "timeout": min(float(timeout), lim.timeout_seconds)}


def make_app(svc: SandboxService) -> web.Application:
    lim = svc.cfg.lim

    max_body = lim.max_request_mb * 2**20

    async def body(request: web.Request) -> Any:
        size = request.content_length
        if size is not None and size > max_body:  # refused before a byte of it is read
            raise _closing(web.HTTPRequestEntityTooLarge(
                max_size=max_body, actual_size=size,
                text=f"request body is {size} bytes, over the pool's limits.maxRequestMB ({lim.max_request_mb})",
            ))  # fmt: skip
        try:
            async with asyncio.timeout(svc.cfg.body_timeout_s):
                raw = await request.read()  # aiohttp stops at client_max_size (413) without a length
        except TimeoutError:
            # The body is given up on: marked ended, so aiohttp closes after the 408 instead of
            # lingering to read more from a client that sent nothing for body_timeout_s (a client
            # hanging up then left the lingering read pending forever, one log line each).
            request.content.feed_eof()
            raise _closing(
                web.HTTPRequestTimeout(text=f"request body not received within {svc.cfg.body_timeout_s:g} s")
            ) from None
        except ConnectionResetError:  # the client hung up mid-body: nobody to answer, nothing to log
            raise _closing(web.HTTPBadRequest(text="connection lost before the request body was whole")) from None
        return _parse_json(raw)

    # A busy or stopping pod closes the connection after its 429/503: the client's retry then
    # opens a new one, which the pool's Service balances afresh, instead of queueing again
    # behind this pod on a kept-alive connection while pods started since sit idle.
    def too_busy() -> web.Response:
        return _closing(web.json_response({"error": "queue full"}, status=429, headers={"Retry-After": "0.05"}))

    def unavailable(why: str) -> web.Response:
        return _closing(web.json_response({"error": why}, status=503, headers={"Retry-After": "1"}))

    async def run_many(items: list[tuple[Key, dict[str, Any]]]) -> list[Any] | web.Response:
        if not svc.ready:
            return unavailable("not ready")
        # check the whole request before admitting any of it: a conflict or a full queue
        # leaves nothing half-submitted
        conflicts: list[str] = []
        new: dict[Key, str] = {}  # keys this request would add to the queue, by digest
        digests = [payload_digest(payload) for _, payload in items]  # once: a hash of the JSON
        for (key, payload), digest in zip(items, digests, strict=True):
            try:
                state, _ = svc.lookup(key, payload, digest)
            except Conflict as err:
                conflicts.append(str(err))
                continue
            if state == "new" and new.setdefault(key, digest) != digest:
                conflicts.append(f"{key[0]} id {key[1]!r} appears twice in the request with different calls")
        if conflicts:
            body = {"error": "an idempotency id was reused for a different call", "conflicts": conflicts}
            return web.json_response(body, status=409)
        if len(new) > svc.capacity_left():
            return too_busy()
        futs = [
            svc.submit(key, payload, digest) for (key, payload), digest in zip(items, digests, strict=True)
        ]
        try:
            return list(await asyncio.gather(*(asyncio.shield(f) for f in futs)))
        except ServiceUnavailable as err:
            return unavailable(str(err))

    def call_key(op: str, item: dict[str, Any]) -> Key:
        cid = item.get("id")
        return (op, str(cid) if cid is not None else uuid.uuid4().hex)

    async def execute(request: web.Request) -> web.StreamResponse:
        item = await body(request)
        if not isinstance(item, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        res = await run_many([(call_key("exec", item), _exec_payload(item, lim))])
        return res if isinstance(res, web.Response) else web.json_response(res[0])

    async def execute_batch(request: web.Request) -> web.StreamResponse:
        data = await body(request)
        calls = data.get("calls") if isinstance(data, dict) else None
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise web.HTTPBadRequest(text="expected {'calls': [{'code': ..., 'stdin': ..., 'id': ...}, ...]}")
        res = await run_many([(call_key("exec", c), _exec_payload(c, lim)) for c in calls])
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
        res = await run_many([(call_key("verify", item), verify_payload(item))])
        return res if isinstance(res, web.Response) else web.json_response(res[0])

    async def verify_batch(request: web.Request) -> web.StreamResponse:
        data = await body(request)
        pairs = data.get("pairs") if isinstance(data, dict) else None
        if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
            raise web.HTTPBadRequest(
                text="expected {'pairs': [{'prediction': ..., 'gold': ..., 'id': ...}, ...]}"
            )
        res = await run_many([(call_key("verify", p), verify_payload(p)) for p in pairs])
        if isinstance(res, web.Response):
            return res
        return web.json_response(
            {"correct": [r["correct"] for r in res], "timed_out": [r["timed_out"] for r in res]}
        )

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def readyz(_: web.Request) -> web.StreamResponse:
        ready = svc.is_ready()  # not while a lost worker is being replaced
        uids = [svc.cfg.uid_base + w.slot for w in svc.workers] if svc.protections().get("uid") else []
        info = {
            "ready": ready,
            "uids": uids,
            "workers": len(svc.workers),
            "workers_up": svc.workers_up(),
            "server_pid": os.getpid(),
            "worker_restarts": svc.restarts,
            "worker_pids": [w.proc.pid for w in svc.workers if w.proc is not None],
            "isolation": svc.cfg.isolation,
            "pool": svc.cfg.pool,
            "protections": svc.protections(),
            "queue_depth": len(svc.queue),
        }
        return web.json_response(info, status=200 if ready else 503)

    async def metrics(_: web.Request) -> web.StreamResponse:
        QUEUE_DEPTH.labels(svc.cfg.pool).set(len(svc.queue))
        WORKERS_BUSY.labels(svc.cfg.pool).set(svc.busy)
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=max_body, middlewares=[require_token(svc.cfg.token)])
    app.router.add_post("/v1/execute", execute)
    app.router.add_post("/v1/execute_batch", execute_batch)
    app.router.add_post("/v1/verify", verify)
    app.router.add_post("/v1/verify_batch", verify_batch)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def _closing(response: R) -> R:
    """The response, and the connection closed after it (the rest of the request body unread)."""
    response.force_close()
    return response


class _Refused(asyncio.Protocol):
    """A connection beyond ``max_connections``: closed as it arrives."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()


class ConnectionCap:
    """A protocol factory for ``loop.create_server``: aiohttp's handler while fewer than ``cap``
    connections are open, else one that closes the connection at once.

    It counts connections itself, from the factory call to aiohttp's ``connection_lost``: the
    event loop accepts a burst of connections, calling the factory for each, before any of them
    is registered with the server."""

    def __init__(self, server: web.Server, cap: int):
        self.server, self.cap, self.open = server, cap, 0
        lost = server.connection_lost

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            self.open -= 1
            lost(handler, exc)

        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            return _Refused()
        self.open += 1
        return self.server()


def raise_open_files(need: int) -> int:
    """Raise this process's soft limit on open files toward ``need`` (at most the hard limit, as
    an unprivileged process may); returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


BACKLOG = 1024  # connections the kernel queues for accept(); a burst of them is accepted at once
# besides the connections: the workers' pipes, pidfds, cgroup and /proc files, and a burst of
# accepted connections beyond the cap, each holding a descriptor until it is closed
FILES_BESIDE_CONNECTIONS = 512 + BACKLOG


async def _serve(host: str, port: int, cfg: ServiceConfig) -> None:
    svc = SandboxService(cfg)
    QUEUE_DEPTH.labels(cfg.pool).set(0)
    WORKERS_BUSY.labels(cfg.pool).set(0)
    app = make_app(svc)
    # lingering_time: after an error answered before the body was read, what is still arriving is
    # read and dropped this long (so the client sees the answer, not a reset), then the connection goes
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=cfg.idle_timeout_s, lingering_time=1.0)
    await runner.setup()
    files = raise_open_files(cfg.max_connections + FILES_BESIDE_CONNECTIONS)
    cap = max(1, min(cfg.max_connections, files - FILES_BESIDE_CONNECTIONS))
    if cap < cfg.max_connections:
        logging.getLogger("kuberl.sandbox").warning(
            "open-file limit %d allows %d connections, not %d", files, cap, cfg.max_connections
        )
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(
        ConnectionCap(runner.server, cap), host, port, reuse_address=True, backlog=BACKLOG
    )
    bound = listener.sockets[0].getsockname()[1]
    print(f"kuberl sandbox listening on http://{host}:{bound}", flush=True)
    try:
        await svc.start()
        print(f"kuberl sandbox ready; protections {json.dumps(svc.protections())}", flush=True)
        await _log_progress(svc, every_seconds())
    finally:
        # SIGTERM (the pod is being deleted): no new connections, the queued calls back to their
        # clients (503), the running ones answered before the workers go; the kubelet's grace
        # (the call timeout + 5 s, rendered by the operator) covers one call's run
        listener.close()
        cut_off = await svc.drain(_drain_seconds(cfg))
        await svc.stop()
        print(f"kuberl sandbox stopped: {svc.answered} calls answered, {cut_off} cut off mid-run", flush=True)
        with contextlib.suppress(Exception):  # the connections still open end with the service
            await runner.server.shutdown(2.0)
        await runner.cleanup()


def _drain_seconds(cfg: ServiceConfig) -> float:
    """How long the running calls may take to finish at exit: one call's timeout, plus a second."""
    return float(cfg.lim.timeout_seconds) + 1.0


async def _log_progress(svc: SandboxService, every: float) -> None:
    """Print what the service did every ``every`` seconds while it runs (forever; 0: no lines)."""
    if every <= 0:
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(every)
        line = format_window(
            svc.window.take(), every, len(svc.queue), svc.busy, len(svc.workers), svc.restarts
        )
        if line is not None:
            print(line, flush=True)


_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36


def _guard_this_process(loop: asyncio.AbstractEventLoop) -> None:
    """Process-wide settings of the service (not of a library user's process).

    Subreaper: a dead worker's orphans come to us, not to init, so sweep_orphans can kill
    them. Not dumpable: a call under our uid cannot open /proc/<us>/mem or fd. A pidfd child
    watcher: asyncio's default one (Python < 3.12) runs a thread per worker, and every thread
    id is one more pid a call could SIGKILL the whole server through."""
    with contextlib.suppress(Exception):
        LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        with contextlib.suppress(OSError):
            os.close(os.pidfd_open(os.getpid()))
            watcher = asyncio.PidfdChildWatcher()
            watcher.attach_loop(loop)
            asyncio.set_child_watcher(watcher)


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
    pin_workers: bool = True,
    idle_timeout_s: float = 15.0,
    body_timeout_s: float = 10.0,
    max_connections: int = 4096,
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
        pin_workers=pin_workers,
        idle_timeout_s=idle_timeout_s,
        body_timeout_s=body_timeout_s,
        max_connections=max(1, max_connections),
        sweep_orphans=True,
        token=token_from_env(),
    )
    loop = asyncio.new_event_loop()
    _guard_this_process(loop)
    main = loop.create_task(_serve(host, port, cfg))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(main)
    loop.close()
    return 0
