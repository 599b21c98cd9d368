"""The trainer's half of a GRPO-RoC step: scored rollouts (2G per prompt) -> RoC (2G -> G) ->
advantages -> clipped loss -> optimizer steps. The rollouts come from
:class:`kuberl.rollout.worker.RolloutWorker`; :mod:`kuberl.trainer.rl_step` runs the step in
order, and :func:`rl_update` runs where the trainable model is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kuberl.rollout.loop import Trajectory
from kuberl.rollout.scored import Scored
from kuberl.trainer.advantage import filter_groups, group_advantages
from kuberl.trainer.distributed import DistContext, split_evenly
from kuberl.trainer.length_reward import length_penalty, length_stats, response_length
from kuberl.trainer.loss import LossConfig, policy_loss, tis_weights, token_logprobs
from kuberl.trainer.roc import RocCandidate, select
from kuberl.trainer.sft import pad_batch


def roc_candidate(s: Scored) -> RocCandidate:
    """What Resample-on-Correct reads of a scored rollout."""
    t = s.traj
    return RocCandidate(
        reward=s.reward,
        tool_calls=t.tool_calls,
        tool_errors=min(t.tool_errors, t.tool_calls),
        answer_tags=t.answer_tags,  # the model's turns only, not tool output
        turns=t.turns,
        format_errors=t.format_errors,
    )


@dataclass
class StepBatch:
    """The kept rollouts of one RL step, with their advantages, and the step's statistics."""

    seqs: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    old_logprobs: list[list[float]] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    # what the engines returned while sampling (mu); old_logprobs become pi_old on recompute
    behavior_logprobs: list[list[float]] = field(default_factory=list)
    # per row: the engine that sampled it, whether that was the current policy version (only
    # those can be spot-checked against the trainer), and |mu - pi_old| summed / counted
    engines: list[str | None] = field(default_factory=list)
    fresh: list[bool] = field(default_factory=list)
    gaps: list[tuple[float, int]] = field(default_factory=list)


def tool_error_ratio_positive(groups: Sequence[Sequence[Scored]]) -> float:
    """Tool errors / tool calls over correct rollouts (paper fig. 4); NaN when none called a tool."""
    calls = sum(s.traj.tool_calls for g in groups for s in g if s.reward > 0)
    errors = sum(s.traj.tool_errors for g in groups for s in g if s.reward > 0)
    return errors / calls if calls else math.nan


def staleness(traj: Trajectory, version: int | None) -> int | None:
    """How many policy versions older than ``version`` the oldest turn of ``traj`` is (None when
    the engine reported no version, or the run tracks none)."""
    if version is None or traj.min_version is None:
        return None
    return version - traj.min_version


def is_fresh(traj: Trajectory, version: int | None) -> bool:
    """Sampled by the policy version being trained, as far as anyone can tell: an engine that
    reports no version cannot be told stale (so it is spot-checked rather than skipped)."""
    return staleness(traj, version) in (0, None)


def prepare_batch(
    groups: Sequence[Sequence[Scored]],
    group_size: int,
    *,
    roc: bool,
    seed: int,
    filter_zero: bool = True,
    version: int | None = None,
    max_staleness: int | None = None,
    length_alpha: float | None = None,
    count_tool_tokens: bool = False,
) -> StepBatch:
    """RoC-select G per group, compute advantages, drop zero-advantage groups; collect stats.

    With ``length_alpha`` (the length reward) a rollout whose prompt asked for a thinking
    budget is rewarded r_task - alpha * |l_target - l_y| (INTELLECT-2 section 3.1.2): RoC still
    selects on r_task (rStar2-Agent eqs. 4-5), the advantages (eq. 7) are of the shaped reward.

    Aborted rollouts (the engine failed or dropped them) are incomplete samples: they are
    dropped before selection and only counted (``rollouts_aborted``). With ``version`` (the
    policy version being trained) and ``max_staleness`` (the orchestrator's bound), a rollout
    any of whose turns came from a policy more than ``max_staleness`` versions older, or from a
    version newer than ``version`` (an engine serving weights it was never given), is dropped
    the same way and counted in ``rollouts_stale``; ``staleness_<k>`` counts the rollouts k
    versions old.
    """
    out = StepBatch()
    generated = sum(len(g) for g in groups)
    ages = [staleness(s.traj, version) for g in groups for s in g]
    stale = 0
    if max_staleness is not None and version is not None:
        before = sum(len(g) for g in groups)
        groups = [
            [s for s in g if (a := staleness(s.traj, version)) is None or 0 <= a <= max_staleness]
            for g in groups
        ]
        stale = before - sum(len(g) for g in groups)
    groups = [[s for s in g if s.traj.finish_reason != "abort"] for g in groups]
    all_scored = [s for g in groups for s in g]
    kept_groups: list[list[Scored]] = []
    advs: list[list[float]] = []

    def shaped(s: Scored) -> float:
        if length_alpha is None or s.length_target is None:
            return s.reward
        return s.reward - length_penalty(_length(s.traj, count_tool_tokens), s.length_target, length_alpha)

    for gi, g in enumerate(groups):
        idx = select([roc_candidate(s) for s in g], group_size, seed=seed * 100_003 + gi, roc=roc)  # on r_task
        kg = [g[i] for i in idx]
        kept_groups.append(kg)
        advs.append(group_advantages([shaped(s) for s in kg]))
    keep, dropped = filter_groups(advs) if filter_zero else (list(range(len(advs))), 0)
    for gi in keep:
        for s, a in zip(kept_groups[gi], advs[gi], strict=True):
            t = s.traj
            out.seqs.append(t.prompt_ids + t.response_ids)
            out.masks.append([0] * len(t.prompt_ids) + t.loss_mask)
            out.old_logprobs.append([0.0] * len(t.prompt_ids) + t.logprobs)
            out.behavior_logprobs.append([0.0] * len(t.prompt_ids) + t.logprobs)
            out.engines.append(t.engine)
            out.fresh.append(is_fresh(t, version))
            out.advantages.append(a)
    n = max(1, len(all_scored))
    kept_flat = [s for g in kept_groups for s in g]
    out.stats = {
        "reward_mean": sum(s.reward for s in all_scored) / n,
        "reward_kept_mean": sum(s.reward for s in kept_flat) / max(1, len(kept_flat)),
        "tool_error_ratio_positive": tool_error_ratio_positive(groups),
        "tool_error_ratio_positive_kept": tool_error_ratio_positive(kept_groups),
        "response_clip_ratio": sum(s.traj.truncated for s in all_scored) / n,
        "response_length": sum(len(s.traj.response_ids) for s in all_scored) / n,
        "response_tokens": float(sum(len(s.traj.response_ids) for s in all_scored)),  # tokens/s in logs
        "tool_calls_mean": sum(s.traj.tool_calls for s in all_scored) / n,
        # summed over rollouts: they wait for tools concurrently, so this overlaps the step's generation
        "tool_seconds": sum(s.traj.tool_seconds for s in all_scored),
        "turns_mean": sum(s.traj.turns for s in all_scored) / n,
        "groups": float(len(groups)),
        "groups_dropped_zero_adv": float(dropped),
        "rollouts": float(generated),
        "rollouts_aborted": float(generated - len(all_scored) - stale),
        # moved to another engine mid-rollout (their engine left the fleet): kept, not lost
        "rollouts_handed_off": float(sum(s.traj.handoffs > 0 for s in all_scored)),
        "rollouts_kept": float(len(out.seqs)),
    }
    if length_alpha is not None:
        out.stats.update(length_stats(budget_rows(all_scored, length_alpha, count_tool_tokens)))
    known = [a for a in ages if a is not None]
    if known:
        out.stats["rollouts_stale"] = float(stale)
        out.stats["staleness_mean"] = sum(known) / len(known)
        out.stats["staleness_max"] = float(max(known))
        for k in sorted(set(known)):
            out.stats[f"staleness_{k}"] = float(sum(a == k for a in known))
    return out


def _length(traj: Trajectory, count_tool_tokens: bool) -> int:
    return response_length(traj.loss_mask, len(traj.response_ids), count_tool_tokens)


def budget_rows(
    scored: Sequence[Scored], alpha: float, count_tool_tokens: bool
) -> list[tuple[int, int, float]]:
    """(l_y, l_target, alpha * |l_target - l_y|) of each rollout whose prompt named a budget:
    what ``length_reward.length_stats`` summarises."""
    rows = []
    for s in scored:
        if s.length_target is not None:
            n = _length(s.traj, count_tool_tokens)
            rows.append((n, s.length_target, length_penalty(n, s.length_target, alpha)))
    return rows


def shard_step_batch(batch: StepBatch, parts: int) -> list[StepBatch]:
    """``batch`` as ``parts`` rank shares of equal row count and near-equal token count.

    Equal row counts give every rank the same micro-batches, hence the same sequence of FSDP
    collectives; a short share is padded with rows that train nothing (loss mask all 0,
    advantage 0). An empty batch stays empty everywhere, so every rank skips the update.
    """
    if not batch.seqs:
        return [StepBatch(stats=batch.stats) for _ in range(parts)]
    rows = list(range(len(batch.seqs)))
    groups = split_evenly(rows, parts, weights=[sum(m) for m in batch.masks])
    width = max(len(g) for g in groups)
    pad = min(rows, key=lambda i: len(batch.seqs[i]))
    out = []
    for g in groups:
        sb = StepBatch(stats=batch.stats)
        for i in g:
            sb.seqs.append(batch.seqs[i])
            sb.masks.append(batch.masks[i])
            sb.old_logprobs.append(batch.old_logprobs[i])
            sb.advantages.append(batch.advantages[i])
            if batch.behavior_logprobs:
                sb.behavior_logprobs.append(batch.behavior_logprobs[i])
            if batch.engines:
                sb.engines.append(batch.engines[i])
                sb.fresh.append(batch.fresh[i])
        for _ in range(width - len(g)):
            sb.seqs.append(batch.seqs[pad])
            sb.masks.append([0] * len(batch.seqs[pad]))
            sb.old_logprobs.append([0.0] * len(batch.seqs[pad]))
            sb.advantages.append(0.0)
            if batch.behavior_logprobs:
                sb.behavior_logprobs.append([0.0] * len(batch.seqs[pad]))
            if batch.engines:
                sb.engines.append(None)
                sb.fresh.append(False)
        out.append(sb)
    return out


def micro_batches(
    idx: Sequence[int],
    lengths: Sequence[int],
    micro_batch: int,
    max_tokens: int | None = None,
    dist: DistContext | None = None,
) -> list[list[int]]:
    """Rows ``idx`` (token counts ``lengths[i]``) in the micro-batches of one forward/backward
    each: at most ``micro_batch`` rows, and with ``max_tokens`` about that many tokens.

    The token bound is what bounds the update's memory: activations grow with the tokens of a
    forward, whatever the row count. The loss does not change: every micro-batch divides by the whole
    mini-batch's token count. Without ``max_tokens`` rows are taken in order, ``micro_batch`` at
    a time (as always); with it the rows are balanced by tokens over as many micro-batches as
    the largest rank needs (FSDP: every rank runs the same number of forwards; their row counts
    are equal, :func:`shard_step_batch`, so no share is empty).
    """
    if micro_batch < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"micro_batch and max_tokens must be >= 1, got {micro_batch}, {max_tokens}")
    if max_tokens is None:
        return [list(idx[s : s + micro_batch]) for s in range(0, len(idx), micro_batch)]
    if not idx:
        return []
    parts = max(-(-len(idx) // micro_batch), -(-sum(lengths[i] for i in idx) // max_tokens))
    parts = min(parts, len(idx))
    if dist is not None:
        parts = int(dist.all_reduce([float(parts)], op="max")[0])
    return split_evenly(list(idx), parts, weights=[lengths[i] for i in idx])


def policy_logprobs(
    model: nn.Module,
    inp: torch.Tensor,
    att: torch.Tensor,
    tgt: torch.Tensor,
    tm: torch.Tensor,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) [B, T-1] (and the entropy) of a :func:`pad_batch` micro-batch, with the
    model's output layer run only from the first column any row trains on.

    The columns before it (the shared prompt of a GRPO group, at least) have target mask 0 in
    every row, so their log-probs are never used: they are returned as 0. The output layer
    (hidden x vocabulary) is a fifth of SmolLM2-135M's FLOPs and its [B, T, V] logits the
    largest tensor of the update; TRL likewise computes logits for completions only
    (``logits_to_keep``). Models with the policy forward contract take ``logits_from``.
    """
    cols = torch.nonzero(tm.any(dim=0)).flatten()
    start = int(cols[0]) if len(cols) else tm.shape[1] - 1  # nothing trained: one column, not none
    kw = {"logits_from": start} if start > 0 else {}
    logits, _ = model(inp, attention_mask=att, use_cache=False, **kw)
    lp, ent = token_logprobs(logits, tgt[:, start:], with_entropy=with_entropy)
    del logits
    if start:
        lp = torch.nn.functional.pad(lp, (start, 0))
        ent = torch.nn.functional.pad(ent, (start, 0)) if ent is not None else None
    return lp, ent


@torch.no_grad()
def recompute_old_logprobs(
    model: nn.Module,
    batch: StepBatch,
    *,
    micro_batch: int = 64,
    micro_batch_tokens: int | None = None,
    device: torch.device | str = "cpu",
    dist: DistContext | None = None,
) -> float:
    """Replace the engine's log-probs in ``batch`` by the trainer model's; return their mean gap.

    PPO's pi_old is the policy being updated, evaluated here in one fixed layout before the
    first optimizer step (as verl does). The engine's numbers depend on how requests happened
    to share its batches (and on a cluster on SGLang's kernels and dtype), so the ratio built
    from them would carry that noise - and a resumed run, whose tool calls return in another
    order, would no longer update bit-for-bit. The returned mean |engine - trainer| log-prob
    over the trained tokens is the rollout/trainer mismatch, a check that weights were synced.
    With FSDP every rank calls this on its share (the same number of rows on every rank, see
    :func:`shard_step_batch`, so the forwards' collectives line up); the gap is then its own.
    ``micro_batch``/``micro_batch_tokens``/``dist``: the forwards' sizes, :func:`micro_batches`.
    """
    was_training = model.training
    model.eval()
    gap, count = 0.0, 0
    batch.gaps = []
    try:
        lengths = [len(q) for q in batch.seqs]
        for part in micro_batches(range(len(batch.seqs)), lengths, micro_batch, micro_batch_tokens, dist):
            inp, att, tgt, tm = pad_batch(
                [batch.seqs[i] for i in part], [batch.masks[i] for i in part], device
            )
            lp = policy_logprobs(model, inp, att, tgt, tm)[0].cpu()
            for row, i in enumerate(part):
                n = len(batch.seqs[i]) - 1
                mask = tm[row, :n].cpu() > 0
                engine = torch.tensor(batch.old_logprobs[i][1:], dtype=lp.dtype)
                row_gap, row_count = float((engine - lp[row, :n]).abs()[mask].sum()), int(mask.sum())
                gap += row_gap
                count += row_count
                batch.gaps.append((row_gap, row_count))
                # untrained positions hold 0: their numbers would depend on the micro-batch's layout
                batch.old_logprobs[i] = [0.0, *torch.where(mask, lp[row, :n], 0.0).tolist()]
    finally:
        model.train(was_training)
    return gap / count if count else 0.0


def _shifted_rows(per_row: list[list[float]], part: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Per-token values of rows ``part`` aligned with next-token targets (position 0 dropped),
    zero-padded to ``like``'s shape: the layout ``pad_batch`` gives the targets."""
    out = torch.zeros_like(like)
    for row, i in enumerate(part):
        values = per_row[i][1:]
        out[row, : len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


def _take_old_from_forward(
    batch: StepBatch, part: Sequence[int], lp: torch.Tensor, engine: torch.Tensor, tm: torch.Tensor
) -> torch.Tensor:
    """pi_old for rows ``part`` from the update's own detached log-probs ``lp`` (on-policy).

    Leaves ``batch`` as :func:`recompute_old_logprobs` would: ``old_logprobs`` replaced by the
    trainer's numbers and ``gaps`` the per-row |engine - trainer| sum and count over trained
    tokens (``engine``: the engine's numbers in ``lp``'s layout). Returns ``lp``.
    """
    kept = tm > 0
    diff = ((engine - lp).abs() * kept).sum(dim=1).cpu().tolist()
    counts = kept.sum(dim=1).cpu().tolist()
    rows = torch.where(kept, lp, 0.0).cpu()  # untrained positions: 0, as recompute_old_logprobs
    for row, i in enumerate(part):
        n = len(batch.seqs[i]) - 1
        batch.gaps[i] = (float(diff[row]), int(counts[row]))
        batch.old_logprobs[i] = [0.0, *rows[row, :n].tolist()]
    return lp


def rl_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    cfg: LossConfig,
    *,
    grad_clip: float,
    mini_batches: int = 1,
    ppo_epochs: int = 1,
    micro_batch: int = 64,
    device: torch.device | str = "cpu",
    dist: DistContext | None = None,
    tis_cap: float | None = None,
    on_policy: bool = False,
    micro_batch_tokens: int | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps over the batch; token-mean per mini-batch.

    ``on_policy`` (one epoch, one mini-batch: a single optimizer step) takes pi_old from the
    update's own forward instead of :func:`recompute_old_logprobs`: every micro-batch's forward
    runs before the one optimizer step, at the weights pi_old stands for, so pi_old is its
    detached log-probs, the ratio is 1 in value and the clipped objective's gradient is the
    plain policy gradient A * grad log pi (what TRL does at ``num_iterations=1``). It saves the
    recomputation's forward. ``batch.old_logprobs`` must still hold the engine's numbers: they
    become pi_old here and ``batch.gaps`` and ``rollout_logprob_gap`` (in the returned stats)
    carry the engine-vs-trainer gap exactly as the recomputation reports it.

    ``tis_cap`` weights each token by min(pi_old / mu, cap), mu being the engine's sampling
    log-probs (``batch.behavior_logprobs``): the off-policy correction of asynchronous runs
    (``loss.tis_weights``); None leaves the loss exactly as without it. mu is per token, so a
    rollout that went on across a weight push (partial rollouts) is weighed token by token against
    the version that sampled each token; tokens of the version being trained still carry the
    engine's numerical mismatch, which the same weight corrects.

    ``micro_batch``/``micro_batch_tokens``: rows and about how many tokens one forward/backward
    takes (:func:`micro_batches`); the gradient is the mini-batch's whatever the split.

    Returned stats cover every micro-batch of every epoch: fractions and means weighted by
    their kept tokens, ``ratio_max`` the maximum, ``loss``/``grad_norm`` per optimizer step.

    With ``dist`` (FSDP ranks, each holding its :func:`shard_step_batch` share) the token-mean
    denominator is the mini-batch's token count over all ranks and the stats are reduced over
    all ranks, so the update and its numbers are the full batch's.
    """
    dist = dist or DistContext()
    if on_policy and (ppo_epochs != 1 or mini_batches != 1):
        raise ValueError(
            f"on_policy needs one optimizer step per batch (ppo_epochs 1, mini_batches 1), got "
            f"{ppo_epochs} x {mini_batches}: later steps need pi_old from recompute_old_logprobs"
        )
    if not batch.seqs:  # every group was filtered out (all-equal rewards): no update this step
        zero = ("clip_low", "clip_high", "cap_frac", "approx_kl", "loss", "grad_norm", "tokens", "opt_steps")
        return {"skipped": 1.0, **dict.fromkeys(zero, 0.0)}
    model.train()
    n = len(batch.seqs)
    order = list(range(n))
    lengths = [len(q) for q in batch.seqs]
    totals: dict[str, float] = {}
    ratio_max = -math.inf
    count = 0
    if on_policy:
        batch.gaps = [(0.0, 0)] * n
    for _ in range(ppo_epochs):
        for mb in range(mini_batches):
            idx = order[mb * n // mini_batches : (mb + 1) * n // mini_batches]
            if not idx:
                continue
            tokens = dist.all_reduce([float(sum(sum(batch.masks[i][1:]) for i in idx))])[0]
            optimizer.zero_grad(set_to_none=True)
            for part in micro_batches(idx, lengths, micro_batch, micro_batch_tokens, dist):
                inp, att, tgt, tm = pad_batch(
                    [batch.seqs[i] for i in part], [batch.masks[i] for i in part], device
                )
                old = _shifted_rows(batch.old_logprobs, part, tm)
                adv = torch.tensor([batch.advantages[i] for i in part], dtype=torch.float32, device=tm.device)
                lp, ent = policy_logprobs(model, inp, att, tgt, tm, with_entropy=cfg.entropy_coef > 0)
                if on_policy:  # pi_old := this forward, detached; ``old`` held the engine's numbers
                    old = _take_old_from_forward(batch, part, lp.detach(), old, tm)
                    totals["rollout_logprob_gap"] = totals.get("rollout_logprob_gap", 0.0) + sum(
                        batch.gaps[i][0] for i in part
                    )
                weights = None
                if tis_cap is not None:
                    weights = tis_weights(old, _shifted_rows(batch.behavior_logprobs, part, tm), tis_cap)
                loss, st = policy_loss(
                    lp,
                    old,
                    adv,
                    tm,
                    cfg,
                    entropy=ent if cfg.entropy_coef > 0 else None,
                    num_tokens=max(1.0, tokens),
                    is_weights=weights,
                    is_cap=tis_cap,
                )
                if cfg.aggregation == "token-mean":
                    # Denominator over all ranks: FSDP's average of the ranks' gradients, times
                    # the world size, is their sum, the full batch's gradient.
                    (loss * dist.loss_scale).backward()
                    logged = float(loss.detach())
                else:
                    loss = loss * len(part) / len(idx)  # per-rank means: FSDP averages the ranks
                    loss.backward()
                    logged = float(loss.detach()) / dist.world_size
                w = st["tokens"]
                for k, v in st.items():
                    if k == "ratio_max":
                        if w > 0:  # a micro-batch without kept tokens has no ratio
                            ratio_max = max(ratio_max, v)
                    elif k != "tokens":
                        totals[k] = totals.get(k, 0.0) + v * w
                totals["tokens"] = totals.get("tokens", 0.0) + w
                totals["loss"] = totals.get("loss", 0.0) + logged
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # FSDP: a replicated DTensor
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(gn) / dist.world_size
            optimizer.step()
            count += 1
    keys = sorted(totals)
    totals = dict(zip(keys, dist.all_reduce([totals[k] for k in keys]), strict=True))
    ratio_max = dist.all_reduce([ratio_max], op="max")[0]
    tok = max(1.0, totals.get("tokens", 0.0))
    # rollout_logprob_gap: summed |engine - trainer| over the kept tokens, hence a token mean here
    out = {k: v / tok for k, v in totals.items() if k not in ("tokens", "loss", "grad_norm")}
    out["ratio_max"] = ratio_max if ratio_max > -math.inf else 1.0
    out["loss"] = totals.get("loss", 0.0) / max(1, count)
    out["grad_norm"] = totals.get("grad_norm", 0.0) / max(1, count)
    out["tokens"] = tok / max(1, ppo_epochs)
    out["opt_steps"] = float(count)
    return out


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    r = fn(*args, **kwargs)
    return r, time.perf_counter() - t


def engine_gaps(batch: StepBatch) -> dict[str, float]:
    """Mean |engine - trainer| log-prob per engine over the batch's fresh rows (sampled by the
    policy version being trained: older rows differ by the update, not by the engine).

    The spot check of asynchronous and fleet runs: an engine far above a correct server's
    mismatch serves other weights than were pushed to it. Pure, after
    :func:`recompute_old_logprobs` filled ``batch.gaps``.
    """
    sums: dict[str, list[float]] = {}
    for name, fresh, (gap, count) in zip(batch.engines, batch.fresh, batch.gaps, strict=False):
        if name is None or not fresh or count == 0:
            continue
        acc = sums.setdefault(name, [0.0, 0.0])
        acc[0] += gap
        acc[1] += count
    return {name: g / c for name, (g, c) in sums.items() if c}


def trained_engines(batch: StepBatch) -> set[str]:
    """The engines with a fresh trained row in ``batch``: :func:`engine_gaps` of the batch
    measures them once pi_old is known, so the spot check need not rescore their rollouts."""
    return {
        e for e, fresh, m in zip(batch.engines, batch.fresh, batch.masks, strict=False)
        if e is not None and fresh and any(m)
    }  # fmt: skip


def spot_rows(
    groups: Sequence[Sequence[Scored]],
    version: int | None,
    count: int,
    skip: set[str] | frozenset = frozenset(),
) -> StepBatch:
    """Up to ``count`` of the step's rollouts for the engine spot check, trained on or not:
    fresh (sampled by the current policy version), complete, taken in turn from each engine so
    that every engine of the fleet is looked at - except the engines in ``skip`` (those the
    trained rows already measure, :func:`trained_engines`). Pure; ``recompute_old_logprobs``
    then ``engine_gaps`` on the result give each engine's mismatch."""
    by_engine: dict[str | None, list[Trajectory]] = {}
    for g in groups:
        for s in g:
            t = s.traj
            if t.finish_reason == "abort" or not any(t.loss_mask):
                continue
            if not is_fresh(t, version) or t.engine in skip or t.handoffs:  # one engine's tokens only
                continue
            by_engine.setdefault(t.engine, []).append(t)
    picked: list[Trajectory] = []
    queues = [list(ts) for _, ts in sorted(by_engine.items(), key=lambda kv: str(kv[0]))]
    while len(picked) < count and any(queues):
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    out = StepBatch()
    for t in picked:
        out.seqs.append(t.prompt_ids + t.response_ids)
        out.masks.append([0] * len(t.prompt_ids) + t.loss_mask)
        out.old_logprobs.append([0.0] * len(t.prompt_ids) + t.logprobs)
        out.behavior_logprobs.append(list(out.old_logprobs[-1]))
        out.advantages.append(0.0)
        out.engines.append(t.engine)
        out.fresh.append(True)
    return out
