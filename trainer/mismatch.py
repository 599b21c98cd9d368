"""Training-inference mismatch: the engine's sampling log-probs against the trainer's recomputation.

The same weights give different log-probabilities in an inference server (bf16, its own
kernels, batch-dependent reductions) and in the trainer (float32 masters, another attention
path). GRPO-RoC's ratio uses the trainer's pi_old (``grpo.recompute_old_logprobs``, or the
update's own forward when a step is on-policy: ``grpo.rl_update(on_policy=True)``), so the
mismatch does not enter the clipped ratio itself; it measures how far the behaviour policy that
sampled the tokens is from the policy being trained, which is what an
importance-sampling correction (verl's TIS, prime-rl's) would reweight, and it is the signal
that tells a server serving stale or wrong weights apart.

Everything here is pure: token log-prob lists in, statistics out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MismatchStats:
    """Per-token |trainer - engine| log-prob statistics over ``tokens`` sampled tokens.

    ``outside_clip`` is the fraction of tokens whose ratio exp(trainer - engine) lies outside
    [1 - clip_low, 1 + clip_high], i.e. tokens PPO's clip would cut if the engine's numbers were
    used as pi_old (paper eq. 2's bounds, 0.2 / 0.28).
    """

    tokens: int
    mean_abs: float
    max_abs: float
    p99_abs: float
    mean_signed: float
    outside_clip: float

    def to_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "mean_abs": self.mean_abs,
            "max_abs": self.max_abs,
            "p99_abs": self.p99_abs,
            "mean_signed": self.mean_signed,
            "outside_clip": self.outside_clip,
        }


def mismatch_stats(
    engine: Sequence[Sequence[float]],
    trainer: Sequence[Sequence[float]],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> MismatchStats:
    """Statistics over every token of every sequence; the two sides must align token by token."""
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine sequences but {len(trainer)} trainer sequences")
    diffs: list[float] = []
    for i, (e, t) in enumerate(zip(engine, trainer, strict=True)):
        if len(e) != len(t):
            raise ValueError(f"sequence {i}: {len(e)} engine log-probs but {len(t)} trainer log-probs")
        diffs.extend(float(b) - float(a) for a, b in zip(e, t, strict=True))
    if not diffs:
        raise ValueError("no tokens to compare")
    absd = sorted(abs(d) for d in diffs)
    lo, hi = math.log1p(-clip_low), math.log1p(clip_high)
    outside = sum(1 for d in diffs if d < lo or d > hi)
    n = len(diffs)
    return MismatchStats(
        tokens=n,
        mean_abs=sum(absd) / n,
        max_abs=absd[-1],
        p99_abs=absd[min(n - 1, math.ceil(0.99 * n) - 1)],
        mean_signed=sum(diffs) / n,
        outside_clip=outside / n,
    )


def trainer_token_logprobs(model, prompt_ids: Sequence[int], output_ids: Sequence[int], device="cpu") -> list[float]:
    """log pi(output_ids[i] | prompt + output[:i]) under ``model`` (a kuberl policy), one sequence."""
    import torch

    from kuberl.trainer.loss import token_logprobs

    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    with torch.no_grad():
        logits = model(ids, use_cache=False)[0]
        lp, _ = token_logprobs(logits, ids[:, 1:])
    return lp[0, len(prompt_ids) - 1 :].float().cpu().tolist()
