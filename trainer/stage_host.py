"""What the parts of a run share: the :class:`StageHost` that the SFT stage, the RL stages,
evaluation, the difficulty filter and the checkpoints work on, and the run's :class:`RunResult`.

:class:`~kuberl.trainer.stages.Pipeline` is the host: it owns the model, the optimizer and
where the run is, and keeps the step bookkeeping every stage shares (learning rate, seeding,
the time limit, recording a finished step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kuberl.api.job import AgenticRLJob, AgenticRLJobSpec, StageSpec
from kuberl.rollout.client import RolloutClient
from kuberl.trainer.checkpoint import CheckpointStore, TrainState
from kuberl.trainer.distributed import DistContext
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.metrics import MetricsSink
from kuberl.trainer.model import GPT
from kuberl.trainer.problems import Problems
from kuberl.trainer.step_record import StepRecord


@dataclass
class RunResult:
    history: list[StepRecord] = field(default_factory=list)
    evals: dict[str, float] = field(default_factory=dict)  # "<stage>": sampled accuracy after it
    stopped_early: bool = False
    interrupted: bool = False  # stopped by SIGTERM (suspend, preemption, eviction), not the deadline


class StageHost(Protocol):
    """The run the stage parts read and advance (see :class:`~kuberl.trainer.stages.Pipeline`)."""

    job: AgenticRLJob
    spec: AgenticRLJobSpec
    model: GPT
    tok: Any
    client: RolloutClient | None
    weights: Any
    store: CheckpointStore
    sink: MetricsSink
    algorithm: str
    device: torch.device
    ctx: DistContext
    loss_cfg: LossConfig
    state: TrainState
    optimizer: torch.optim.Optimizer
    result: RunResult
    problems: Problems

    def stage_lr(self, stage: StageSpec) -> float: ...

    def new_optimizer(self, lr: float) -> torch.optim.Optimizer: ...

    def set_lr(self, stage: StageSpec, step: int) -> float: ...

    def seed_step(self) -> None: ...

    def out_of_time(self) -> bool: ...

    def sync_weights(self) -> None: ...

    def after_step(self, stage: StageSpec, rec: StepRecord) -> None: ...

    def evaluate(self, stage: StageSpec, label: str) -> float: ...

    def checkpoint_unless_saved(self, stage: StageSpec) -> None: ...
