"""Tool-call outcomes and latency per training step, for metrics.jsonl and the run report.

The sandbox exports ``kuberl_tool_call_latency_seconds`` and ``kuberl_tool_calls_total`` to
Prometheus, but a local run has no Prometheus: without these figures in metrics.jsonl the run
report could not show the tool side at all. :class:`ToolTally` wraps the rollout worker's
executor and counts, between two :meth:`ToolTally.take` calls, every call's outcome and its
latency as the rollout saw it (submission to result, retries included).
"""

from __future__ import annotations

import time
from typing import Any

from kuberl.sandbox.types import OUTCOMES


def quantile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank quantile of an ascending list (non-empty)."""
    i = min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))
    return sorted_xs[i]


def summarize(outcomes: list[str], latencies: list[float]) -> dict[str, float]:
    """``tool_calls_<outcome>`` for every sandbox outcome, and latency p50/p95/max when any call ran."""
    out: dict[str, float] = {f"tool_calls_{o}": float(outcomes.count(o)) for o in OUTCOMES}
    if latencies:
        xs = sorted(latencies)
        out.update(
            tool_latency_p50=quantile(xs, 0.5), tool_latency_p95=quantile(xs, 0.95), tool_latency_max=xs[-1]
        )
    return out


class ToolTally:
    """A ToolExecutor proxy that records each ``execute``; everything else is passed through."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._outcomes: list[str] = []
        self._latencies: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def execute(self, code: str, stdin: str = "") -> Any:
        t0 = time.monotonic()
        result = await self._inner.execute(code, stdin)
        self._latencies.append(time.monotonic() - t0)
        outcome = getattr(result, "outcome", None)
        if outcome not in OUTCOMES:
            outcome = "error" if getattr(result, "is_error", False) else "stdout"
        self._outcomes.append(outcome)
        return result

    def take(self) -> dict[str, float]:
        """The figures since the last call, and start counting afresh."""
        outcomes, latencies = self._outcomes, self._latencies
        self._outcomes, self._latencies = [], []
        return summarize(outcomes, latencies)
