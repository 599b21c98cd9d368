"""End to end: SFT then GRPO-RoC RL steps, metrics/events files, prometheus gauges, CLI wiring.

``test_run_file_real_sandbox_and_ray`` is the whole default path of ``kuberl run``: a Ray
actor rollout worker (LocalEngine + Scheduler + SandboxClient), the real sandbox subprocess
executing the tool calls and verifying answers, and the trainer in the driver.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.trainer.grpo import Scored, prepare_batch
from kuberl.trainer.local import run_file, run_job, summarize
from tests.trainer_fakes import FakeSandbox

TINY = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "AgenticRLJob",
    "metadata": {"name": "tiny-e2e"},
    "spec": {
        "model": {
            "base": "builtin:tiny-gpt",
            "tokenizer": "builtin:arith-bpe",
            "config": {"nLayer": 1, "nEmbd": 32, "nHead": 2},
        },
        "data": {"train": "builtin:arith"},
        "algorithm": {"groupSize": 2, "learningRate": 0.001, "warmupSteps": 1, "batchPrompts": 2},
        "rollout": {"engine": "local", "maxTurns": 3, "maxResponseTokens": 48, "promptTemplate": "compact"},
        "sandbox": {"pool": {"replicas": 1, "workersPerPod": 2, "limits": {"timeoutSeconds": 5}}},
        "stages": [
            {"name": "sft", "type": "sft", "steps": 4, "learningRate": 0.003, "batchSize": 4},
            {"name": "rl", "type": "rl", "steps": 2, "maxResponseTokens": 40},
        ],
        "trainer": {"device": "cpu", "threads": 1},
        "checkpoint": {"uri": "ck", "everySteps": 50, "keep": 1},
    },
}


def _write(tmp_path, doc) -> str:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    return str(f)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pipeline_in_process_metrics_and_events(tmp_path, monkeypatch):
    monkeypatch.setattr("kuberl.trainer.stages.EVAL_SIZE", 8)
    monkeypatch.setenv("KUBERL_METRICS_PORT", "0")
    job = find_one(load_manifests(_write(tmp_path, TINY)), AgenticRLJob)
    res = run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    steps = _lines(tmp_path / "out" / "metrics.jsonl")
    rl = [s for s in steps if s.get("type") == "rl"]
    assert [s["type"] for s in steps if s.get("type") != "eval"] == ["sft"] * 4 + ["rl"] * 2
    assert rl[0]["rollouts"] == 2 * 4  # 2 prompts x 2G
    for key in (
        "reward_mean",
        "clip_low",
        "clip_high",
        "response_clip_ratio",
        "response_length",
        "groups_dropped_zero_adv",
        "step_seconds",
    ):
        assert key in rl[0], key
    kinds = [e["kind"] for e in _lines(tmp_path / "out" / "events.jsonl")]
    assert kinds[0] == "metrics" and "stage" in kinds and "checkpoint" in kinds and kinds[-1] == "done"
    evals = [s for s in steps if s.get("type") == "eval"]
    assert [e["label"] for e in evals] == ["sft", "rl"]
    s = summarize(res)
    assert s["rl_steps"] == 2 and 0 <= s["final_accuracy"] <= 1
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("kuberl_train_step", {"job": "tiny-e2e", "stage": "rl"}) == 6
    assert REGISTRY.get_sample_value("kuberl_train_response_length_tokens", {"job": "tiny-e2e"}) > 0


def test_prepare_batch_roc_vs_grpo():
    from kuberl.rollout.loop import Trajectory

    def traj(errors, calls=2):
        return Trajectory(
            [1, 2],
            [3, 4, 5],
            [1, 0, 1],
            [-0.1, 0.0, -0.2],
            2,
            calls,
            errors,
            0,
            "7",
            False,
            "answer",
            text="<answer>7</answer>",
            answer_tags=1,
        )

    group = [Scored(traj(2), 1.0)] * 4 + [Scored(traj(0), 1.0)] * 2 + [Scored(traj(0), 0.0)] * 2
    roc = prepare_batch([group], 4, roc=True, seed=0)
    assert roc.stats["rollouts_kept"] == 4
    assert roc.stats["tool_error_ratio_positive"] == pytest.approx(8 / 12)
    assert roc.stats["tool_error_ratio_positive_kept"] < roc.stats["tool_error_ratio_positive"]
    assert sorted(roc.advantages) == pytest.approx([-math.sqrt(3)] + [1 / math.sqrt(3)] * 3)
    assert roc.masks[0] == [0, 0, 1, 0, 1] and roc.old_logprobs[0] == [0.0, 0.0, -0.1, 0.0, -0.2]
    allpos = prepare_batch([[Scored(traj(0), 1.0)] * 4], 2, roc=False, seed=0)
    assert allpos.seqs == [] and allpos.stats["groups_dropped_zero_adv"] == 1
    # Aborted rollouts (engine errors) are dropped before RoC, never trained on, and counted.
    aborted = dataclasses.replace(traj(0), finish_reason="abort", error="sgl-0: SGLangError: HTTP 503")
    mixed = prepare_batch(
        [[Scored(aborted, 1.0)] * 3 + [Scored(traj(0), 1.0), Scored(traj(0), 0.0)]], 4, roc=True, seed=0
    )
    assert mixed.stats["rollouts"] == 5 and mixed.stats["rollouts_aborted"] == 3
    assert mixed.stats["rollouts_kept"] == 2 and mixed.stats["reward_mean"] == 0.5


def test_run_file_errors(tmp_path, capsys):
    assert run_file(str(tmp_path / "missing.yaml")) == 2
    bad = dict(TINY, spec=dict(TINY["spec"], model={"base": "Qwen/Qwen3-14B"}))
    assert run_file(_write(tmp_path, bad), out_dir=str(tmp_path / "o")) == 2
    assert "builtin:tiny-gpt" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_run_file_real_sandbox_and_ray(tmp_path, monkeypatch):
    pytest.importorskip("kuberl.sandbox.local", reason="the sandbox component is not in this checkout yet")
    monkeypatch.setattr("kuberl.trainer.stages.EVAL_SIZE", 8)
    monkeypatch.delenv("KUBERL_NO_RAY", raising=False)
    monkeypatch.delenv("KUBERL_SANDBOX_URL", raising=False)
    out = tmp_path / "run"
    assert run_file(_write(tmp_path, TINY), out_dir=str(out), ablation="grpo") == 0
    steps = _lines(out / "metrics.jsonl")
    rl = [s for s in steps if s.get("type") == "rl"]
    assert len(rl) == 2 and all(s["algorithm"] == "grpo" and s["rollouts"] == 4 for s in rl)
    assert (out / "checkpoints").is_dir() and (out / "tokenizer.json").is_file()
    assert [s["label"] for s in steps if s.get("type") == "eval"] == ["sft", "rl"]


def test_stage3_difficulty_filter_and_optimizer_reset(tmp_path, monkeypatch):
    """Problems solved k/k by the current policy are dropped; the optimizer is reset before stage 3."""
    from kuberl.rollout.loop import Trajectory
    from kuberl.trainer.checkpoint import CheckpointStore
    from kuberl.trainer.metrics import MetricsSink
    from kuberl.trainer.model import GPT, GPTConfig
    from kuberl.trainer.stages import Pipeline
    from kuberl.trainer.tokenizer import load_tokenizer

    doc = json.loads(json.dumps(TINY))
    doc["spec"]["stages"] = [
        {"name": "stage-2", "type": "rl", "steps": 1},
        {
            "name": "stage-3",
            "type": "rl",
            "steps": 2,
            "batchSize": 4,
            "resetOptimizer": True,
            "difficultyFilter": {"rollouts": 3, "dropIfAllCorrect": True},
        },
    ]
    job = find_one(load_manifests(_write(tmp_path, doc)), AgenticRLJob)
    tok = load_tokenizer("builtin:arith-bpe", tmp_path)
    calls = []

    def call(name, *args, **kwargs):
        calls.append((name, args, kwargs))
        if name != "rollouts":
            return None
        prompts, golds, n = args
        # problem i is solved by rollout j iff j < i % 4: i % 4 == 3 -> 3/3 solved -> dropped
        return [
            [
                Scored(
                    Trajectory([1], [2], [1], [0.0], 1, 1, 0, 0, "x", False, "answer", text="<answer>"),
                    1.0 if j < i % 4 else 0.0,
                )
                for j in range(n)
            ]
            for i in range(len(prompts))
        ]

    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2))
    pipe = Pipeline(
        job,
        model,
        tok,
        call,
        CheckpointStore(str(tmp_path / "ck")),
        MetricsSink("t", tmp_path),
        algorithm="grpo-roc",
        device="cpu",
    )
    monkeypatch.setattr("kuberl.trainer.stages.EVAL_SIZE", 4)
    opt_before = None

    def spy(stage, rec):
        nonlocal opt_before
        if stage.name == "stage-2":
            opt_before = pipe.optimizer
        return orig(stage, rec)

    orig = pipe._after_step
    pipe._after_step = spy
    pipe.run()
    kept = pipe.state.extra["filter:stage-3"]
    pool_size = 2 * 4  # steps x batchSize
    assert kept == [0, 1, 2, 4, 5, 6]
    filt = [c for c in calls if c[0] == "rollouts" and c[1][2] == 3]
    assert len(filt) == 1 and len(filt[0][1][0]) == pool_size
    assert pipe.optimizer is not opt_before
    events = [e["text"] for e in _lines(tmp_path / "events.jsonl")]
    assert any("difficulty filter kept" in t for t in events)
    assert any("optimizer reset before stage-3" in t for t in events)
