"""The problems a run samples from and the rollout requests made of them: the training and
held-out pools (loaded once per source, size and seed), thinking-budget prompts
(``algorithm.lengthReward``) and a stage's :class:`~kuberl.rollout.loop.BatchRequest`."""

from __future__ import annotations

import dataclasses
from typing import Any

from kuberl.api.job import AgenticRLJobSpec, StageSpec
from kuberl.rollout import template
from kuberl.rollout.loop import BatchRequest
from kuberl.trainer import data as data_mod
from kuberl.trainer import length_reward

EVAL_SIZE = 256  # held-out problems in the builtin eval set


class Problems:
    def __init__(self, spec: AgenticRLJobSpec):
        self.spec = spec
        self._pools: dict[str, list[data_mod.Problem]] = {}

    def pool(self, source: str, n: int, seed: int) -> list[data_mod.Problem]:
        key = f"{source}|{n}|{seed}"
        if key not in self._pools:
            self._pools[key] = data_mod.load_problems(source, n, seed)
        return self._pools[key]

    def eval_problems(self) -> list[data_mod.Problem]:
        d = self.spec.data
        sources = d.eval or (["builtin:arith"] if d.train == "builtin:arith" else [])
        out: list[data_mod.Problem] = []
        for s in sources:
            out += self.pool(s, EVAL_SIZE, d.seed + data_mod.EVAL_SEED_OFFSET)
        return out

    def with_budgets(
        self, probs: list[data_mod.Problem], seed: int
    ) -> tuple[list[data_mod.Problem], list[int] | None]:
        """With ``algorithm.lengthReward``: each problem with a drawn target's instruction beside
        its question, and the targets; else the problems as they are and None."""
        budget = self.spec.algorithm.length_reward
        if budget is None:
            return probs, None
        targets = length_reward.draw_targets(budget.targets, len(probs), seed)
        budgeted = [
            dataclasses.replace(
                p, question=length_reward.budget_prompt(p.question, budget.instruction, t, budget.position)
            )
            for p, t in zip(probs, targets, strict=True)
        ]
        return budgeted, targets

    def request(
        self, stage: StageSpec, probs: list[data_mod.Problem], n: int, *, seed: int, **sampling: Any
    ) -> BatchRequest:
        """``n`` rollouts of each problem under the stage's turn and response limits; with
        ``algorithm.lengthReward`` each problem's prompt asks for a target length drawn from
        ``seed``."""
        probs, targets = self.with_budgets(probs, seed)
        return BatchRequest(
            [template.render_prompt(p.question, self.spec.rollout.prompt_template) for p in probs],
            [p.answer for p in probs],
            n,
            max_turns=self.spec.stage_max_turns(stage),
            max_response_tokens=self.spec.stage_max_response_tokens(stage),
            seed=seed,
            length_targets=targets,
            **sampling,
        )
