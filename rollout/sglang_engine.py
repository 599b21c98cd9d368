"""Async HTTP client for a real SGLang server (one RolloutFleet replica).

Wire shapes (SGLang native API, python/sglang/srt/entrypoints/http_server.py):

* ``POST /generate`` ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature",
  "top_p", "stop_token_ids"}, "return_logprob": true, "rid": ...}`` ->
  ``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [[logprob, token_id, text|null], ...], ...}}``.
  The ``output_token_logprobs`` triples are the authoritative record of what was sampled
  (they include the matched stop token); ``output_ids`` is checked against them.
  SGLang's tokenizer manager answers HTTP 400 ``{"error": {"message": ...}}`` when
  ``len(input_ids) >= context_len`` or ``len(input_ids) + max_new_tokens >= context_len``
  (unless started with --allow-auto-truncate), so the client clamps ``max_new_tokens`` to
  ``context_len - len(input_ids) - 1`` and answers a request with no room left itself
  (finish_reason "length", no tokens) instead of sending it.
* ``GET /get_server_info`` (very old servers: ``/server_info``) -> the server args merged with
  the scheduler's info: ``max_total_num_tokens`` at the top level (older: inside
  ``internal_states[0]``) and ``context_length`` (the --context-length argument, null when the
  model's own length applies).
* ``GET /v1/models`` -> ``{"data": [{"max_model_len": context_len, ...}]}``: the context length
  the server enforces, used when ``context_length`` is null.
* ``GET /metrics`` (Prometheus text, server started with ``--enable-metrics``) ->
  ``sglang:token_usage``, ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``; label sets vary
  between versions, so samples are aggregated over all labels (max for usage, sum for counts).
* ``POST /update_weights_from_disk`` ``{"model_path": ...}`` -> 200 ``{"success": true,
  "message": str, "num_paused_requests": int}``, or HTTP 400 with ``"success": false``.
* ``POST /generate`` ``{"input_ids", "sampling_params": {"max_new_tokens": 0}, "return_logprob":
  true, "logprob_start_len": s}`` -> ``meta_info.input_token_logprobs`` ``[[logprob, id, null],
  ...]`` for the tokens from ``s`` on (the first entry without a usable log-prob): scoring a
  sequence with the weights served now (the engine spot check).
* ``GET /health`` -> 200 when healthy.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kuberl.rollout.engine import EngineLoad, GenerateOutput, GenerateRequest, ScoreOutput, check_score_args
from kuberl.rollout.http_engine import (
    EngineError,
    EngineHTTPError,
    EngineUnreachable,
    HTTPEngine,
    error_message,
    load_from_metrics,
    request_id,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(EngineError):
    """The SGLang server answered, but not with something the engine contract can use."""


class SGLangUnreachable(EngineUnreachable, SGLangError):
    """The SGLang server could not be reached (gone or going)."""


class SGLangHTTPError(EngineHTTPError, SGLangError):
    """The SGLang server answered with an HTTP error status; ``body`` is the (truncated) answer."""


def build_generate_payload(req: GenerateRequest) -> dict[str, Any]:
    """The /generate request body for one GenerateRequest (pure, for the contract tests).

    A seeded request passes its seed as ``sampling_seed`` (SamplingParams since SGLang 0.5.3):
    a server started with ``--enable-deterministic-inference`` then samples the same tokens
    whatever the batch, as the LocalEngine does; other servers ignore it.
    """
    params: dict[str, Any] = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop_token_ids": list(req.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    return {
        "rid": req.rid,
        "input_ids": list(req.input_ids),
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def build_score_payload(input_ids: list[int], start: int, rid: str) -> dict[str, Any]:
    """The /generate body that scores ``input_ids[start:]`` without generating (pure).

    ``logprob_start_len: start - 1`` makes ``meta_info.input_token_logprobs`` begin one token
    early: SGLang's first entry has no usable log-prob (None at position 0), so the parser drops
    it, as slime and verl do when they score sequences on SGLang.
    """
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
        "rid": rid,
    }


def parse_score_response(body: Any, input_ids: list[int], start: int) -> list[float]:
    """log p(input_ids[i] | input_ids[:i]) for i >= start from ``input_token_logprobs``
    (``[[logprob, token_id, text|null], ...]`` from ``start - 1``), checked token by token."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    want = list(input_ids[start:])
    if not isinstance(triples, list) or len(triples) != len(want) + 1:
        raise SGLangError(
            f"/generate input_token_logprobs must hold {len(want) + 1} entries from logprob_start_len "
            f"{start - 1}, got {len(triples) if isinstance(triples, list) else None}"
        )
    try:
        got = [(t[0], int(t[1])) for t in triples[1:]]
    except (TypeError, ValueError, IndexError) as err:
        raise SGLangError(f"malformed input_token_logprobs entry: {err}") from err
    if [t for _, t in got] != want:
        raise SGLangError("input_token_logprobs are not aligned with the scored tokens")
    if any(not isinstance(lp, int | float) for lp, _ in got):
        raise SGLangError("input_token_logprobs hold a null log-prob inside the scored span")
    return [float(lp) for lp, _ in got]


def clamp_max_new_tokens(input_len: int, max_new_tokens: int, context_len: int) -> int:
    """The largest max_new_tokens SGLang accepts for ``input_len`` input tokens (may be <= 0).

    SGLang rejects ``input_len + max_new_tokens >= context_len``, so at most
    ``context_len - input_len - 1`` new tokens fit.
    """
    return min(max_new_tokens, context_len - input_len - 1)


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


def weight_labels(answer: Any) -> list[str] | None:
    """The weight label SGLang reports for an answer (``meta_info.weight_version``, SGLang >= 0.5:
    the ``weight_version`` of the last update, ``"default"`` before any), or None where it
    reports none."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    served = meta.get("weight_version") if isinstance(meta, dict) else None
    return None if served is None else [str(served)]


def _positive_int(value: Any) -> int | None:
    return (
        int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None
    )


def parse_max_total_tokens(info: dict[str, Any]) -> int:
    """max_total_num_tokens from /get_server_info (top level or internal_states[0])."""
    value = info.get("max_total_num_tokens")
    if value is None:
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            value = states[0].get("max_total_num_tokens")
    if _positive_int(value) is None:
        raise SGLangError("server_info has no positive max_total_num_tokens")
    return int(value)


def parse_context_length(info: dict[str, Any], models: dict[str, Any] | None = None) -> int | None:
    """The context length SGLang enforces: --context-length from /get_server_info when set,
    else ``max_model_len`` of the first model in /v1/models; None when neither says."""
    value = _positive_int(info.get("context_length"))
    if value is not None:
        return value
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return _positive_int(data[0].get("max_model_len"))
    return None


def parse_metrics(text: str) -> EngineLoad:
    """EngineLoad from SGLang's Prometheus text (labels are ignored, samples aggregated)."""
    return load_from_metrics(
        text,
        "sglang:token_usage",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        lambda: SGLangError("/metrics has no sglang:token_usage (start SGLang with --enable-metrics)"),
    )


class SGLangEngine(HTTPEngine):
    """One SGLang server.

    Connection errors and 5xx answers are retried with backoff, all attempts together within
    ``request_timeout`` seconds. A /generate that timed out is not retried: the server may still
    be running it, and a retry would double the load (and reuse its rid, which SGLang may reject
    while the first request lives); retries of /generate get a fresh rid.
    """

    kind = "sglang"
    error_type = SGLangError
    http_error_type = SGLangHTTPError
    unreachable_type = SGLangUnreachable

    def __init__(self, base_url: str, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self._capacity: int | None = None
        self._context_len: int | None = None

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        req.validate()
        room = clamp_max_new_tokens(len(req.input_ids), req.max_new_tokens, await self.context_length())
        if room <= 0:  # the context is full (or nothing was asked for): SGLang would answer 400
            return GenerateOutput([], [], "length")
        sent = dataclasses.replace(req, max_new_tokens=room)

        async def send(run: int) -> tuple[GenerateOutput, list[str] | None]:
            def body(attempt: int) -> dict[str, Any]:
                return build_generate_payload(dataclasses.replace(sent, rid=request_id(sent.rid, run, attempt)))

            answer = await self._request("POST", "/generate", body_for_attempt=body, retry_timeouts=False)
            return parse_generate_response(answer), weight_labels(answer)

        return await self._vouched(send)

    async def score(self, input_ids: list[int], start: int) -> ScoreOutput:
        check_score_args(input_ids, start)
        if len(input_ids) >= await self.context_length():
            raise ValueError(f"score: {len(input_ids)} tokens exceed the context length {self._context_len}")
        rid = f"score-{uuid.uuid4().hex}"

        def body(attempt: int) -> dict[str, Any]:  # scoring is idempotent: any retry is safe
            return build_score_payload(input_ids, start, f"{rid}-{attempt}")

        answer = await self._request("POST", "/generate", body_for_attempt=body)
        logprobs = parse_score_response(answer, input_ids, start)
        return ScoreOutput(logprobs, self._checked_version(weight_labels(answer)))

    async def _server_info(self) -> dict[str, Any]:
        try:
            info = await self._request("GET", "/get_server_info")
        except SGLangHTTPError as err:
            if err.status != 404:
                raise
            info = await self._request("GET", "/server_info")
        if not isinstance(info, dict):
            raise SGLangError(f"{self.name}: server info is {type(info).__name__}, expected a JSON object")
        return info

    async def _read_limits(self) -> None:
        info = await self._server_info()
        capacity = parse_max_total_tokens(info)
        context = parse_context_length(info)
        if context is None:
            context = parse_context_length(info, await self._request("GET", "/v1/models"))
        if context is None:
            raise SGLangError(
                f"{self.name}: neither /get_server_info context_length nor /v1/models max_model_len "
                "gives the context length"
            )
        self._capacity, self._context_len = capacity, context

    async def max_total_tokens(self) -> int:
        if self._capacity is None:
            await self._read_limits()
        assert self._capacity is not None
        return self._capacity

    async def context_length(self) -> int:
        """The longest sequence (input + output) the server accepts."""
        if self._context_len is None:
            await self._read_limits()
        assert self._context_len is not None
        return self._context_len

    async def load_metrics(self) -> EngineLoad:
        return parse_metrics(await self._request("GET", "/metrics", want="text"))

    async def _push(self, model_path: str, version: int | None) -> None:
        """Make the server load new weights (a checkpoint the trainer wrote to shared storage).

        ``version`` goes with the request (``weight_version``, which SGLang >= 0.5 echoes in
        every answer's ``meta_info``); the client's own label stands for servers that do not.
        """
        try:
            payload: dict[str, Any] = {"model_path": model_path}
            if version is not None:
                payload["weight_version"] = str(version)  # SGLang >= 0.5 reports it per request
            body = await self._request("POST", "/update_weights_from_disk", json=payload)
        except SGLangHTTPError as err:
            if err.status != 400:
                raise
            raise SGLangError(
                f"{self.name}: update_weights_from_disk({model_path!r}) failed: {error_message(err.body)}"
            ) from err
        if not isinstance(body, dict) or not body.get("success"):
            message = body.get("message") if isinstance(body, dict) else body
            raise SGLangError(f"{self.name}: update_weights_from_disk({model_path!r}) failed: {message}")
        # A new model may come with a different KV budget and context length: re-read both, and
        # tell the scheduler (capacity_version) to re-read its copy.
        self._capacity = self._context_len = None
        self.capacity_version += 1
