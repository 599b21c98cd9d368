"""Progress for logs: one plain line every N steps or S seconds, for stdout that is not a terminal.

A rich live view redraws in place, so in a file (``kuberl run ... > run.log``, ``kubectl logs``
of a trainer pod, CI) it shows nothing until the run ends. :class:`LogProgress` observes the
same step records and events as metrics.jsonl/events.jsonl (it is a :class:`MetricsSink`
listener) and writes lines a log reader can follow::

    [kuberl] rl 12/50 (run 312/350) reward 0.41 tool-err+ 0.08 clip 0.012/0.004 trunc 0.06 step 3.2s 1450 tok/s ETA 2m05s

Formatting is pure (:func:`format_step`, :func:`eta_seconds`); the class only decides when to
write. :func:`step_figures` is the one place a step's figures become text: the log line, the
live progress bar of ``kuberl run`` and ``kuberl status`` all show it. Every eval and event is written at once (they are rare and are what a reader looks for).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kuberl.trainer.step_record import StepRecord
from kuberl.util.envvars import env_number

PROGRESS_EVERY_STEPS_ENV = "KUBERL_PROGRESS_EVERY_STEPS"
PROGRESS_EVERY_SECONDS_ENV = "KUBERL_PROGRESS_EVERY_SECONDS"
PROGRESS_MODE_ENV = "KUBERL_PROGRESS"
DEFAULT_EVERY_STEPS = 10
DEFAULT_EVERY_SECONDS = 30.0


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _f(v: Any, fmt: str) -> str:
    x = _num(v)
    return "-" if x is None else format(x, fmt)


def duration(seconds: float | None) -> str:
    """``1h02m``, ``2m05s`` or ``40s``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def tokens_per_second(rec: StepRecord) -> float | None:
    """Rollout tokens generated per second of the step's wall time (RL steps that count them)."""
    tokens, secs = _num(rec.response_tokens), _num(rec.step_seconds)
    if tokens is None or not secs:
        return None
    return tokens / secs


def eta_seconds(
    stages: Sequence[tuple[str, str, int]], stage: str, stage_step: int, step_seconds: dict[str, float]
) -> float | None:
    """Seconds left in the run: the steps left in ``stage`` and the stages after it, each at the
    mean step time seen for its type (``sft``/``rl``), else at the current stage's.

    ``stages``: (name, type, steps) in run order; ``step_seconds``: mean step time by type.
    """
    names = [s[0] for s in stages]
    if stage not in names:
        return None
    i = names.index(stage)
    current = step_seconds.get(stages[i][1])
    if current is None:
        return None
    left = (stages[i][2] - stage_step) * current
    for _, kind, steps in stages[i + 1 :]:
        left += steps * step_seconds.get(kind, current)
    return left


def step_figures(rec: StepRecord) -> str:
    """A step's headline figures: SFT loss and token accuracy, or RL reward, tool errors in correct
    rollouts, clip fractions, truncation and response length."""
    if rec.type == "sft":
        return f"loss {_f(rec.loss, '.3f')} token-acc {_f(rec.token_acc, '.2f')}"
    return (
        f"reward {_f(rec.reward_mean, '.2f')} "
        f"tool-err+ {_f(rec.tool_error_ratio_positive, '.2f')} "
        f"clip {_f(rec.clip_low, '.3f')}/{_f(rec.clip_high, '.3f')} "
        f"trunc {_f(rec.response_clip_ratio, '.2f')} len {_f(rec.response_length, '.0f')}"
    )


def format_step(rec: StepRecord, stage_total: int, run_step: int, run_total: int, eta: float | None) -> str:
    """One line for a step record of metrics.jsonl (SFT or RL)."""
    head = f"[kuberl] {rec.stage} {rec.stage_step}/{stage_total} (run {run_step}/{run_total})"
    secs = f"step {_f(rec.step_seconds, '.1f')}s"
    tps = tokens_per_second(rec) if rec.type == "rl" else None
    rate = f" {tps:.0f} tok/s" if tps is not None else ""
    return f"{head} {step_figures(rec)} {secs}{rate} ETA {duration(eta)}"


def format_eval(rec: StepRecord) -> str:
    return (
        f"[kuberl] eval after {rec.label} (step {rec.step}): held-out accuracy "
        f"{_f(rec.accuracy, '.3f')} tool-err+ {_f(rec.tool_error_ratio_positive, '.2f')}"
    )


def format_event(rec: dict[str, Any]) -> str:
    where = f" (step {rec['step']})" if rec.get("step") is not None else ""
    return f"[kuberl] {rec.get('kind')}: {rec.get('text')}{where}"


def use_plain(stream: TextIO, env: dict[str, str] | None = None) -> bool:
    """Plain lines when the stream is not a terminal; ``KUBERL_PROGRESS=plain|rich`` forces one."""
    mode = (env if env is not None else os.environ).get(PROGRESS_MODE_ENV, "auto").strip().lower()
    if mode == "plain":
        return True
    if mode == "rich":
        return False
    if mode not in ("", "auto"):
        raise ValueError(f"{PROGRESS_MODE_ENV} must be auto, plain or rich (got {mode!r})")
    isatty = getattr(stream, "isatty", None)
    return not (isatty and isatty())


class LogProgress:
    """A sink listener that writes a line every ``every_steps`` steps or ``every_seconds`` seconds
    (whichever comes first; 0 turns that trigger off), and at each stage's first and last step."""

    def __init__(
        self,
        stages: Sequence[tuple[str, str, int]],
        stream: TextIO | None = None,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        env: dict[str, str] | None = None,
    ):
        env = dict(os.environ) if env is None else env
        self.stages = list(stages)
        self.totals = {name: steps for name, _, steps in self.stages}
        self.kinds = {name: kind for name, kind, _ in self.stages}
        self.run_total = sum(self.totals.values())
        self.stream = stream if stream is not None else sys.stdout
        self.every_steps = int(
            every_steps
            if every_steps is not None
            else env_number(PROGRESS_EVERY_STEPS_ENV, DEFAULT_EVERY_STEPS, env)
        )
        self.every_seconds = (
            every_seconds
            if every_seconds is not None
            else env_number(PROGRESS_EVERY_SECONDS_ENV, DEFAULT_EVERY_SECONDS, env)
        )
        self.clock = clock
        self._last_line = clock()
        self._seconds: dict[str, list[float]] = {}

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self._last_line = self.clock()

    def _due(self, stage_step: int, total: int) -> bool:
        if stage_step in (1, total):
            return True
        if self.every_steps and stage_step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and self.clock() - self._last_line >= self.every_seconds

    def step(self, rec: StepRecord) -> None:
        kind = rec.type
        if kind == "eval":
            self._write(format_eval(rec))
            return
        secs = _num(rec.step_seconds)
        if secs is not None:
            window = self._seconds.setdefault(kind, [])
            window.append(secs)
            del window[:-20]  # recent steps: step time drifts as responses grow
        stage, stage_step = rec.stage, rec.stage_step or 0
        total = self.totals.get(stage, stage_step)
        if not self._due(stage_step, total):
            return
        means = {k: sum(v) / len(v) for k, v in self._seconds.items() if v}
        eta = eta_seconds(self.stages, stage, stage_step, means)
        self._write(format_step(rec, total, rec.step, self.run_total, eta))

    def event(self, rec: dict[str, Any]) -> None:
        self._write(format_event(rec))

    def close(self) -> None:
        pass
