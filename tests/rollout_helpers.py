"""Test doubles for the rollout tests: a byte tokenizer, scripted engine and fake tool executor."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kuberl.rollout.engine import Engine, EngineLoad, GenerateOutput, GenerateRequest
from kuberl.rollout.template import IM_END, SPECIAL_TOKENS


class ByteTokenizer:
    """Special tokens are single ids 0..10; every other UTF-8 byte b is id 11 + b."""

    OFFSET = len(SPECIAL_TOKENS)
    vocab_size = OFFSET + 256

    def __init__(self) -> None:
        self.special = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        self.eos_id = self.special[IM_END]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for tok, tid in self.special.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                ids.extend(self.OFFSET + b for b in text[i].encode())
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        names = list(self.special)
        for t in ids:
            if t < len(names):
                out.append(buf.decode(errors="replace"))
                buf.clear()
                out.append(names[t])
            elif self.OFFSET <= t < self.OFFSET + 256:
                buf.append(t - self.OFFSET)
            else:
                raise ValueError(f"token id {t} is outside the byte tokenizer's vocabulary")
        out.append(buf.decode(errors="replace"))
        return "".join(out)


class ScriptedEngine(Engine):
    """Answers turn k of every request with ``turns[k]`` (encoded), honouring max_new_tokens."""

    def __init__(self, tokenizer: ByteTokenizer, turns: list[str], name: str = "scripted", capacity=10**6):
        self.name = name
        self.tok = tokenizer
        self.turns = turns
        self.capacity = capacity
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        self.requests.append(req)
        await asyncio.sleep(0)
        text = self.turns[min(len(self.requests) - 1, len(self.turns) - 1)]
        ids = self.tok.encode(text)
        finish = "stop" if ids and ids[-1] in req.stop_token_ids else "length"
        if len(ids) > req.max_new_tokens:
            ids, finish = ids[: req.max_new_tokens], "length"
        return GenerateOutput(ids, [-0.5] * len(ids), finish)

    async def max_total_tokens(self) -> int:
        return self.capacity

    async def health(self) -> bool:
        return True

    async def load_metrics(self) -> EngineLoad:
        return EngineLoad(0.0, 0, 0)


@dataclass
class FakeResult:
    output: str
    is_error: bool = False

    def to_tool_response(self) -> str:
        return self.output


class FakeExecutor:
    """Evaluates nothing: echoes the code's length, or fails for code containing 'raise'."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.calls: list[tuple[str, str]] = []
        self.concurrent = 0
        self.max_concurrent = 0

    async def execute(self, code: str, stdin: str = "") -> FakeResult:
        self.calls.append((code, stdin))
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.concurrent -= 1
        if "raise" in code:
            return FakeResult("Traceback (most recent call last):\nValueError: boom", True)
        return FakeResult(f"len={len(code)}")


def single_torch_thread():
    """Generator body for a fixture: tiny models gain nothing from intra-op threads, and on a
    busy shared CPU OpenMP's spinning threads make each forward ~100x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
