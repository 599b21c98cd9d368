"""Result type of one sandboxed Python tool call (rStar2-Agent section 3.1 outcomes)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Outcome = Literal["stdout", "no_stdout", "error", "timeout", "memory_limit"]
OUTCOMES: tuple[str, ...] = ("stdout", "no_stdout", "error", "timeout", "memory_limit")
TRUNCATED_MARKER = "[output truncated]"
_SURROGATES = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` as valid UTF-8 (pure): lone surrogates (from bytes a call decoded with
    ``surrogateescape``) become U+FFFD instead of breaking the JSON a client parses."""
    return _SURROGATES.sub("\ufffd", text)


@dataclass(frozen=True)
class ExecResult:
    """What one execution produced; ``to_tool_response`` is the text the policy sees.

    ``output`` is stdout for ``stdout``, the repr of the last expression for ``no_stdout``
    (empty when it was None), the traceback for ``error`` and a one-line explanation for
    ``timeout``/``memory_limit``.
    """

    outcome: Outcome
    output: str
    truncated: bool
    duration_s: float

    @property
    def is_error(self) -> bool:
        return self.outcome in ("error", "timeout", "memory_limit")

    def to_tool_response(self) -> str:
        text = self.output
        if self.truncated:
            text = f"{text.rstrip()}\n{TRUNCATED_MARKER}"
        return text

    def to_json(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies field by field (the server answers every call)
        return {
            "outcome": self.outcome,
            "output": self.output,
            "truncated": self.truncated,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExecResult:
        outcome = data.get("outcome")
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown sandbox outcome {outcome!r}; expected one of {OUTCOMES}")
        return cls(
            outcome=outcome,
            output=str(data.get("output", "")),
            truncated=bool(data.get("truncated", False)),
            duration_s=float(data.get("duration_s", 0.0)),
        )
