"""One GRPO-RoC step (rStar2-Agent sections 2.2-2.3), synchronous or asynchronous, top to bottom.

1. **push** this version's weights toward the engines (the orchestrator decides: in line, or on
   a thread beside the rest of the step when batches generate ahead);
2. **acquire** the step's scored rollout batch (rank 0; with ``asyncLevel`` k > 0 it was
   submitted k steps ago, and the next batches go out now), and the bound on its rollouts' age
   (``Orchestrator.max_staleness``: what the step drops and how it checks the engines);
3. **advantages**: Resample-on-Correct down-sampling (2G -> G), group-normalised advantages,
   the zero-advantage filter, then each FSDP rank's share;
4. **update**: pi_old, then the clipped loss's optimizer steps (forwards and backwards in
   ``trainer.precision``: float32, or bf16 autocast over float32 weights);
5. **check the engines**: their sampling log-probs against the trainer's for the same weights;
6. **record** the step's figures.

Every input is an argument: the model and optimizer being trained, the
:class:`~kuberl.rollout.orchestrator.Orchestrator` that owns the batches, and the step's
:class:`StepSettings`. The stage loop around it is :meth:`kuberl.trainer.rl_stage.RlStage.run`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kuberl.api.job import AgenticRLJobSpec
from kuberl.rollout.orchestrator import Orchestrator
from kuberl.rollout.scored import Scored
from kuberl.trainer.distributed import DistContext
from kuberl.trainer.grpo import (
    StepBatch,
    engine_gaps,
    prepare_batch,
    recompute_old_logprobs,
    rl_update,
    shard_step_batch,
    spot_rows,
    trained_engines,
)
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.precision import compute_in
from kuberl.trainer.spot_check import ProbeResult, probe_engines
from kuberl.trainer.step_record import StepRecord, figure_fields


@dataclass(frozen=True)
class StepSettings:
    """What every RL step of a run needs besides the model, optimizer and batches."""

    spec: AgenticRLJobSpec
    algorithm: str  # "grpo-roc" or "grpo"
    loss: LossConfig
    ctx: DistContext
    device: torch.device | str

    @property
    def sizes(self) -> dict[str, Any]:
        return {"micro_batch_tokens": self.spec.trainer.micro_batch_tokens, "device": self.device}

    def compute(self) -> contextlib.AbstractContextManager:
        """The context the step's forwards and backwards run in (``trainer.precision``)."""
        return compute_in(self.spec.trainer.precision, self.device)

    @property
    def spot_check(self) -> int:
        """Rollouts the spot check looks at on this rank (0: off)."""
        r = self.spec.rollout
        return r.spot_check_rollouts if self.ctx.is_main and r.spot_check_tolerance is not None else 0


@dataclass
class StepResult:
    record: StepRecord
    gaps: dict[str, float]  # per engine: |engine - trainer| nats/token (the spot check)
    probe: ProbeResult | None  # what the engines said when asked to score (asyncLevel > 0)


class Clock:
    """Seconds spent per named phase of the step."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.spent: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.spent[phase] += time.perf_counter() - t

    def total(self) -> float:
        return time.perf_counter() - self.start


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    orch: Orchestrator,
    cfg: StepSettings,
    *,
    version: int,
    steps_left: int,
    lr: float,
) -> StepResult:
    """Train on one batch; ``version`` is the global step (the policy version the batch is
    checked against), ``steps_left`` the stage's steps from this one on."""
    clock = Clock()
    max_staleness = orch.max_staleness  # how many versions old a rollout of this step may be
    with clock("sync"):
        push_wait = orch.push(model, version)
    with clock("rollout"):
        groups = orch.acquire(version, steps_left) if cfg.ctx.is_main else []
        parts = advantages(groups, cfg, version, max_staleness=max_staleness) if cfg.ctx.is_main else None
    batch = cfg.ctx.scatter(parts)  # this rank's share (rank 0 did the rollouts and RoC)
    a = cfg.spec.algorithm
    mini_batches = min(a.mini_batches, max(1, len(batch.seqs)))
    # One optimizer step per batch: pi_old is the update's own forward, no separate pass
    on_policy = a.ppo_epochs == 1 and mini_batches == 1
    logprob_gap = 0.0
    with clock("pi_old"), cfg.compute():
        if not on_policy:
            logprob_gap = pi_old(model, batch, cfg)
    with clock("spot_check"), cfg.compute():
        gaps, probe_target = check_engines_before_update(
            model, batch, groups, cfg, version, max_staleness=max_staleness
        )
    with clock("optimizer"), cfg.compute():
        upd = update(model, optimizer, batch, cfg, mini_batches=mini_batches, on_policy=on_policy)
    if on_policy:
        logprob_gap = upd.pop("rollout_logprob_gap", 0.0)
    probe = None
    with clock("spot_check"):
        if probe_target is not None:
            probe = probe_engines(orch.score, probe_target, version, cfg.spot_check)
            gaps = probe.gaps
    if cfg.spot_check:  # FSDP: rank 0's trained share alone (a forward of other rows would be collective)
        gaps = {**engine_gaps(batch), **gaps}
    model.eval()
    rec = record(
        batch, upd, clock, cfg, version=version, lr=lr, logprob_gap=logprob_gap, push_wait=push_wait,
        gaps=gaps, rollout_figures=orch.figures,
    )  # fmt: skip
    return StepResult(rec, gaps, probe)


def advantages(
    groups: list[list[Scored]], cfg: StepSettings, version: int, *, max_staleness: int
) -> list[StepBatch]:
    """RoC selection, advantages (of the length-shaped reward with ``lengthReward``) and the
    zero-advantage filter (``grpo.prepare_batch``), dropping rollouts more than
    ``max_staleness`` versions old; one share per FSDP rank."""
    a = cfg.spec.algorithm
    budget = a.length_reward
    batch = prepare_batch(
        groups,
        a.group_size,
        roc=cfg.algorithm == "grpo-roc",
        seed=cfg.spec.seed + version,
        filter_zero=a.filter_zero_advantage,
        version=version,
        max_staleness=max_staleness,
        length_alpha=budget.alpha if budget is not None else None,
        count_tool_tokens=budget is not None and budget.count_tool_tokens,
    )
    return shard_step_batch(batch, cfg.ctx.world_size) if cfg.ctx.enabled else [batch]


def pi_old(model: torch.nn.Module, batch: StepBatch, cfg: StepSettings) -> float:
    """pi_old by a forward of its own (several optimizer steps per batch); returns the mean gap
    between the engines' sampling log-probs and the trainer's, over the ranks."""
    gap = recompute_old_logprobs(model, batch, dist=cfg.ctx, **cfg.sizes) if batch.seqs else 0.0
    return cfg.ctx.all_reduce([gap])[0] / cfg.ctx.world_size


def update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    cfg: StepSettings,
    *,
    mini_batches: int,
    on_policy: bool,
) -> dict[str, float]:
    """The clipped policy loss's optimizer steps (``grpo.rl_update``); with asyncLevel > 0 the
    engines' sampling log-probs enter as the behaviour policy of the truncated IS weights."""
    a = cfg.spec.algorithm
    return rl_update(
        model,
        optimizer,
        batch,
        cfg.loss,
        grad_clip=a.grad_clip,
        mini_batches=mini_batches,
        ppo_epochs=a.ppo_epochs,
        dist=cfg.ctx,
        tis_cap=a.effective_tis_cap,
        on_policy=on_policy,
        **cfg.sizes,
    )


def check_engines_before_update(
    model: torch.nn.Module,
    batch: StepBatch,
    groups: list[list[Scored]],
    cfg: StepSettings,
    version: int,
    *,
    max_staleness: int,
) -> tuple[dict[str, float], StepBatch | None]:
    """The spot check's part before the update changes the weights: (gaps measured now, rows
    the engines are to score after the update, or None).

    Every rollout from this version (``max_staleness`` 0): the trained rows measure their
    engines once pi_old is known; rollouts of the other engines are rescored here. Rollouts
    that may be older: the engines score rows against pi_old instead, after the update (they
    serve this version until the next step pushes, and a push on its own thread has had the
    update's time to reach them).
    """
    count = cfg.spot_check
    if not count:
        return {}, None
    if max_staleness > 0:  # rows may come from older versions
        if any(map(any, batch.masks)) or cfg.ctx.enabled:
            return {}, batch
        target = spot_rows(groups, None, count)  # nothing trained: any of the step's rollouts
        if target.seqs:
            recompute_old_logprobs(model, target, **cfg.sizes)
        return {}, target
    if cfg.ctx.enabled:
        return {}, None
    probe = spot_rows(groups, version, count, skip=trained_engines(batch))
    if not probe.seqs:
        return {}, None
    recompute_old_logprobs(model, probe, **cfg.sizes)
    return engine_gaps(probe), None


def record(
    batch: StepBatch,
    upd: dict[str, float],
    clock: Clock,
    cfg: StepSettings,
    *,
    version: int,
    lr: float,
    logprob_gap: float,
    push_wait: float,
    gaps: dict[str, float],
    rollout_figures: Callable[[], dict[str, float]],
) -> StepRecord:
    """The step's record: batch statistics, the update's figures, the engines' log-prob gaps, the
    rollout side's figures since the last step (``rollout_figures``) and where the time went."""
    spent = clock.spent
    # pi_old + spot check + update
    update_seconds = clock.total() - spent["sync"] - spent["rollout"]
    figures = {**batch.stats, **upd, **rollout_figures()}
    return StepRecord(
        type="rl",
        step=version + 1,
        algorithm=cfg.algorithm,
        async_level=cfg.spec.algorithm.async_level,
        lr=lr,
        **figure_fields(figures),
        rollout_logprob_gap=logprob_gap,
        rollout_seconds=spent["rollout"],  # waiting for this step's rollouts (all of their time when k = 0)
        update_seconds=update_seconds,
        pi_old_seconds=spent["pi_old"],
        # the engines scoring when k > 0 is a request the busy engines answer
        spot_check_seconds=spent["spot_check"],
        optimizer_seconds=spent["optimizer"],
        # the weight push on the trainer's critical path (with k > 0 the engines go on generating
        # meanwhile; a folder push: the weights' copy and any wait for the push before)
        sync_seconds=spent["sync"],
        push_wait_seconds=push_wait,
        engine_logprob_gap=gaps,
        step_seconds=clock.total(),
    )
