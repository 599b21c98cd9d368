"""A log line every S seconds from ``kuberl sandbox serve``: what the pool did in that window.

A sandbox pod's log otherwise shows only its start and its failures; whoever reads it during a
run (``kubectl logs``) wants to know whether calls arrive, how they end and how long they take,
without a Prometheus. :class:`Window` collects between two lines; :func:`format_window` is pure.
"""

from __future__ import annotations

import collections
import os

from kuberl.util.envvars import env_number

EVERY_SECONDS_ENV = "KUBERL_PROGRESS_EVERY_SECONDS"
DEFAULT_EVERY_SECONDS = 60.0


def every_seconds(env: dict[str, str] | None = None) -> float:
    """The interval ($KUBERL_PROGRESS_EVERY_SECONDS, default 60; 0 turns the lines off)."""
    try:
        return env_number(
            EVERY_SECONDS_ENV, DEFAULT_EVERY_SECONDS, dict(env if env is not None else os.environ)
        )
    except ValueError as err:
        raise SystemExit(str(err)) from None


class Window:
    """Outcomes and latencies of the calls answered since the last :meth:`take`."""

    def __init__(self) -> None:
        self.exec: collections.Counter[str] = collections.Counter()
        self.verify: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []

    def add_exec(self, outcome: str, seconds: float) -> None:
        self.exec[outcome] += 1
        self.latencies.append(seconds)

    def add_verify(self, outcome: str) -> None:
        self.verify[outcome] += 1

    def take(self) -> Window:
        taken = Window()
        taken.exec, taken.verify, taken.latencies = self.exec, self.verify, self.latencies
        self.exec, self.verify, self.latencies = collections.Counter(), collections.Counter(), []
        return taken


def _counts(c: collections.Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def format_window(
    w: Window, seconds: float, queue: int, busy: int, workers: int, restarts: int
) -> str | None:
    """One line for a window with calls in it (None for an idle one: no line to read)."""
    n_exec, n_verify = sum(w.exec.values()), sum(w.verify.values())
    if not n_exec and not n_verify:
        return None
    parts = [f"[kuberl sandbox] last {seconds:g}s: {n_exec} exec"]
    if n_exec:
        xs = sorted(w.latencies)
        p50, p95 = xs[round(0.5 * (len(xs) - 1))], xs[round(0.95 * (len(xs) - 1))]
        parts[0] += f" ({_counts(w.exec)}; latency p50 {p50:.3f}s p95 {p95:.3f}s)"
    parts.append(f"{n_verify} verify" + (f" ({_counts(w.verify)})" if n_verify else ""))
    parts.append(f"queue {queue}, {busy}/{workers} workers busy, {restarts} worker restarts")
    return "; ".join(parts)
