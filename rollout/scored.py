"""What the rollout side hands the trainer: a rollout with its task reward.

The rollout worker scores every trajectory (the sandbox verifies its extracted answer) and
returns groups of :class:`Scored`, one group per prompt; :mod:`kuberl.trainer.grpo` turns them
into a training batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kuberl.rollout.loop import Trajectory


@dataclass
class Scored:
    """A rollout with its binary task reward (truncated rollouts keep reward 0) and the thinking
    budget its prompt asked for, if any (the length reward)."""

    traj: Trajectory
    reward: float
    length_target: int | None = None
