"""Resample-on-Correct (RoC), rStar2-Agent section 2.2.3, eqs. 4-5: oversample, keep G.

Pure selection logic, no torch: given the rewards and tool/format statistics of the N
(= oversample * G, normally 2G) rollouts of one prompt, return the indices of the kept ones.

Definitions (paper eqs. 4-5; the choices the paper leaves open are marked *):

* ``p_err`` = tool_errors / tool_calls, and 0.5 when the rollout made no tool call (eq. 4).
  Malformed ``<tool_call>`` blocks count as tool calls that errored (the rollout loop answers
  them with their parse error, exactly like a failing execution).
* ``p_format`` (eq. 5) = 1 when the response has no ``<answer>`` tag, otherwise
  min(1, (answer_tags - 1) / turns), exactly as in the paper. A malformed ``<tool_call>`` is
  already penalized through ``p_err`` (the paper counts tool-call formatting issues among tool
  errors). *Opt-in extension, ``count_format_errors=True``: each format error the rollout
  loop counts (``format_errors``: malformed or unclosed blocks) also adds 1/turns to p_format,
  capped at 1; a malformed call then weighs twice, and an unclosed one (never executed, so
  invisible to ``p_err``) is penalized at all.
* ``p_total`` = p_err + p_format, in [0, 2].
* Negatives (reward 0): sampled uniformly without replacement, k_neg = floor(|neg| * G / N)
  (= floor(|neg|/2) for N = 2G, the paper's "half of the original group").
* Positives (reward 1): k_pos = G - k_neg (= ceil(|pos|/2) for N = 2G, so the batch is exactly
  G), sampled without replacement one at a time with probability proportional to
  1 / (p_total + ``eps``). *``eps`` (default 1e-2) keeps p_total = 0 finite: a clean rollout
  then weighs 1/eps = 100x one with p_total = 1, i.e. it is almost always preferred but the
  draw stays random among clean ones (ties are broken uniformly at random, as weights are equal).
* *Edge cases*: all correct -> k_neg = 0, G positives by weight; all wrong -> G negatives
  uniformly; if one side has fewer rollouts than its quota the other side fills the rest; with
  fewer than G rollouts in total, all are kept.
* Plain GRPO (``roc=False``): the first G rollouts in generation order, no resampling.

Output order follows the input order (so results are reproducible and easy to test).
Deterministic: the same inputs and seed give the same selection.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RocCandidate:
    """What RoC needs to know about one rollout."""

    reward: float
    tool_calls: int
    tool_errors: int
    answer_tags: int
    turns: int
    format_errors: int = 0  # malformed/unclosed <tool_call> blocks (Trajectory.format_errors)

    def __post_init__(self) -> None:
        if self.tool_calls < 0 or self.tool_errors < 0 or self.answer_tags < 0 or self.format_errors < 0:
            raise ValueError(f"RoC counts must be >= 0: {self}")
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"tool_errors ({self.tool_errors}) > tool_calls ({self.tool_calls})")


def p_err(c: RocCandidate) -> float:
    """Eq. 4: tool error ratio, 0.5 when no tool was called (to encourage tool use)."""
    return 0.5 if c.tool_calls == 0 else c.tool_errors / c.tool_calls


def p_format(c: RocCandidate, *, count_format_errors: bool = False) -> float:
    """Eq. 5; with ``count_format_errors`` plus format_errors / turns (see module docstring)."""
    turns = max(1, c.turns)
    base = 1.0 if c.answer_tags == 0 else min(1.0, (c.answer_tags - 1) / turns)
    if not count_format_errors:
        return base
    return min(1.0, base + c.format_errors / turns)


def p_total(c: RocCandidate, *, count_format_errors: bool = False) -> float:
    return p_err(c) + p_format(c, count_format_errors=count_format_errors)


def quotas(n_pos: int, n_neg: int, group_size: int, n_total: int | None = None) -> tuple[int, int]:
    """(k_pos, k_neg) kept out of n_pos positives and n_neg negatives (see module docstring)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = n_total if n_total is not None else n_pos + n_neg
    if n_pos + n_neg <= group_size:
        return n_pos, n_neg
    k_neg = min(n_neg, (n_neg * group_size) // max(1, n))
    k_pos = min(n_pos, group_size - k_neg)
    k_neg = min(n_neg, group_size - k_pos)  # positives short: negatives fill the rest
    return k_pos, k_neg


def _weighted_without_replacement(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """Successive draws, each proportional to the remaining weights."""
    pool = list(range(len(weights)))
    out: list[int] = []
    for _ in range(k):
        total = sum(weights[i] for i in pool)
        x = rng.random() * total
        acc = 0.0
        pick = pool[-1]
        for i in pool:
            acc += weights[i]
            if x < acc:
                pick = i
                break
        out.append(pick)
        pool.remove(pick)
    return out


def select(
    candidates: Sequence[RocCandidate],
    group_size: int,
    *,
    seed: int,
    roc: bool = True,
    eps: float = 1e-2,
    count_format_errors: bool = False,
) -> list[int]:
    """Indices (ascending) of the rollouts kept for the update; see the module docstring.

    ``count_format_errors`` opts into the p_format extension (off: the paper's eq. 5).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    n = len(candidates)
    if not roc or n <= group_size:
        return list(range(min(n, group_size)))
    rng = random.Random(seed)
    pos = [i for i, c in enumerate(candidates) if c.reward > 0]
    neg = [i for i, c in enumerate(candidates) if c.reward <= 0]
    k_pos, k_neg = quotas(len(pos), len(neg), group_size, n)
    kept_neg = rng.sample(neg, k_neg)
    weights = [1.0 / (p_total(candidates[i], count_format_errors=count_format_errors) + eps) for i in pos]
    kept_pos = [pos[j] for j in _weighted_without_replacement(rng, weights, k_pos)]
    return sorted(kept_neg + kept_pos)
