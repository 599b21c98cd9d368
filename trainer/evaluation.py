"""Held-out evaluation: sampled (temperature ``rollout.temperature``, one sample) accuracy of the
current policy on the eval set after each stage, its tool-error ratio in correct rollouts and,
with ``algorithm.lengthReward``, how the rollouts kept their thinking budgets."""

from __future__ import annotations

import math

from kuberl.api.job import StageSpec
from kuberl.rollout.scored import Scored
from kuberl.trainer import data as data_mod
from kuberl.trainer import length_reward
from kuberl.trainer.grpo import budget_rows
from kuberl.trainer.stage_host import StageHost
from kuberl.trainer.step_record import StepRecord, figure_fields


def evaluate(pipe: StageHost, stage: StageSpec, label: str) -> float:
    """Sampled (temperature 1.0, one sample) accuracy on the held-out eval set."""
    probs = pipe.problems.eval_problems() if pipe.ctx.is_main else []
    if not pipe.ctx.broadcast(bool(probs)):
        return math.nan
    pipe.sync_weights()
    if pipe.ctx.is_main:
        _evaluate_on(pipe, probs, stage, label)
    pipe.result.evals = pipe.ctx.broadcast(pipe.result.evals)
    return pipe.result.evals[label]


def _evaluate_on(pipe: StageHost, probs: list[data_mod.Problem], stage: StageSpec, label: str) -> None:
    groups = pipe.client.generate(
        pipe.problems.request(
            stage, probs, 1, temperature=pipe.spec.rollout.temperature, seed=pipe.spec.seed * 7919 + 17
        )
    )
    acc = sum(g[0].reward for g in groups) / len(groups)
    pos = [g[0] for g in groups if g[0].reward > 0]
    calls = sum(s.traj.tool_calls for s in pos)
    terr = sum(s.traj.tool_errors for s in pos) / calls if calls else math.nan
    pipe.result.evals[label] = acc
    pipe.result.evals[label + ":tool_error_ratio_positive"] = terr
    budgets = _budget_stats(pipe, [g[0] for g in groups])
    pipe.result.evals.update(
        {f"{label}:{k}": budgets[k] for k in ("length_gap_mean", "length_adherence") if k in budgets}
    )
    pipe.sink.step(
        StepRecord(
            type="eval",
            stage=stage.name,
            step=pipe.state.global_step,
            label=label,
            accuracy=acc,
            tool_error_ratio_positive=terr,
            **figure_fields(budgets),
        )
    )


def _budget_stats(pipe: StageHost, scored: list[Scored]) -> dict[str, float]:
    """How the held-out rollouts kept their thinking budgets ({} without a length reward)."""
    budget = pipe.spec.algorithm.length_reward
    if budget is None:
        return {}
    rows = budget_rows(scored, budget.alpha, budget.count_tool_tokens)
    return length_reward.length_stats(rows)
