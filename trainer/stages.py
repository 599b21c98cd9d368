"""The multi-stage recipe (paper section 4): an SFT stage, then RL stages with their own
response length / turn limits, the stage-3 offline difficulty filter and optimizer resets.

:class:`Pipeline` is the trainer driver. It owns the trainable model and optimizer and talks
to the rollout worker (a Ray actor, or the same object in-process) through a
:class:`~kuberl.rollout.client.RolloutClient`. It sequences the stages and keeps the step
bookkeeping they share; each part of the run is a module of its own: ``sft_stage`` (SFT),
``rl_stage`` (an RL stage's :func:`rl_step.rl_step` calls, their batches owned by an
:class:`~kuberl.rollout.orchestrator.Orchestrator`), ``evaluation`` (held-out accuracy),
``filtering`` (the RL pool and the difficulty filter), ``checkpointing`` (saves, resume, the
run files kept beside the checkpoints) and ``problems`` (pools and rollout requests).
Every step is seeded from (seed, global step) and every rollout from (step seed, prompt,
sample, turn), so a resumed run continues exactly where the checkpoint left off: SFT, the
rollouts' tokens and the update. Tool latency and thread timing change how the engine batches
requests, which moves its log-probs in the last float bits but not the sampled tokens (unless a
uniform lands within ~1e-7 of a token boundary); the update takes pi_old from the trainer in a
fixed layout (its own forward when the step is on-policy, else ``recompute_old_logprobs``), so
it is bitwise reproducible.

Checkpoints: every ``checkpoint.everySteps`` global steps, at the end of each stage after its
eval (so a resumed run neither repeats the eval nor the stage), and when ``deadline`` or a SIGTERM
(the job suspended or preempted: ``kuberl.util.lifetime.stop_at_step_on_signals``) stops the run
at a step boundary.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kuberl.api.job import AgenticRLJob, StageSpec
from kuberl.rollout.client import RolloutClient
from kuberl.trainer.checkpoint import CheckpointStore, TrainState
from kuberl.trainer.checkpointing import Checkpoints
from kuberl.trainer.distributed import DistContext
from kuberl.trainer.evaluation import evaluate
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.metrics import MetricsSink
from kuberl.trainer.model import GPT
from kuberl.trainer.problems import Problems
from kuberl.trainer.rl_stage import RlStage
from kuberl.trainer.sft_stage import SftStage
from kuberl.trainer.stage_host import RunResult
from kuberl.trainer.step_record import StepRecord
from kuberl.trainer.weight_sync import LocalWeights
from kuberl.util.lifetime import stop_requested


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class Pipeline:
    def __init__(
        self,
        job: AgenticRLJob,
        model: GPT,
        tokenizer,
        client: RolloutClient | None,
        store: CheckpointStore,
        sink: MetricsSink,
        *,
        algorithm: str,
        device: torch.device,
        deadline: float | None = None,
        on_progress: Callable[[str, int, int, StepRecord], None] | None = None,
        weights: Any = None,
        ctx: DistContext | None = None,
    ):
        """``weights.sync(model, version)`` brings the rollout engines up to date before every
        rollout batch (default: the state dict to the worker's local engine, ``LocalWeights``).

        ``ctx``: FSDP ranks (see :mod:`kuberl.trainer.distributed`). Every rank runs this same
        loop in lockstep; rank 0 alone holds the rollout worker (``client``; None elsewhere), the
        store writes and the sink, and decides what the others must agree on (time limit,
        filters, evals).
        """
        self.ctx = ctx or DistContext()
        self.job = job
        self.spec = job.spec
        self.model = model
        self.tok = tokenizer
        self.client = client
        self.weights = weights if weights is not None else LocalWeights(client, self.ctx)
        self.store = store
        self.sink = sink
        self.algorithm = algorithm
        self.device = device
        self.deadline = deadline
        self.on_progress = on_progress or (lambda *a: None)
        self.state = TrainState()
        self.optimizer = self.new_optimizer(self.stage_lr(self.spec.stages[0]))
        self.result = RunResult()
        a = self.spec.algorithm
        self.loss_cfg = LossConfig(
            clip_low=a.clip.low,
            clip_high=a.clip.high,
            negative_ratio_cap=a.clip.negative_ratio_cap,
            kl_coef=a.kl_coef,
            entropy_coef=a.entropy_coef,
            aggregation=a.loss_aggregation,
        )
        if a.kl_coef > 0:
            raise ValueError(
                "algorithm.klCoef > 0 is not supported by the local trainer (no reference model)"
            )
        self.problems = Problems(self.spec)
        self.checkpoints = Checkpoints(self)
        self._sft = SftStage(self)
        self._rl = RlStage(self)

    # -- step bookkeeping the stages share ---------------------------------------------------

    def stage_lr(self, stage: StageSpec) -> float:
        return stage.learning_rate or self.spec.algorithm.learning_rate

    def new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def set_lr(self, stage: StageSpec, step: int) -> float:
        warm = self.spec.algorithm.warmup_steps
        lr = self.stage_lr(stage) * (min(1.0, (step + 1) / warm) if warm > 0 else 1.0)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def seed_step(self) -> None:
        """Python, NumPy and torch seeded from (seed, global step): a resumed step draws the same."""
        seed_everything(self.spec.seed * 1_000_003 + self.state.global_step)

    def out_of_time(self) -> bool:
        """Whether to stop at this step boundary: the deadline passed, or a SIGTERM asked (rank 0
        decides for every rank, so they all stop at the same step)."""
        late, signalled = self.ctx.broadcast(
            (self.deadline is not None and time.time() > self.deadline, stop_requested())
        )
        self.result.interrupted = self.result.interrupted or signalled
        return bool(late or signalled)

    def sync_weights(self) -> None:
        self.weights.sync(self.model, self.state.global_step)

    def after_step(self, stage: StageSpec, rec: StepRecord) -> None:
        self.state.stage_step += 1
        self.state.global_step += 1
        rec = dataclasses.replace(
            rec, stage=stage.name, step=self.state.global_step, stage_step=self.state.stage_step
        )
        self.result.history.append(rec)
        self.sink.step(rec)
        self.on_progress(stage.name, self.state.stage_step, stage.steps, rec)
        last = self.state.stage_step == stage.steps  # saved after the stage's eval instead
        if self.state.global_step % self.spec.checkpoint.every_steps == 0 and not last:
            self.checkpoints.save(stage)

    # -- the parts of the run -----------------------------------------------------------------

    def evaluate(self, stage: StageSpec, label: str) -> float:
        return evaluate(self, stage, label)

    def checkpoint_unless_saved(self, stage: StageSpec) -> None:
        self.checkpoints.save_unless_saved(stage)

    def resume(self, payload: dict[str, Any] | None = None) -> bool:
        """Continue from ``payload`` (default: the store's newest checkpoint); False if none."""
        return self.checkpoints.resume(payload)

    # -- the stages ---------------------------------------------------------------------------

    def run(self) -> RunResult:
        stages = self.spec.stages
        while self.state.stage_index < len(stages):
            stage = stages[self.state.stage_index]
            if self.state.stage_step == 0:
                self.sink.event(
                    "stage", f"stage {stage.name} ({stage.type}) starts", stage.name, self.state.global_step
                )
            if stage.type == "sft":
                self._sft.run(stage)
            else:
                self._rl.run(stage)
            if self.result.stopped_early:
                break
            self.state.stage_index += 1
            self.state.stage_step = 0
            self.state.cursor = 0
            nxt = stages[self.state.stage_index] if self.state.stage_index < len(stages) else None
            if nxt is not None and (nxt.reset_optimizer or nxt.type != stage.type):
                self.optimizer = self.new_optimizer(self.stage_lr(nxt))
                self.sink.event(
                    "stage", f"optimizer reset before {nxt.name}", nxt.name, self.state.global_step
                )
        self.sink.event(
            "done",
            "run finished"
            if not self.result.stopped_early
            else "stopped by SIGTERM (suspended, preempted or evicted); resumes from the checkpoint"
            if self.result.interrupted
            else "stopped at the time limit",
            None,
            self.state.global_step,
        )
        self.checkpoints.keep_events()
        return self.result
