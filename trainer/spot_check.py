"""Spot-checking the engines of an asynchronous run by rescoring.

An engine that serves other weights than were pushed to it (a replica that restarted from the
base model, a push that failed on one of N servers) samples rollouts that look like any other.
Training on them averages the wrong policy into the update. The check: compare what an engine
says of a sequence with what the trainer says of it, under the same weights.

With ``asyncLevel`` 0 the step's rollouts were sampled by the weights being trained, so their
sampling log-probs can be compared with the trainer's recomputation directly (``grpo.spot_rows``
and ``grpo.engine_gaps``). With ``asyncLevel`` k > 0 nearly every rollout was sampled by an older
version, whose log-probs differ from the trainer's by the update, not by the engine. Here the
engines are asked instead to *score* a few of the step's sequences with the weights they serve
now (``Engine.score``: prompt log-probs on vLLM, ``logprob_start_len`` on SGLang), right after the
step's push, and the answers are compared with pi_old, which the trainer recomputed with the same
weights. Which version sampled a sequence does not matter; every engine is asked (sequences are
dealt out over the fleet), and the mean absolute gap per engine is compared with
``rollout.spotCheckTolerance`` (0.15 nats/token by default, several times the gap of a correct
bf16 server).

The comparison is pure (``probe_rows``, ``probe_requests``, ``probe_gaps``, ``finding_texts``);
``probe_engines`` is the thin shell that asks the engines to score, and
``EngineWatch`` keeps which engines are out of tolerance between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kuberl.trainer.grpo import StepBatch


def probe_rows(batch: StepBatch, count: int) -> list[int]:
    """Up to ``count`` rows of ``batch`` with trained tokens, spread evenly over the batch."""
    rows = [i for i, m in enumerate(batch.masks) if any(m)]
    if count <= 0 or not rows:
        return []
    if len(rows) <= count:
        return rows
    return [rows[(j * len(rows)) // count] for j in range(count)]


def probe_requests(batch: StepBatch, rows: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """(sequences, starts) to score: each row from its first trained token on (start >= 1)."""
    seqs, starts = [], []
    for i in rows:
        mask = batch.masks[i]
        seqs.append(list(batch.seqs[i]))
        starts.append(max(1, next(p for p, m in enumerate(mask) if m)))
    return seqs, starts


@dataclass
class ProbeResult:
    """Per engine: mean |engine - trainer| nats/token over the probed trained tokens; engines
    that reported serving another version than the one pushed; engines that could not score."""

    gaps: dict[str, float] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def probe_gaps(
    batch: StepBatch,
    rows: Sequence[int],
    starts: Sequence[int],
    answers: Sequence[dict[str, Any]],
    version: int | None,
) -> ProbeResult:
    """Compare the engines' scores (``answers`` of ``score_on_engines``) with ``batch.old_logprobs``
    (pi_old, recomputed by the trainer with the weights pushed as ``version``).

    Only trained tokens count (tool outputs and prompts are not the policy's). An engine that
    reports a version other than ``version`` is listed in ``versions``: its gap, if any, is
    still computed, since what matters is the weights it serves, not its label.
    """
    sums: dict[str, list[float]] = {}
    out = ProbeResult()
    for i, start, ans in zip(rows, starts, answers, strict=True):
        name = ans["engine"]
        if "error" in ans:
            out.errors[name] = ans["error"]
            continue
        served = ans.get("version")
        if version is not None and served is not None and served != version:
            out.versions[name] = served
        acc = sums.setdefault(name, [0.0, 0.0])
        lps, mask, pi_old = ans["logprobs"], batch.masks[i], batch.old_logprobs[i]
        for j, lp in enumerate(lps):
            p = start + j
            if mask[p]:
                acc[0] += abs(lp - pi_old[p])
                acc[1] += 1
    out.gaps = {name: g / c for name, (g, c) in sums.items() if c}
    return out


def probe_engines(
    score: Callable[[list[list[int]], list[int]], list[dict[str, Any]]],
    batch: StepBatch,
    version: int | None,
    count: int,
) -> ProbeResult:
    """Ask the engines (``score(seqs, starts)``: ``RolloutClient.score``) to score up to
    ``count`` of ``batch``'s rows and compare with its pi_old (the thin I/O shell of this module)."""
    rows = probe_rows(batch, count)
    if not rows:
        return ProbeResult()
    seqs, starts = probe_requests(batch, rows)
    return probe_gaps(batch, rows, starts, score(seqs, starts), version)


@dataclass
class EngineWatch:
    """Which engines the spot check holds out of tolerance, and the event texts of each change
    (an event when an engine leaves ``tolerance``, another when it comes back; the gauge
    ``kuberl_train_engine_logprob_gap`` carries every step's figure)."""

    tolerance: float | None
    out_of_step: set[str] = field(default_factory=set)

    def update(self, gaps: dict[str, float]) -> list[str]:
        if self.tolerance is None:
            return []
        tol, texts = self.tolerance, []
        for name, gap in sorted(gaps.items()):
            out = gap > tol
            if out == (name in self.out_of_step):
                continue
            if out:
                self.out_of_step.add(name)
                texts.append(
                    f"engine {name} samples {gap:.3f} nats/token away from the trained policy "
                    f"(tolerance {tol:g}): it serves other weights than were pushed to it"
                )
            else:
                self.out_of_step.discard(name)
                texts.append(f"engine {name} is back within tolerance ({gap:.3f} <= {tol:g} nats/token)")
        return texts


def finding_texts(probe: ProbeResult, version: int | None) -> list[str]:
    """Event texts for engines that claim another version than was pushed, or cannot score."""
    texts = [
        f"engine {name} serves version {served}, not {version} that was pushed to it"
        for name, served in sorted(probe.versions.items())
    ]
    texts += [
        f"engine {name} could not score for the spot check: {err}"
        for name, err in sorted(probe.errors.items())
    ]
    return texts
