"""bench/peers.py's pure pieces: the kuberl manifest it derives, the TRL settings mapped from it,
the chat template that renders kuberl's compact format for TRL, and the step figures."""

import importlib.util
import json
import math
from pathlib import Path

import jinja2.sandbox
import pytest

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import parse_resource
from kuberl.rollout import template

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peers = _load("peers")
peers_trl = _load("peers_trl")


def _job(**kw) -> AgenticRLJob:
    m = peers.rl_manifest(
        peers.load_base(), "/models/sft", steps=5, seed=3, engine="vllm", prompts=4, group=8, **kw
    )
    job = parse_resource(m)
    assert isinstance(job, AgenticRLJob)
    return job


def test_rl_manifest_keeps_only_the_rl_stage_as_plain_grpo_from_the_sft_folder():
    job = _job(heldout="/data/heldout.jsonl")
    s = job.spec
    assert [(st.type, st.steps) for st in s.stages] == [("rl", 5)]
    assert s.model.base == "/models/sft" and s.seed == 3
    assert (s.algorithm.name, s.algorithm.group_size, s.algorithm.batch_prompts) == ("grpo", 8, 4)
    assert s.algorithm.oversample == 1.0  # plain GRPO keeps what it samples, as TRL does
    assert s.data.eval == ["/data/heldout.jsonl"]
    assert s.checkpoint.every_steps > 5  # no checkpoint inside the measured steps
    # one forward of the whole batch, as TRL's gradient_accumulation_steps 1 (the example micro-batches)
    assert peers.load_base()["spec"]["trainer"]["microBatchTokens"] and s.trainer.micro_batch_tokens is None
    # the real-model example's settings are kept
    assert (s.rollout.max_turns, s.rollout.max_response_tokens, s.algorithm.learning_rate) == (3, 160, 1e-5)
    local = peers.rl_manifest(peers.load_base(), "/m", steps=2, seed=0, engine="local", prompts=1, group=2)
    assert local["spec"]["rollout"]["engine"] == "local" and "fleet" not in local["spec"]["rollout"]


def test_trl_settings_map_every_training_setting_one_to_one():
    job = _job()
    s = peers.trl_settings(job, "/models/sft", "http://sb", 2)
    a, c = job.spec.algorithm, s["grpo_config"]
    assert c["per_device_train_batch_size"] == 4 * 8 and c["num_generations"] == 8
    assert c["gradient_accumulation_steps"] == 1 and c["steps_per_generation"] == a.mini_batches
    assert c["num_iterations"] == a.ppo_epochs and c["max_steps"] == 5
    assert (c["epsilon"], c["epsilon_high"]) == (a.clip.low, a.clip.high) == (0.2, 0.28)
    assert c["beta"] == a.kl_coef == 0.0 and c["loss_type"] == "dapo"  # token-mean over the batch
    assert c["max_completion_length"] == 160 and c["max_tool_calling_iterations"] == 2  # 3 turns
    assert c["learning_rate"] == s["learning_rate"] == 1e-5 and s["warmup_steps"] == a.warmup_steps
    assert c["max_grad_norm"] == a.grad_clip and c["temperature"] == 1.0 and c["top_k"] == 0
    assert c["shuffle_dataset"] is False and c["seed"] == 3
    # the same prompt pool as kuberl's first RL stage: steps x prompts problems, seed data.seed + 1000
    assert (s["pool_size"], s["pool_seed"], s["data"]) == (20, 1000, "builtin:arith")
    assert c["bf16"] is False and job.spec.trainer.precision == "float32"  # the example's, both sides
    bf16 = _job(precision="bf16")
    assert bf16.spec.trainer.precision == "bf16" and peers.trl_settings(bf16, "/m", "", 2)["grpo_config"]["bf16"]


def test_trl_settings_refuse_what_trl_cannot_do():
    job = _job()
    roc = job.model_copy(deep=True)
    roc.spec.algorithm.name = "grpo-roc"
    with pytest.raises(ValueError, match="TRL has no grpo-roc"):
        peers.trl_settings(roc, "/m", "", 2)
    agg = job.model_copy(deep=True)
    agg.spec.algorithm.loss_aggregation = "seq-mean-token-sum"
    with pytest.raises(ValueError, match="loss_type"):
        peers.trl_settings(agg, "/m", "", 2)


def _render(messages: list[dict], add_generation_prompt: bool) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = json.dumps
    return env.from_string(peers_trl.COMPACT_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


def test_trl_chat_template_renders_kuberls_compact_format():
    user = [{"role": "user", "content": "12*34=?"}]
    assert _render(user, True) == template.render_prompt("12*34=?", "compact")
    call = {
        "type": "function",
        "function": {"name": template.TOOL_NAME, "arguments": {"code": "print(1)", "input": ""}},
    }
    turn = [{"role": "assistant", "content": "<reason>x</reason>", "tool_calls": [call]}]
    tools = [{"role": "tool", "name": template.TOOL_NAME, "content": c} for c in ("408\n", "err")]
    prefix = _render(user + turn, False)
    full = _render(user + turn + tools, True)
    assert prefix.endswith(template.IM_END)  # TRL slices the tool suffix at the assistant's EOS
    assert (
        prefix
        == template.render_prompt("12*34=?", "compact")
        + "<reason>x</reason>"
        + template.render_tool_call("print(1)")
        + template.IM_END
    )
    assert full == prefix + template.render_tool_responses(["408\n", "err"])


def test_answer_comes_from_the_models_turns_only():
    msgs = [
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "<answer>\\boxed{1}</answer>"},
        {"role": "assistant", "content": "<answer>\\boxed{408}</answer>"},
    ]
    assert peers_trl.completion_answer(msgs) == "408"
    assert peers_trl.completion_answer(msgs[:2]) is None


def test_step_figures_leave_out_the_warm_up_step_and_convert_kuberl_records():
    metrics = [
        {"type": "eval", "accuracy": 0.5},
        {"type": "rl", "step": 1, "step_seconds": 50.0, "rollout_seconds": 40.0, "rollouts": 32, "tokens": 900.0},
        {"type": "rl", "step": 2, "step_seconds": 10.0, "rollout_seconds": 6.0, "rollouts": 32, "tokens": 800.0,
         "tool_seconds": 3.0, "reward_mean": 0.5, "sync_seconds": 1.0},
        {"type": "rl", "step": 3, "step_seconds": 10.0, "rollout_seconds": 8.0, "rollouts": 32, "tokens": 1.0,
         "skipped": True, "rollouts_kept": 16},
    ]  # fmt: skip
    steps = peers.kuberl_steps(metrics)
    assert [r["update_seconds"] for r in steps] == [10.0, 4.0, 2.0]
    assert steps[2]["tokens"] == 0.0  # a skipped step trained nothing
    f = peers.side_figures(steps)
    assert f["step_s"] == 10.0 and f["steps_per_s"] == 0.1
    assert f["generation_s"] == 7.0 and f["update_s"] == 3.0 and f["tool_s"] == 1.5
    assert f["push_s"] == 0.5  # the push, part of the update, on its own (a record without it: 0)
    assert f["samples_per_s"] == 64 / 20.0
    assert f["trainer_tok_per_s"] == 800.0 / 6.0
    # equal work: rows the update trained (kept rows; a skipped step none; older records: rollouts)
    assert [r["rows"] for r in steps] == [32.0, 32.0, 0.0]
    assert f["rows_per_s"] == 32 / 20.0 and f["update_s_per_row"] == 6.0 / 32


def test_equal_work_pairs_only_steps_where_both_sides_trained_the_same_rows():
    ours = [{"rows": 16, "step_seconds": 99.0}, {"rows": 16, "step_seconds": 10.0},
            {"rows": 8, "step_seconds": 6.0}, {"rows": 16, "step_seconds": 20.0}]
    theirs = [{"rows": 16, "step_seconds": 1.0}, {"rows": 16, "step_seconds": 15.0},
              {"rows": 16, "step_seconds": 14.0}, {"rows": 16, "step_seconds": 30.0}]  # fmt: skip
    ratio, n = peers.full_step_ratio(ours, theirs)
    assert n == 2 and ratio == 45.0 / 30.0  # warm-up step and the step with 8 rows left out
    assert math.isnan(peers.full_step_ratio(ours[:1], theirs[:1])[0])
    assert math.isnan(peers.side_figures([])["step_s"])


# -- time to accuracy (issue 41 item 1) --------------------------------------------------------

curves = _load("peers_curves")
peers_report = _load("peers_report")


def test_user_manifest_keeps_the_examples_rl_settings_as_written():
    m = peers.user_manifest(
        peers.load_base(), "/models/sft", steps=6, seed=2, heldout="/h.jsonl", async_level=1, precision="bf16"
    )
    job = parse_resource(m)
    s, a = job.spec, job.spec.algorithm
    assert [(st.type, st.steps) for st in s.stages] == [("rl", 6)] and s.model.base == "/models/sft"
    assert (a.name, a.group_size, a.oversample, a.batch_prompts) == ("grpo-roc", 4, 2.0, 4)  # RoC on
    assert a.async_level == 1 and s.trainer.precision == "bf16" and s.data.eval == ["/h.jsonl"]
    assert s.trainer.micro_batch_tokens == 1024 and s.checkpoint.every_steps > 6 and s.seed == 2


def test_trl_user_settings_share_the_job_and_leave_the_rest_to_trls_defaults():
    m = peers.user_manifest(
        peers.load_base(), "/m", steps=6, seed=2, heldout="/h.jsonl", async_level=1, precision="bf16"
    )
    job = parse_resource(m)
    s = peers.trl_user_settings(job, "/m", 2, horizon=40)
    c = s["grpo_config"]
    # 4 prompts x G 4 rows an optimizer step (and a generation batch), one group per forward
    assert c["num_generations"] == 4 and c["per_device_train_batch_size"] * c["gradient_accumulation_steps"] == 16
    assert c["per_device_train_batch_size"] == 4
    assert c["learning_rate"] == 1e-5 and c["temperature"] == 1.0 and c["max_completion_length"] == 160
    assert c["max_tool_calling_iterations"] == 2 and c["bf16"] is False and c["max_steps"] == 40
    assert s["stop_after"] == 6 and s["save_policies"] and s["kuberl_optimizer"] is False
    assert (s["pool_size"], s["pool_seed"]) == (24, 1000)
    # TRL's own defaults stay: no clip, loss, optimizer or schedule settings are passed
    assert not {"epsilon", "epsilon_high", "loss_type", "beta", "max_grad_norm", "num_iterations"} & set(c)
    with pytest.raises(ValueError, match="horizon"):
        peers.trl_user_settings(job, "/m", 2, horizon=5)


def test_clocks_count_from_the_first_steps_start():
    metrics = [
        {"type": "eval", "time": 5.0},
        {"type": "rl", "step": 1, "time": 1000.0, "step_seconds": 40.0},
        {"type": "rl", "step": 2, "time": 1030.0, "step_seconds": 25.0},  # 5 s between steps count
    ]
    assert peers.kuberl_clock(metrics) == {1: 40.0, 2: 70.0}
    no_time = [{k: v for k, v in r.items() if k != "time"} for r in metrics]
    assert peers.kuberl_clock(no_time) == {1: 40.0, 2: 65.0}
    assert peers.trl_clock([{"step": 1, "step_seconds": 3.0}, {"step": 2, "step_seconds": 4.5}]) == {1: 3.0, 2: 7.5}


def test_policies_scored_are_every_kth_step_and_the_last():
    assert peers.eval_steps([0, 3, 1, 2, 5, 4], 2) == [2, 4, 5]
    assert peers.eval_steps([1, 2, 3], 1) == [1, 2, 3]
    assert peers.policy_step("v00000007") == 7 and peers.policy_step("step-0012") == 12
    with pytest.raises(ValueError, match="saved policy"):
        peers.policy_step("tmp")
    with pytest.raises(ValueError, match="eval-every"):
        peers.eval_steps([1], 0)


def test_curve_starts_at_the_sft_point_in_clock_order():
    c = curves.build_curve(0.1, {1: 30.0, 2: 55.0, 3: 90.0}, {3: 0.8, 1: 0.5})
    assert c == [(0.0, 0.1), (30.0, 0.5), (90.0, 0.8)]
    with pytest.raises(ValueError, match="no clock reading"):
        curves.build_curve(0.1, {1: 30.0}, {1: 0.5, 2: 0.6})


def test_time_to_reach_is_the_first_policy_at_or_above_the_target_else_missed():
    c = [(0.0, 0.1), (30.0, 0.5), (60.0, 0.85), (90.0, 0.8)]
    assert curves.time_to_reach(c, 0.8) == 60.0  # not interpolated between 30 s and 60 s
    assert curves.time_to_reach(c, 0.85) == 60.0  # reached exactly
    assert curves.time_to_reach(c, 0.8 + 0.05 - 1e-12) == 60.0  # float sums of k/n
    assert curves.time_to_reach(c, 0.9) is None  # never reached: a miss
    assert curves.time_to_reach(c, 0.05) == 0.0  # the start already is


def test_accuracy_at_holds_the_last_policy_until_the_next():
    c = [(0.0, 0.1), (30.0, 0.5), (60.0, 0.8)]
    assert curves.accuracy_at(c, 0.0) == 0.1 and curves.accuracy_at(c, 29.9) == 0.1
    assert curves.accuracy_at(c, 30.0) == 0.5 and curves.accuracy_at(c, 59.0) == 0.5
    assert curves.accuracy_at(c, 60.0) == 0.8
    assert curves.accuracy_at(c, 60.5) is None and curves.accuracy_at(c, -1.0) is None  # outside the run


def test_curves_align_at_equal_wall_clock_up_to_the_shorter_run():
    ours = [(0.0, 0.1), (30.0, 0.5), (60.0, 0.8)]
    theirs = [(0.0, 0.1), (50.0, 0.6), (100.0, 0.9)]
    assert curves.aligned(ours, theirs) == [(0.0, 0.1, 0.1), (30.0, 0.5, 0.1), (50.0, 0.5, 0.6), (60.0, 0.8, 0.6)]
    eq = curves.equal_clock(ours, theirs)
    # 0-30 equal, 30-50 ahead by 0.4, 50-60 behind by 0.1: 50 of 60 s at least as accurate
    assert eq["span_s"] == 60.0 and eq["share_at_least"] == pytest.approx(50 / 60)
    assert eq["mean_gap"] == pytest.approx((0.4 * 20 - 0.1 * 10) / 60)
    assert curves.equal_clock(theirs, theirs) == {"share_at_least": 1.0, "mean_gap": 0.0, "span_s": 100.0}
    assert math.isnan(curves.equal_clock([(0.0, 0.1)], theirs)["mean_gap"])  # nothing after the start


def test_seed_summary_and_goals():
    trl = [(0.0, 0.1), (100.0, 0.7), (200.0, 0.875)]
    fast = [(0.0, 0.1), (60.0, 0.8), (120.0, 0.9)]
    s = peers_report.seed_summary(trl, fast)
    assert s["target"] == 0.875 and s["ours_s"] == 120.0 and s["ratio"] == 0.6 and s["ratio_first"] == 0.6
    assert peers_report.goals([s]) == (True, True)
    slow = [(0.0, 0.1), (150.0, 0.875)]
    s2 = peers_report.seed_summary(trl, slow)
    assert s2["ratio"] == 0.75 and peers_report.goals([s, s2]) == (False, False)  # 0.75 > 2/3; behind at 100 s
    never = peers_report.seed_summary(trl, [(0.0, 0.1), (300.0, 0.86)])
    assert never["ours_s"] is None and never["ratio"] is None and not peers_report.goals([never])[0]
    flat = peers_report.seed_summary([(0.0, 0.1), (100.0, 0.1)], fast)
    assert flat["ours_s"] == 0.0 and not flat["trl_improved"] and not peers_report.goals([flat])[0]
    edge = peers_report.seed_summary(trl, [(0.0, 0.1), (100.0, 0.7), (400 / 3, 0.875)])
    assert peers_report.goals([edge])[0]  # exactly 2/3 meets the goal


def test_chart_has_each_sides_mean_and_every_seed():
    c = curves.chart({"TRL": [[(0.0, 0.1), (100.0, 0.8)]], "kuberl": [[(0.0, 0.1), (50.0, 0.9)]]}, "t")
    assert [s.name for s in c.series] == ["TRL mean", "kuberl mean", "TRL seed 0", "kuberl seed 0"]
    mean = dict(c.series[1].points)
    assert mean[0.0] == 0.1 and mean[50.0] == 0.9  # the mean is drawn up to the shortest run's end
    assert curves.mean_curve([[(0.0, 0.0), (10.0, 1.0)], [(0.0, 0.0), (20.0, 0.5)]], points=3) == [
        (0.0, 0.0), (5.0, 0.0), (10.0, 0.5)
    ]  # fmt: skip
    assert "<svg" in curves.page(c, "caption") and "kuberl seed 0" in curves.page(c, "caption")
