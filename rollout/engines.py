"""The HTTP engine client for a server kind: SGLang's or vLLM's wire format."""

from __future__ import annotations

from typing import Any

from kuberl.rollout.http_engine import ENGINE_KINDS, HTTPEngine
from kuberl.rollout.sglang_engine import SGLangEngine
from kuberl.rollout.vllm_engine import VLLMEngine

CLIENTS: dict[str, type[HTTPEngine]] = {"sglang": SGLangEngine, "vllm": VLLMEngine}


def make_engine(kind: str, base_url: str, **kwargs: Any) -> HTTPEngine:
    """The client for ``kind`` ("sglang" or "vllm") at ``base_url``."""
    if kind not in CLIENTS:
        raise ValueError(f"unknown engine type {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")
    return CLIENTS[kind](base_url, **kwargs)
