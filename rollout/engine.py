"""The inference-engine interface the rollout loop and the scheduler talk to.

Two implementations: :class:`kuberl.rollout.local_engine.LocalEngine` (in-process torch model,
the embedded default and the test engine) and :class:`kuberl.rollout.sglang_engine.SGLangEngine`
(HTTP client for a real SGLang server). Everything is token ids in, token ids out: the loop
keeps the exact ids the policy sampled so the trainer scores precisely what was generated.
"""

from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


def _new_rid() -> str:
    return uuid.uuid4().hex


@dataclass
class GenerateRequest:
    """One generation call: continue ``input_ids`` by at most ``max_new_tokens`` tokens.

    ``temperature`` <= 0 means greedy (argmax). Generation stops after emitting any token of
    ``stop_token_ids``; that token is part of ``output_ids`` (the trainer must learn to emit it).
    """

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    rid: str = field(default_factory=_new_rid)

    def validate(self) -> None:
        """Raise ValueError with a clear message for requests no engine can serve."""
        if not self.input_ids:
            raise ValueError(f"request {self.rid}: input_ids must not be empty")
        if self.max_new_tokens < 0:
            raise ValueError(f"request {self.rid}: max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"request {self.rid}: top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"request {self.rid}: temperature must be >= 0, got {self.temperature}")


@dataclass
class GenerateOutput:
    """The sampled continuation.

    ``output_logprobs[i]`` is the log-probability of ``output_ids[i]`` under the policy's raw
    logits (temperature 1.0), which is what the GRPO importance ratio compares against.
    ``finish_reason`` is "stop" (a stop token was emitted), "length" (max_new_tokens or the
    engine's context length was reached) or "abort" (the engine dropped the request).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and output_logprobs "
                f"({len(self.output_logprobs)}) must have the same length"
            )


@dataclass(frozen=True)
class EngineLoad:
    """A point-in-time view of an engine's load (SGLang: sglang:token_usage and friends)."""

    kv_cache_utilization: float
    running: int
    queued: int


class Engine(abc.ABC):
    """An inference engine serving one policy replica.

    ``capacity_version`` changes whenever ``max_total_tokens`` may have changed (new weights can
    come with a different KV budget); the scheduler re-reads the capacity when it sees a new value.
    ``shared`` says the engine may also serve other clients (a fleet several jobs use), so its
    observed load, not only the scheduler's own reservations, limits what the scheduler admits.
    """

    name: str
    capacity_version: int = 0
    shared: bool = False

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Continue ``req.input_ids``; concurrent calls are batched by the engine."""

    @abc.abstractmethod
    async def max_total_tokens(self) -> int:
        """KV-cache capacity in tokens (SGLang's max_total_num_tokens); the scheduler's budget."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve requests."""

    @abc.abstractmethod
    async def load_metrics(self) -> EngineLoad:
        """Current KV-cache utilization and request counts."""

    async def close(self) -> None:  # noqa: B027 - optional hook, engines without resources keep it
        """Release resources (HTTP sessions, background tasks)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
