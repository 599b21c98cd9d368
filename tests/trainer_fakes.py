"""An in-process stand-in for the sandbox service (execute + verify) for fast trainer tests."""

from __future__ import annotations

import contextlib
import hashlib
import io
import traceback
from dataclasses import dataclass


@dataclass
class FakeResult:
    outcome: str
    output: str

    @property
    def is_error(self) -> bool:
        return self.outcome == "error"

    def to_tool_response(self) -> str:
        return self.output


class FakeSandbox:
    """exec() with captured stdout; verify = exact string match. Only for trusted test code."""

    def __init__(self) -> None:
        self.calls = 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def execute(self, code: str, stdin: str = "") -> FakeResult:
        self.calls += 1
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, "<stdin>", "exec"), {})  # noqa: S102 - test double
        except Exception:
            return FakeResult("error", traceback.format_exc(limit=0))
        out = buf.getvalue()
        return FakeResult("stdout" if out else "no_stdout", out)

    async def execute_batch(self, calls):
        return [await self.execute(c, s) for c, s in calls]

    async def verify(self, prediction: str, gold: str) -> bool:
        return prediction.strip() == gold.strip()

    async def verify_batch(self, pairs):
        return [await self.verify(p, g) for p, g in pairs]


class CoinVerifySandbox(FakeSandbox):
    """Verify = a fixed coin flip per predicted answer (a hash bit), whatever the gold answer.

    A barely trained policy almost never computes the right product, but it does write
    answers; with this verifier about half of them earn reward 1, deterministically, so GRPO
    groups have non-zero advantages and RL steps really update the model.
    """

    async def verify(self, prediction: str, gold: str) -> bool:
        return hashlib.sha256(prediction.strip().encode()).digest()[0] % 2 == 0
