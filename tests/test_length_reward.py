"""Thinking budgets (spec.algorithm.lengthReward, INTELLECT-2 section 3.1.2): the reward against
hand-computed values, RoC selecting on the task reward, the manifest's checks, and a run that
asks for budgets in its prompts and reports how they were kept."""

from __future__ import annotations

import copy
import json

import pytest
from prometheus_client import REGISTRY
from trainer_fakes import FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import ManifestError, parse_resource
from kuberl.rollout.loop import Trajectory
from kuberl.rollout.scored import Scored
from kuberl.trainer import length_reward as lr
from kuberl.trainer.grpo import prepare_batch
from kuberl.trainer.local import run_job
from tests.test_trainer_pipeline import TINY


def _traj(model_tokens: int, tool_tokens: int = 0, *, tool_calls: int = 0) -> Trajectory:
    """A rollout of ``model_tokens`` tokens the model wrote and ``tool_tokens`` of tool output."""
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3] * (model_tokens + tool_tokens),
        loss_mask=[1] * model_tokens + [0] * tool_tokens,
        logprobs=[-0.5] * (model_tokens + tool_tokens),
        turns=1 + (tool_calls > 0),
        tool_calls=tool_calls,
        tool_errors=0,
        format_errors=0,
        answer="1",
        truncated=False,
        finish_reason="answer",
        answer_tags=1,
    )


# -- the pure parts, by hand ---------------------------------------------------------------------


def test_the_penalty_adherence_and_lengths_by_hand():
    assert lr.length_penalty(130, 100, 0.0003) == pytest.approx(0.009)  # 0.0003 * 30
    assert lr.length_penalty(70, 100, 0.01) == pytest.approx(0.3)
    assert lr.length_penalty(100, 100, 1.0) == 0.0
    assert lr.adheres(110, 100) and lr.adheres(90, 100) and not lr.adheres(111, 100)
    mask = [1, 1, 1, 0, 0, 1]
    assert lr.response_length(mask, len(mask), count_tool_tokens=False) == 4  # what the model wrote
    assert lr.response_length(mask, len(mask), count_tool_tokens=True) == 6


def test_targets_are_drawn_from_the_set_the_same_for_the_same_seed():
    drawn = lr.draw_targets([64, 128, 256], 200, seed=7)
    assert drawn == lr.draw_targets([64, 128, 256], 200, seed=7)
    assert drawn != lr.draw_targets([64, 128, 256], 200, seed=8)
    assert set(drawn) == {64, 128, 256}


def test_the_instruction_goes_before_or_after_the_question():
    text = "Think for {target} tokens before giving a response."
    assert lr.budget_prompt("2+2?", text, 64, "after") == "2+2?\nThink for 64 tokens before giving a response."
    assert lr.budget_prompt("2+2?", text, 64, "before") == "Think for 64 tokens before giving a response.\n2+2?"


def test_step_figures_by_hand():
    # (l_y, l_target, penalty): gaps 10, 0, 60, 5
    rows = [(110, 100, 0.1), (100, 100, 0.0), (40, 100, 0.6), (55, 50, 0.05)]
    st = lr.length_stats(rows)
    assert st["length_penalty_mean"] == pytest.approx(0.1875)
    assert st["length_gap_mean"] == pytest.approx(18.75)
    assert st["length_adherence"] == pytest.approx(0.75)  # 110 and 100 within 10 % of 100, 55 of 50
    assert st["length_gap_t100"] == pytest.approx(70 / 3) and st["length_gap_t50"] == pytest.approx(5)
    assert st["length_adherence_t100"] == pytest.approx(2 / 3) and st["length_adherence_t50"] == 1.0
    assert lr.length_stats([]) == {}


# -- the reward in the batch ---------------------------------------------------------------------


def test_advantages_are_of_the_shaped_reward_by_hand():
    """Task rewards 1, 1, 0, 0; lengths 10, 20, 20, 40 against target 20, alpha 0.01: shaped
    rewards 0.9, 1.0, 0.0, -0.2 (mean 0.425, population std 0.530919), so the advantages are
    0.894675, 1.083028, -0.800499, -1.177204."""
    group = [Scored(_traj(n), r, 20) for n, r in ((10, 1.0), (20, 1.0), (20, 0.0), (40, 0.0))]
    sb = prepare_batch([group], 4, roc=False, seed=0, length_alpha=0.01)
    assert sb.advantages == pytest.approx([0.894675, 1.083028, -0.800499, -1.177204], abs=1e-6)
    assert sb.stats["reward_mean"] == 0.5  # the task reward, as without budgets
    assert sb.stats["length_penalty_mean"] == pytest.approx((0.1 + 0 + 0 + 0.2) / 4)
    assert sb.stats["length_gap_t20"] == pytest.approx(7.5)
    assert sb.stats["length_adherence"] == 0.5
    plain = prepare_batch([group], 4, roc=False, seed=0)
    assert plain.advantages == pytest.approx([1, 1, -1, -1], abs=1e-6)
    assert "length_penalty_mean" not in plain.stats


def test_tool_tokens_count_only_when_asked():
    group = [Scored(_traj(20, 30, tool_calls=1), 1.0, 20), Scored(_traj(20), 0.0, 20)]
    own = prepare_batch([group], 2, roc=False, seed=0, length_alpha=0.01)
    assert own.stats["length_gap_mean"] == 0.0  # both wrote exactly 20 tokens themselves
    tools = prepare_batch([group], 2, roc=False, seed=0, length_alpha=0.01, count_tool_tokens=True)
    assert tools.stats["length_gap_t20"] == pytest.approx(15.0)  # 50 - 20 and 20 - 20, over two
    assert tools.stats["length_penalty_mean"] == pytest.approx(0.15)


def test_roc_selects_on_the_task_reward_not_the_shaped_one():
    """Eight rollouts, four correct: RoC keeps two correct ones drawn by p_total and two of the
    wrong ones. The length term may not change which are kept, only their advantages: a correct
    rollout far off its budget still counts as correct."""
    group = [Scored(_traj(n), r, 16) for n, r in ((400, 1.0), (16, 1.0), (300, 1.0), (17, 1.0),
                                                   (16, 0.0), (200, 0.0), (15, 0.0), (100, 0.0))]  # fmt: skip
    shaped = prepare_batch([group], 4, roc=True, seed=3, length_alpha=0.05)
    plain = prepare_batch([group], 4, roc=True, seed=3)
    assert shaped.seqs == plain.seqs  # the same rollouts kept
    kept = [len(seq) - 2 for seq in shaped.seqs]  # each rollout's length is its own
    assert sum(n in (400, 16, 300, 17) for n in kept) == 2  # RoC's positive quota, on r_task
    assert shaped.advantages != plain.advantages
    by_length = dict(zip(kept, shaped.advantages, strict=True))
    assert kept == [400, 17, 200, 100]  # this seed's draw: it keeps the correct one far off budget
    # shaped: 400 -> 1 - 0.05 * 384 = -18.2, 17 -> 0.95, 200 -> -9.2, 100 -> -4.2: a correct
    # rollout far over its budget ends below the wrong ones near theirs
    assert by_length[400] < 0 and by_length[400] < by_length[200] < by_length[100] < by_length[17]


def test_a_group_equal_in_task_reward_still_teaches_the_budget():
    """All correct: no task signal (GRPO drops the group), but the lengths differ from the target,
    so with a length reward the group has advantages and is kept."""
    group = [Scored(_traj(n), 1.0, 32) for n in (32, 64)]
    assert prepare_batch([group], 2, roc=False, seed=0).stats["groups_dropped_zero_adv"] == 1.0
    sb = prepare_batch([group], 2, roc=False, seed=0, length_alpha=0.001)
    assert sb.stats["groups_dropped_zero_adv"] == 0.0 and sb.advantages[0] > 0 > sb.advantages[1]


# -- the manifest --------------------------------------------------------------------------------


def _doc(**length_reward) -> dict:
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"]["lengthReward"] = length_reward
    return doc


@pytest.mark.parametrize(
    ("length_reward", "message"),
    [
        ({"targets": [8, 40]}, "spec.algorithm.lengthReward.targets: target 40 is not below stages[1] ('rl')"),
        ({"targets": [8, 8]}, "spec.algorithm.lengthReward.targets: targets [8, 8] name a length twice"),
        ({"targets": [0]}, "spec.algorithm.lengthReward.targets[0]"),
        ({"targets": []}, "spec.algorithm.lengthReward.targets"),
        ({"targets": [8], "alpha": -0.1}, "spec.algorithm.lengthReward.alpha"),
        ({"targets": [8], "instruction": "Think {budget} tokens"}, "not a template with only {target}"),
        ({"targets": [8], "instruction": "Think briefly"}, "must contain {target}"),
        ({"targets": [8], "position": "middle"}, "spec.algorithm.lengthReward.position"),
        ({"alpha": 0.1}, "spec.algorithm.lengthReward.targets"),
    ],
)
def test_a_bad_length_reward_is_refused_naming_the_field(length_reward, message):
    with pytest.raises(ManifestError) as err:
        parse_resource(_doc(**length_reward))
    assert message in str(err.value)


def test_a_good_length_reward_takes_its_defaults():
    job = parse_resource(_doc(targets=[8, 16]))
    assert isinstance(job, AgenticRLJob)
    budget = job.spec.algorithm.length_reward
    assert (budget.alpha, budget.position, budget.count_tool_tokens) == (0.0003, "after", False)
    assert budget.instruction == "Think for {target} tokens before giving a response."


# -- a run ---------------------------------------------------------------------------------------


def test_a_run_with_budgets_asks_for_them_and_reports_how_they_were_kept(tmp_path, monkeypatch):
    from kuberl.rollout.worker import RolloutWorker

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    monkeypatch.setenv("KUBERL_METRICS_PORT", "0")
    doc = _doc(targets=[8, 16], alpha=0.01, instruction="Use {target} tokens.")
    doc["spec"]["checkpoint"]["uri"] = str(tmp_path / "ck")
    prompts: list[tuple[str, int | None]] = []
    submit = RolloutWorker.submit_rollouts

    def submitting(self, request):
        for prompt, target in zip(request.prompts, request.length_targets or [], strict=True):
            prompts.append((prompt, target))
        return submit(self, request)

    sft_questions: list[str] = []
    build_sft = RolloutWorker.build_sft

    def building(self, problems, **kwargs):
        sft_questions.extend(p.question for p in problems)
        return build_sft(self, problems, **kwargs)

    monkeypatch.setattr(RolloutWorker, "submit_rollouts", submitting)
    monkeypatch.setattr(RolloutWorker, "build_sft", building)
    job = parse_resource(doc)
    run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert prompts and {t for _, t in prompts} <= {8, 16}
    assert all(f"Use {t} tokens." in p for p, t in prompts), prompts[:2]
    # SFT traces start from the same kind of prompt (an instruction beside each question)
    assert sft_questions and all(q.endswith(("Use 8 tokens.", "Use 16 tokens.")) for q in sft_questions)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("type") == "rl"]
    assert len(rl) == 2
    for r in rl:
        targets = {int(k.removeprefix("length_gap_t")) for k in r if k.startswith("length_gap_t")}
        assert targets and targets <= {8, 16}
        assert 0 <= r["length_adherence"] <= 1 and r["length_penalty_mean"] >= 0
        assert r["length_penalty_mean"] == pytest.approx(0.01 * r["length_gap_mean"])
    evals = [r for r in records if r.get("type") == "eval" and r.get("label") == "rl"]
    assert evals and "length_adherence" in evals[-1]
    last = rl[-1]
    assert REGISTRY.get_sample_value(
        "kuberl_train_length_gap_tokens", {"job": "tiny-e2e", "target": "all"}
    ) == pytest.approx(last["length_gap_mean"])
    report = (tmp_path / "out" / "report.html").read_text()
    assert "Thinking budgets: adherence" in report
