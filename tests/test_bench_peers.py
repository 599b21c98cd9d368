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
