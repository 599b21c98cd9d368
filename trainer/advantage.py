"""Group-relative advantages (rStar2-Agent eq. 7 / GRPO) and the online zero-advantage filter."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r_i - mean) / std over one group (population std); a zero-std group gets all zeros.

    A group whose rewards are all equal carries no learning signal under GRPO (every advantage
    is 0), which is also why :func:`filter_groups` drops such groups before the update.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    if std < eps:
        return [0.0] * n
    return [(r - mean) / std for r in rewards]


def filter_groups(advantages: Sequence[Sequence[float]]) -> tuple[list[int], int]:
    """Indices of groups with any non-zero advantage, and how many groups were dropped."""
    keep = [i for i, adv in enumerate(advantages) if any(a != 0.0 for a in adv)]
    return keep, len(advantages) - len(keep)
