"""What every engine behind HTTP shares: retries within a time budget, error bodies, health.

:class:`HTTPEngine` is the base of :class:`~kuberl.rollout.sglang_engine.SGLangEngine` and
:class:`~kuberl.rollout.vllm_engine.VLLMEngine`; each adds its own wire format. Which engine a
URL is (``engine_kind``) is read off the server itself, so a fleet that names the wrong engine
fails at its first contact with an error that says so, not with a 404 in the middle of a step.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kuberl.rollout.engine import Engine, EngineLoad, GenerateOutput

log = logging.getLogger("kuberl.rollout.engine")

EngineKind = Literal["sglang", "vllm"]
ENGINE_KINDS: tuple[str, ...] = ("sglang", "vllm")


class EngineError(RuntimeError):
    """The server answered, but not with something the engine contract can use."""


class EngineHTTPError(EngineError):
    """The server answered with an HTTP error status; ``body`` is the (truncated) answer."""

    def __init__(self, message: str, status: int, body: str):
        super().__init__(message)
        self.status = status
        self.body = body


class EngineUnreachable(EngineError):
    """The server could not be reached within the request's attempts (connection refused or
    dropped): it is gone or going, as a replica removed from the fleet. The request can run on
    another engine; each engine raises its own subclass (``unreachable_type``)."""


class VersionMismatch(EngineError):
    """The server served weights other than those this client pushed (it restarted, or a push
    did not take): the answer must not be trained on. The client re-pushes its last weights."""


DEFAULT_LABEL = "default"  # the weight label SGLang and vLLM report before any versioned push


def served_version(labels: list[str], pushed: int | None) -> int | None:
    """The policy version that sampled an answer, from the server's weight labels (pure): the
    oldest label's, as staleness counts the oldest turn; None for the weights the server started
    with. Raises VersionMismatch where this client pushed ``pushed`` and the server answered with
    weights it never got from it: its start-up weights (it restarted) or a version ahead."""
    versions: list[int | None] = []
    for label in labels:
        if label == DEFAULT_LABEL:
            versions.append(None)
            continue
        try:
            versions.append(int(label))
        except ValueError:
            raise VersionMismatch(f"the server labels its weights {label!r}, not a policy version") from None
    if pushed is not None:
        bad = [lab for lab, v in zip(labels, versions, strict=True) if v is None or v > pushed]
        if bad:
            raise VersionMismatch(
                f"served weights {bad[0]!r} where version {pushed} was pushed (a restart loads the "
                "start-up weights; a push that did not take leaves the old)"
            )
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def error_message(body: str) -> str:
    """The server's own message out of an error body.

    SGLang answers ``{"message"}`` or ``{"error": {"message"}}``, vLLM ``{"error": {"message"}}``
    (OpenAI style), ``{"error": "..."}`` (its RL routes) or FastAPI's ``{"detail": ...}``.
    """
    try:
        doc = jsonlib.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(doc.get(key), str):
                return doc[key]
    return body


def request_id(rid: str, run: int, attempt: int) -> str:
    """The id of one send of request ``rid``: its own the first time; a retry (``attempt``) and
    the run after a re-push (``run`` 1) get ids of their own, as a server refuses an id it still
    runs."""
    base = rid if run == 0 else f"{rid}-again"
    return base if attempt == 0 else f"{base}-retry{attempt}"


MAX_RECONNECTS = 3  # per request: a request that brings its server down each time is not retried forever


class HTTPEngine(Engine):
    """An engine reached over HTTP at ``base_url``.

    Connection errors and 5xx answers are retried with backoff, all attempts together within
    ``request_timeout`` seconds. A generation that timed out is not retried (``retry_timeouts``):
    the server may still be running it, and a retry would double the load.

    ``reconnect_s`` > 0 is for a server that is restarted when it dies (a local run supervises
    its own): a request that finds it gone (connection refused or dropped) waits up to that
    long for ``/health`` to answer again, then is sent again, without spending an attempt.

    Versions the server vouches for: a generation's policy version is the weight label the
    server reports for it (:meth:`_vouched`), not this client's belief. An answer from weights
    this client never pushed (a restarted server's start-up weights, a version ahead) is
    dropped; the client re-pushes its last version (one re-push however many requests saw it,
    pushes serialized on one lock) and sends the request again, once; requests arriving
    meanwhile wait for the re-push. Subclasses send their wire format (``_push``, the labels of
    an answer, ``served_weight_version``).
    """

    shared = True  # a fleet's servers can serve other jobs too: their load counts
    kind: EngineKind
    error_type: type[EngineError] = EngineError
    http_error_type: type[EngineHTTPError] = EngineHTTPError
    unreachable_type: type[EngineUnreachable] = EngineUnreachable

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        request_timeout: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        reconnect_s: float = 0.0,
        session: aiohttp.ClientSession | None = None,
        partial_rollouts: bool = False,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{self.kind} base_url must start with http:// or https://, got {base_url!r}")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url.split("://", 1)[1]
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.reconnect_s = reconnect_s
        self.partial_rollouts = partial_rollouts  # what a push does to requests in flight (Engine)
        self.reconnects = 0  # times a request found the server gone and waited for it
        self.version_mismatches = 0  # answers from weights this client did not push
        self.repushes = 0  # pushes that put the last weights back after a mismatch
        self._pushed: tuple[str, int] | None = None  # (folder, version) of the last versioned push
        self._push_lock = asyncio.Lock()
        self._recovery: asyncio.Task[None] | None = None
        self._session = session
        self._own_session = session is None
        self.capacity_version = 0
        self.weight_version: int | None = None  # the policy version this client last pushed

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._own_session = True
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        body_for_attempt: Callable[[int], Any] | None = None,
        want: str = "json",
        retry_timeouts: bool = True,
        timeout: float | None = None,
    ) -> Any:
        session = await self._http()
        url = self.base_url + path
        loop = asyncio.get_running_loop()
        budget = self.request_timeout if timeout is None else timeout
        deadline = loop.time() + budget
        error_type, http_error_type = self.error_type, self.http_error_type
        attempt, sent, reconnected = -1, 0, 0
        while attempt < self.retries:
            attempt += 1
            remaining = deadline - loop.time()
            body = body_for_attempt(sent) if body_for_attempt is not None else json
            sent += 1  # every send gets its own body (a generation's retry its own request id)
            try:
                async with session.request(
                    method, url, json=body, timeout=aiohttp.ClientTimeout(total=remaining)
                ) as resp:
                    if resp.status >= 500 and attempt < self.retries:
                        raise aiohttp.ClientResponseError(
                            resp.request_info, resp.history, status=resp.status, message=await resp.text()
                        )
                    if resp.status >= 400:
                        text = (await resp.text())[:2000]
                        raise http_error_type(
                            f"{method} {url} -> HTTP {resp.status}: {error_message(text)[:500]}",
                            resp.status,
                            text,
                        )
                    return await (resp.json(content_type=None) if want == "json" else resp.text())
            except TimeoutError as err:  # includes aiohttp's ServerTimeoutError
                if not retry_timeouts or attempt >= self.retries:
                    raise error_type(
                        f"{method} {url} timed out (attempt {attempt + 1}, {budget:g} s budget)"
                    ) from err
                error: Exception = err
                failed_as: type[EngineError] = error_type
            except (aiohttp.ClientConnectionError, aiohttp.ClientResponseError) as err:
                gone = isinstance(err, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError))
                if gone and self.reconnect_s > 0 and reconnected < MAX_RECONNECTS:
                    waited = await self._wait_until_back()
                    if waited is not None:  # the outage counts neither as an attempt nor as time
                        deadline += waited
                        attempt -= 1
                        reconnected += 1
                        continue
                failed_as = self.unreachable_type if gone else error_type
                if attempt >= self.retries:
                    raise failed_as(f"{method} {url} failed after {attempt + 1} attempts: {err!r}") from err
                error = err
            pause = self.backoff_s * 2**attempt
            if loop.time() + pause >= deadline:
                raise failed_as(
                    f"{method} {url} failed and the {budget:g} s budget leaves no time to retry: {error!r}"
                ) from error
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    # -- weights: pushes, and the versions the server vouches for ---------------------------------

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Make the server serve the HF folder ``model_path`` (written by the trainer), labelled
        ``version``; pushes to one server never overlap."""
        self._check_weights(model_path, version)
        async with self._push_lock:
            previous = self.weight_version
            if version is not None:
                # before the push: answers from the new weights arrive while it ends
                self.weight_version = version
            try:
                await self._push(model_path, version)
            except BaseException:  # not served: answers still carry the version before it
                self.weight_version = previous
                raise
            if version is not None:
                self._pushed = (model_path, version)

    def _check_weights(self, model_path: str, version: int | None) -> None:
        """Refuse a folder before the server sees it (where this process can see it)."""

    async def _push(self, model_path: str, version: int | None) -> None:
        raise NotImplementedError

    async def served_weight_version(self) -> str | None:
        """The weight label the server reports serving now; None where it cannot say."""
        return None

    async def _vouched(self, send: Callable[[int], Awaitable[tuple[GenerateOutput, list[str] | None]]]) -> GenerateOutput:
        """``send(run)`` makes one request (run 0, then 1 after a re-push) and returns the answer
        with the server's weight labels for it (:meth:`_checked_version`)."""
        for run in (0, 1):
            if self._recovery is not None:  # requests wait for the re-push instead of running on it
                await asyncio.shield(self._recovery)
            out, labels = await send(run)
            try:
                out.weight_version = self._checked_version(labels)
                return out
            except VersionMismatch as err:
                if run:
                    raise VersionMismatch(f"{err}, again after re-pushing") from None
                log.warning("%s; re-pushing version %s", err, self.weight_version)
        raise AssertionError("unreachable")

    def _checked_version(self, labels: list[str] | None) -> int | None:
        """The version an answer with these weight labels came from (None labels: a server that
        reports none, whose answers carry the version this client last pushed). On a mismatch
        the re-push starts and VersionMismatch is raised."""
        if labels is None:
            return self.weight_version
        try:
            return served_version(labels, self.weight_version)
        except VersionMismatch as err:
            self.version_mismatches += 1
            self._start_recovery()
            raise VersionMismatch(f"{self.name}: {err}") from None

    def _start_recovery(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(self._recover())

    async def _recover(self) -> None:
        """Put this client's last pushed weights back on a server that lost them. A push that
        finished since the mismatch already put them right (the server says so, where it can)."""
        try:
            async with self._push_lock:
                if self._pushed is None:
                    return
                path, version = self._pushed
                if await self.served_weight_version() == str(version):
                    return
                log.warning("%s: serving other weights than version %s: re-pushing", self.name, version)
                self.weight_version = version
                await self._push(path, version)
                self.repushes += 1
        finally:
            self._recovery = None

    async def _wait_until_back(self) -> float | None:
        """Poll ``/health`` until the server answers (seconds waited) or ``reconnect_s`` runs
        out (None). Concurrent requests each poll; a restart is rare and the polls are cheap."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < self.reconnect_s:
            if await self.health():
                self.reconnects += 1
                return loop.time() - start
            await asyncio.sleep(1.0)
        return None

    async def health(self) -> bool:
        session = await self._http()
        try:
            async with session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def check_kind(self) -> None:
        """Raise EngineError naming both when the server at ``base_url`` is another engine."""
        found = await engine_kind(self.base_url, session=await self._http())
        if found is not None and found != self.kind:
            raise self.error_type(
                f"{self.base_url} is a {found} server but this engine is {self.kind}: set the fleet's "
                f"spec.engine.type (or the job's spec.rollout.engine) to {found}, or point it at a "
                f"{self.kind} server"
            )

    async def close(self) -> None:
        if self._session is not None and self._own_session and not self._session.closed:
            await self._session.close()


async def engine_kind(base_url: str, *, session: aiohttp.ClientSession | None = None) -> EngineKind | None:
    """Which engine serves ``base_url``: "sglang", "vllm", or None when neither answers as itself.

    Both list their model at ``/v1/models`` with ``owned_by`` set to their own name (vLLM in dev
    mode also serves ``/server_info``, so that route alone does not tell them apart); an SGLang
    server without that route is known by ``/get_server_info``.
    """
    own = session is None
    session = session or aiohttp.ClientSession()
    base = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        try:
            async with session.get(base + "/v1/models", timeout=timeout) as r:
                doc = await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        data = doc.get("data") if isinstance(doc, dict) else None
        owners = {m.get("owned_by") for m in data if isinstance(m, dict)} if isinstance(data, list) else set()
        for kind in ENGINE_KINDS:
            if kind in owners:
                return kind  # type: ignore[return-value]
        try:
            async with session.get(base + "/get_server_info", timeout=timeout) as r:
                return "sglang" if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None
    finally:
        if own:
            await session.close()


def load_from_metrics(
    text: str, usage: str, running: str, queued: str, missing: Callable[[], Exception]
) -> EngineLoad:
    """EngineLoad from a server's Prometheus text: the max of the ``usage`` gauge (KV-cache use
    in [0, 1]) and the sums of ``running``/``queued`` over all label sets; ``missing()`` is raised
    when the usage gauge is absent."""
    use: list[float] = []
    run = queue = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == usage:
                use.append(sample.value)
            elif sample.name == running:
                run += sample.value
            elif sample.name == queued:
                queue += sample.value
    if not use:
        raise missing()
    return EngineLoad(max(use), int(run), int(queue))
