"""The GRPO-RoC policy loss (rStar2-Agent eq. 6) with clip-higher and the INTELLECT-2 cap.

Per token t of rollout i with ratio r = pi_theta / pi_old and advantage A_i:

    objective = min(r' * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    r' = min(r, delta) if A < 0 and a cap delta is set (INTELLECT-2 eq. in section 3), else r

and the loss is -objective aggregated over the tokens whose ``loss_mask`` is 1 (tokens the
policy generated; prompt and tool-response tokens are 0):

* ``token-mean`` (the paper's): sum over all kept tokens of the batch / their number; pass
  ``num_tokens`` to normalize by the token count of the whole batch when it is split into
  micro-batches (gradient accumulation then equals the full-batch loss exactly).
* ``seq-mean-token-mean``: per-rollout token mean, then mean over rollouts (original GRPO).
* ``seq-mean-token-sum``: per-rollout token sum, then mean over rollouts (Dr. GRPO style).

Optional terms (0 by default, as in the paper): ``kl_coef`` * k3-estimator KL to a reference
policy (needs ``ref_logprobs``), minus ``entropy_coef`` * token entropy (needs ``entropy``).

Off-policy rollouts (``asyncLevel`` > 0, INTELLECT-2 section 2.1): pi_old is the policy at the
start of the optimisation step (the trainer's recomputation), but the tokens were sampled by an
older engine policy mu. ``is_weights`` = min(pi_old / mu, C) per token (truncated importance
sampling, as verl's TIS and prime-rl's) multiplies the clipped policy term, so the gradient is
an estimate under pi_old again without letting a rare token's huge ratio dominate; stats
``tis_mean`` and ``tis_capped`` (fraction of tokens at the cap C).

Stats (all token-level over kept tokens): ``clip_low`` = fraction with A < 0 and r < 1 - eps_low
(the gradient is cut), ``clip_high`` = fraction with A > 0 and r > 1 + eps_high, ``cap_frac`` =
fraction where the negative-advantage cap is active, ``approx_kl`` = mean of 0.5 (log r)^2 to the
sampling policy, ``ratio_mean``/``ratio_max``, ``tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    negative_ratio_cap: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.aggregation!r}; choose one of {AGGREGATIONS}")
        if not (0 < self.clip_low < 1) or self.clip_high <= 0:
            raise ValueError(
                f"clip bounds must satisfy 0 < low < 1, high > 0 (got {self.clip_low}, {self.clip_high})"
            )
        if self.negative_ratio_cap is not None and self.negative_ratio_cap <= 1 + self.clip_high:
            raise ValueError("negative_ratio_cap must exceed 1 + clip_high")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None
) -> torch.Tensor:
    """Aggregate per-token ``values`` [B, T] over ``mask`` [B, T] (see module docstring)."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    per_seq = (values * mask).sum(dim=1)
    counts = mask.sum(dim=1)
    has = counts > 0
    if not bool(has.any()):
        return values.sum() * 0.0
    if mode == "seq-mean-token-mean":
        return (per_seq[has] / counts[has]).mean()
    if mode == "seq-mean-token-sum":
        return per_seq[has].mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig = LossConfig(),
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
    is_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (scalar, differentiable w.r.t. ``logprobs``) and token-level stats.

    ``logprobs``/``old_logprobs``/``loss_mask``: [B, T]; ``advantages``: [B] (one per rollout,
    broadcast over its tokens) or [B, T].
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
            f"mask {tuple(loss_mask.shape)}"
        )
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    if adv.shape != logprobs.shape:
        raise ValueError(f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)}")
    adv = adv.to(logprobs.dtype)
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(log_ratio)
    capped = ratio
    cap_active = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.negative_ratio_cap is not None:
        cap_active = (adv < 0) & (ratio > cfg.negative_ratio_cap)
        capped = torch.where(adv < 0, ratio.clamp(max=cfg.negative_ratio_cap), ratio)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.minimum(capped * adv, clipped * adv)
    if is_weights is not None:
        if is_weights.shape != logprobs.shape:
            raise ValueError(f"is_weights must be {tuple(logprobs.shape)}, got {tuple(is_weights.shape)}")
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        d = ref_logprobs.to(logprobs.dtype) - logprobs
        per_token = per_token + cfg.kl_coef * (torch.exp(d) - d - 1.0)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        per_token = per_token - cfg.entropy_coef * entropy
    loss = aggregate(per_token, mask, cfg.aggregation, num_tokens)
    with torch.no_grad():
        kept = mask > 0
        n = int(kept.sum())
        low = (adv < 0) & (ratio < 1.0 - cfg.clip_low) & kept
        high = (adv > 0) & (ratio > 1.0 + cfg.clip_high) & kept
        r = ratio[kept]
        stats = {
            "tokens": float(n),
            "clip_low": float(low.sum()) / max(1, n),
            "clip_high": float(high.sum()) / max(1, n),
            "cap_frac": float((cap_active & kept).sum()) / max(1, n),
            "approx_kl": float((0.5 * log_ratio[kept] ** 2).mean()) if n else 0.0,
            "ratio_mean": float(r.mean()) if n else 1.0,
            "ratio_max": float(r.max()) if n else 1.0,
        }
        if is_weights is not None:
            w = is_weights[kept]
            stats["tis_mean"] = float(w.mean()) if n else 1.0
            stats["tis_capped"] = float((w >= is_cap).sum()) / max(1, n) if is_cap is not None else 0.0
    return loss, stats


def tis_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log pi_old - log mu), cap) per token: the truncated importance weight of a token
    sampled by the behaviour policy mu (the engine) under the policy being optimised (pi_old)."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - behavior_logprobs).clamp(max=cap)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) [B, T] and the entropy [B, T] of each next-token distribution (None
    without ``with_entropy``).

    Without the entropy, log pi(target) is the target's logit minus the logsumexp: no [B, T, V]
    log-softmax, exp or product is kept: with a 49k vocabulary each is ~0.5 GB for 8 rollouts
    of 300 tokens.
    """
    logits = logits.float()
    if not with_entropy:
        return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1), None
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy
