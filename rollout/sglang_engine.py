"""Async HTTP client for a real SGLang server (one RolloutFleet replica).

Wire shapes (SGLang native API):

* ``POST /generate`` ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature",
  "top_p", "stop_token_ids"}, "return_logprob": true, "rid": ...}`` ->
  ``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [[logprob, token_id, text|null], ...], ...}}``.
  The ``output_token_logprobs`` triples are the authoritative record of what was sampled
  (they include the matched stop token); ``output_ids`` is checked against them.
* ``GET /server_info`` (older servers: ``/get_server_info``) -> ``max_total_num_tokens`` at the
  top level, or inside ``internal_states[0]``.
* ``GET /metrics`` (Prometheus text, server started with ``--enable-metrics``) ->
  ``sglang:token_usage``, ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``; label sets vary
  between versions, so samples are aggregated over all labels (max for usage, sum for counts).
* ``POST /update_weights_from_disk`` ``{"model_path": ...}`` -> ``{"success": bool, "message": str}``.
* ``GET /health`` -> 200 when healthy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kuberl.rollout.engine import Engine, EngineLoad, GenerateOutput, GenerateRequest

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """The server answered, but not with something the engine contract can use."""


def build_generate_payload(req: GenerateRequest) -> dict[str, Any]:
    """The /generate request body for one GenerateRequest (pure, for the contract tests)."""
    return {
        "rid": req.rid,
        "input_ids": list(req.input_ids),
        "sampling_params": {
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop_token_ids": list(req.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def parse_generate_response(body: dict[str, Any]) -> GenerateOutput:
    """GenerateOutput from a /generate response; SGLangError if the shape is not the contract."""
    if not isinstance(body, dict):
        raise SGLangError(f"/generate returned {type(body).__name__}, expected a JSON object")
    if isinstance(body.get("error"), dict | str):
        raise SGLangError(f"/generate error: {body['error']}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangError("/generate response has no meta_info object")
    finish = meta.get("finish_reason")
    ftype = finish.get("type") if isinstance(finish, dict) else finish
    if ftype not in _FINISH:
        raise SGLangError(f"/generate finish_reason {finish!r} is not stop/length/abort")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise SGLangError("/generate response lacks meta_info.output_token_logprobs (return_logprob)")
    try:
        lps = [float(t[0]) for t in triples]
        logprob_ids = [int(t[1]) for t in triples]
    except (TypeError, ValueError, IndexError) as err:
        raise SGLangError(f"malformed output_token_logprobs entry: {err}") from err
    ids = body.get("output_ids", logprob_ids)
    if not isinstance(ids, list) or ids != logprob_ids[: len(ids)]:
        raise SGLangError("output_ids disagree with the token ids of output_token_logprobs")
    # Some versions trim the matched stop token from output_ids; the logprob record keeps it.
    return GenerateOutput(logprob_ids, lps, _FINISH[ftype])  # type: ignore[arg-type]


def parse_max_total_tokens(info: dict[str, Any]) -> int:
    """max_total_num_tokens from /server_info (top level or internal_states[0])."""
    value = info.get("max_total_num_tokens")
    if value is None:
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            value = states[0].get("max_total_num_tokens")
    if not isinstance(value, int | float) or value <= 0:
        raise SGLangError("server_info has no positive max_total_num_tokens")
    return int(value)


def parse_metrics(text: str) -> EngineLoad:
    """EngineLoad from SGLang's Prometheus text (labels are ignored, samples aggregated)."""
    usage: list[float] = []
    running = queued = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:token_usage":
                usage.append(sample.value)
            elif sample.name == "sglang:num_running_reqs":
                running += sample.value
            elif sample.name == "sglang:num_queue_reqs":
                queued += sample.value
    if not usage:
        raise SGLangError("/metrics has no sglang:token_usage (start SGLang with --enable-metrics)")
    return EngineLoad(max(usage), int(running), int(queued))


class SGLangEngine(Engine):
    """One SGLang server. Connection errors and 5xx answers are retried with backoff."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        request_timeout: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        session: aiohttp.ClientSession | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"SGLang base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url.split("://", 1)[1]
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self._session = session
        self._own_session = session is None
        self._capacity: int | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._own_session = True
        return self._session

    async def _request(self, method: str, path: str, *, json: Any = None, want: str = "json") -> Any:
        session = await self._http()
        url = self.base_url + path
        for attempt in range(self.retries + 1):
            try:
                async with session.request(method, url, json=json) as resp:
                    if resp.status >= 500 and attempt < self.retries:
                        raise aiohttp.ClientResponseError(
                            resp.request_info, resp.history, status=resp.status, message=await resp.text()
                        )
                    if resp.status >= 400:
                        raise SGLangError(
                            f"{method} {url} -> HTTP {resp.status}: {(await resp.text())[:500]}"
                        )
                    return await (resp.json(content_type=None) if want == "json" else resp.text())
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientResponseError) as err:
                if attempt >= self.retries:
                    raise SGLangError(f"{method} {url} failed after {attempt + 1} attempts: {err!r}") from err
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        req.validate()
        body = await self._request("POST", "/generate", json=build_generate_payload(req))
        return parse_generate_response(body)

    async def max_total_tokens(self) -> int:
        if self._capacity is None:
            try:
                info = await self._request("GET", "/server_info")
            except SGLangError as err:
                if "HTTP 404" not in str(err):
                    raise
                info = await self._request("GET", "/get_server_info")
            self._capacity = parse_max_total_tokens(info)
        return self._capacity

    async def health(self) -> bool:
        session = await self._http()
        try:
            async with session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def load_metrics(self) -> EngineLoad:
        return parse_metrics(await self._request("GET", "/metrics", want="text"))

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Make the server load new weights (a checkpoint the trainer wrote to shared storage)."""
        body = await self._request("POST", "/update_weights_from_disk", json={"model_path": model_path})
        if not isinstance(body, dict) or not body.get("success"):
            message = body.get("message") if isinstance(body, dict) else body
            raise SGLangError(f"{self.name}: update_weights_from_disk({model_path!r}) failed: {message}")
        self._capacity = None  # a new model may come with a different KV budget

    async def close(self) -> None:
        if self._session is not None and self._own_session and not self._session.closed:
            await self._session.close()
