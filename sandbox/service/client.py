"""Async client of the sandbox service; retries with idempotency ids (never drops/duplicates)."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from kuberl.sandbox.service.auth import auth_headers, token_from_env
from kuberl.sandbox.types import ExecResult

_RETRY_STATUS = {429, 502, 503, 504}
CHUNK = 256


class SandboxError(RuntimeError):
    """The service could not answer a call within the client's retry budget."""


def wait_ready(base_url: str, timeout: float = 600.0, say: Callable[[str], None] = lambda _: None,
               interval: float = 1.0) -> float:
    """Block until ``base_url``'s /readyz answers 200; the seconds waited. A trainer pod may start
    before its pool's pods are Ready (they warm their workers first): its first calls would meet
    a Service without endpoints. SandboxError naming the URL after ``timeout``."""
    t0 = time.monotonic()
    told = False
    last = ""
    while True:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/readyz", timeout=5) as resp:  # noqa: S310
                if resp.status == 200:
                    return time.monotonic() - t0
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code}"
        except (OSError, ValueError) as err:
            last = str(getattr(err, "reason", err))
        waited = time.monotonic() - t0
        if waited > timeout:
            raise SandboxError(f"the sandbox service at {base_url} was not ready after {timeout:.0f} s "
                               f"(/readyz: {last}): is its pool running and its Service selecting Ready pods?")
        if not told:
            say(f"waiting for the sandbox service at {base_url} to be ready (/readyz: {last})")
            told = True
        time.sleep(interval)


class _Busy(Exception):
    """A multi-call request met a full queue: split it so it fits instead of waiting for room."""


class SandboxClient:
    """``execute``/``verify`` against one service; each call carries a fresh id reused on retry.

    Backpressure answers (429/503) and refused connections (the call never left) are retried
    without consuming ``retries`` until ``request_timeout`` has passed; other transport errors
    consume ``retries``. Because the server
    remembers results by id, a retry after a lost response gets the original result instead
    of running the code twice. That memory is per pod: ``base_url`` should name one service
    process (or a Service whose retries may land on another pod, which then runs the call
    again; the answer is still delivered once). A 409 (an id reused for a different call) is
    a bug of the caller and raised, not retried.
    """

    def __init__(
        self,
        base_url: str,
        *,
        retries: int = 5,
        request_timeout: float = 60.0,
        token: str | None = None,
    ) -> None:
        """``token``: the pool's bearer token; by default ``$KUBERL_SANDBOX_TOKEN`` (what the
        operator gives trainer pods), none when unset."""
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else token_from_env()
        self.retries = retries
        self.request_timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64), headers=auth_headers(self.token)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any], budget: float, splittable: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        failures = 0
        delay = 0.05
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - loop.time()))
                async with self._sess().post(self.base_url + path, json=body, timeout=timeout) as resp:
                    if resp.status == 200:
                        return await resp.json()
                    text = await resp.text()
                    if resp.status not in _RETRY_STATUS:
                        raise SandboxError(f"sandbox {path} answered {resp.status}: {text}")
                    if resp.status == 429 and splittable:
                        raise _Busy
                    wait = float(resp.headers.get("Retry-After", delay))
            except aiohttp.ClientConnectorError:
                # the connection was never made, so the call was never sent: a pod that is going
                # (its port closed before the Service stops choosing it) costs a retry within the
                # deadline, not one of ``retries``
                wait = delay
            except (TimeoutError, aiohttp.ClientError) as err:
                failures += 1
                if failures > self.retries:
                    raise SandboxError(f"sandbox {path} failed after {failures} attempts: {err}") from err
                wait = delay
            if loop.time() + wait > deadline:
                raise SandboxError(f"sandbox {path}: no answer within {budget:.0f} s")
            await asyncio.sleep(wait)
            delay = min(delay * 2, 1.0)

    async def execute(self, code: str, stdin: str = "") -> ExecResult:
        body = {"id": uuid.uuid4().hex, "code": code, "stdin": stdin}
        return ExecResult.from_json(await self._post("/v1/execute", body, self.request_timeout))

    async def execute_batch(self, calls: list[tuple[str, str]]) -> list[ExecResult]:
        """Results in call order; sent in chunks so large batches fit the server's queue."""
        items = [{"id": uuid.uuid4().hex, "code": c, "stdin": s} for c, s in calls]
        raw = await self._batch("/v1/execute_batch", "calls", "results", items)
        return [ExecResult.from_json(r) for r in raw]

    async def _batch(self, path: str, key: str, out: str, items: list[dict[str, Any]]) -> list[Any]:
        """Post ``items`` in chunks; a chunk meeting a full queue is halved (ids kept, so a
        half that was in fact admitted earlier is answered from the server's memory)."""
        budget = self.request_timeout * max(1, len(items) // CHUNK + 1)

        async def chunk(part: list[dict[str, Any]]) -> list[Any]:
            try:
                data = await self._post(path, {key: part}, budget, splittable=len(part) > 1)
            except _Busy:
                await asyncio.sleep(0.01)
                mid = len(part) // 2
                left, right = await asyncio.gather(chunk(part[:mid]), chunk(part[mid:]))
                return left + right
            return list(data[out])

        parts = await asyncio.gather(*(chunk(items[i : i + CHUNK]) for i in range(0, len(items), CHUNK)))
        return [r for part in parts for r in part]

    async def verify(self, prediction: str, gold: str) -> bool:
        body = {"id": uuid.uuid4().hex, "prediction": prediction, "gold": gold}
        return bool((await self._post("/v1/verify", body, self.request_timeout))["correct"])

    async def verify_batch(self, pairs: list[tuple[str, str]]) -> list[bool]:
        items = [{"id": uuid.uuid4().hex, "prediction": p, "gold": g} for p, g in pairs]
        return [bool(x) for x in await self._batch("/v1/verify_batch", "pairs", "correct", items)]
