"""Sandbox pods and the Service in front of them, for the virtual-time simulation.

A pod is the real ``SandboxService`` (central bounded queue, batching, idempotency, 429 when
full, 503 while stopping) behind the real aiohttp handlers of ``make_app``; only its workers
are models: a call occupies one worker (one core) for its modelled duration, read from the
call's code (``workload.encode_call``). The ``Service`` stands in for the aiohttp session of
a ``SandboxClient``: each request goes to a random ready pod (kube-proxy's iptables mode),
after half a round trip, and comes back after the other half. No socket is opened.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from typing import Any

import aiohttp
import numpy as np

from kuberl.sandbox.config import ServiceConfig
from kuberl.sandbox.service.app import make_app
from kuberl.sandbox.service.server import SandboxService as _RealService
from kuberl.sandbox.service.workers import WorkerProc

from .workload import decode_cost

_PIDS = itertools.count(1_000_000)


class _ModelProcess:
    """What the service reads of a worker's process: alive until stopped, never exits."""

    def __init__(self) -> None:
        self.pid = next(_PIDS)
        self.returncode: int | None = None

    async def wait(self) -> int:
        await asyncio.get_running_loop().create_future()  # a fresh one: the caller cancels it
        return 0


class ModelWorker(WorkerProc):
    """A worker whose calls take their modelled time on one core."""

    async def start(self, spawn_lock: asyncio.Lock | None = None) -> None:
        self.proc = _ModelProcess()  # type: ignore[assignment]
        self.pid = self.proc.pid
        self.up = True

    async def run(self, calls: list[dict[str, Any]], protect: list[int]):
        for call in calls:
            timeout = float(call["timeout"])
            cost = decode_cost(call["code"])
            await asyncio.sleep(min(cost, timeout))
            if cost >= timeout:
                yield {"timed_out": True, "duration_s": timeout, "meta": {}}
            else:
                yield {"meta": {"status": "ok"}, "stdout": "ok\n", "duration_s": cost}

    async def stop(self, grace: float = 3.0) -> None:
        self.up = False
        if self.proc is not None:
            self.proc.returncode = 0  # type: ignore[misc]


class ModelService(_RealService):
    """The real service with model workers, and no /proc read per batch (no real children)."""

    worker_class = ModelWorker

    def _protected_pids(self) -> list[int]:
        return []


class SandboxPod:
    """One pod: created now, ready (in the Service's endpoints) after its start-up delay."""

    def __init__(self, name: str, cfg: ServiceConfig, created: float) -> None:
        self.name = name
        self.created = created
        self.ready = False
        self.stopped = False
        self.svc = ModelService(cfg)
        app = make_app(self.svc)
        self._handlers = {r.resource.canonical: r.handler for r in app.router.routes() if r.method == "POST"}

    @property
    def cores(self) -> int:
        return self.svc.cfg.workers

    async def start(self) -> None:
        await self.svc.start()
        self.ready = not self.stopped

    async def stop(self) -> None:
        """SIGTERM: the server stops at once; calls in flight are answered 503 (the client retries)."""
        self.stopped, self.ready = True, False
        if self.svc.tasks:
            await self.svc.stop()

    async def handle(self, path: str, body: dict[str, Any]) -> tuple[int, str, dict[str, str]]:
        resp = await self._handlers[path](_Request(body))
        return resp.status, resp.text, dict(resp.headers)

    def metrics_text(self) -> str:
        """The two gauges the operator scrapes from a pod's /metrics (Prometheus text)."""
        label = f'{{pool="{self.svc.cfg.pool}"}}'
        return (
            f"kuberl_sandbox_queue_depth{label} {len(self.svc.queue)}\n"
            f"kuberl_sandbox_workers_busy{label} {self.svc.busy}\n"
        )


class _Request:
    """What the service's handlers read of an aiohttp request: its length and its body."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._raw = json.dumps(body).encode()
        self.content_length = len(self._raw)

    async def read(self) -> bytes:
        return self._raw


class _Response:
    def __init__(self, status: int, text: str, headers: dict[str, str]) -> None:
        self.status, self._text, self.headers = status, text, headers

    async def json(self) -> Any:
        return json.loads(self._text)

    async def text(self) -> str:
        return self._text


class _Exchange:
    def __init__(self, service: Service, path: str, body: dict[str, Any]) -> None:
        self.service, self.path, self.body = service, path, body

    async def __aenter__(self) -> _Response:
        svc = self.service
        await asyncio.sleep(svc.rtt_s / 2)
        ready = [p for p in svc.endpoints if p.ready]
        svc.attempts += 1
        if not ready:
            svc.statuses["no-endpoint"] += 1
            raise aiohttp.ClientConnectionError("no ready sandbox pod behind the Service")
        pod = ready[int(svc.rng.integers(len(ready)))]
        status, text, headers = await pod.handle(self.path, self.body)
        svc.statuses[str(status)] += 1
        await asyncio.sleep(svc.rtt_s / 2)
        return _Response(status, text, headers)

    async def __aexit__(self, *exc: object) -> None:
        return None


class Service:
    """The pool's Service, in the place of a ``SandboxClient``'s aiohttp session."""

    closed = False

    def __init__(self, rng: np.random.Generator, rtt_s: float = 0.001) -> None:
        self.rng = rng
        self.rtt_s = rtt_s
        self.endpoints: list[SandboxPod] = []
        self.attempts = 0
        self.statuses: Counter[str] = Counter()

    def post(self, url: str, json: dict[str, Any], timeout: object = None) -> _Exchange:
        return _Exchange(self, "/" + url.split("/", 3)[3], json)

    async def close(self) -> None:
        return None
