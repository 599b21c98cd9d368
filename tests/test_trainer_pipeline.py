"""End to end: SFT then GRPO-RoC RL steps, metrics/events files, prometheus gauges, CLI wiring.

``test_run_file_real_sandbox_and_ray`` is the whole default path of ``kuberl run``: a Ray
actor rollout worker (LocalEngine + Scheduler + SandboxClient), the real sandbox subprocess
executing the tool calls and verifying answers, and the trainer in the driver.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import urllib.request

import pytest
import yaml
from trainer_fakes import CoinVerifySandbox, FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.rollout.scored import Scored
from kuberl.trainer.grpo import prepare_batch
from kuberl.trainer.local import run_file, run_job, summarize

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
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 8)
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


def test_run_file_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("KUBERL_ROLLOUT_URLS", "KUBERL_ROLLOUT_FLEET", "KUBERL_WEIGHTS_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert run_file(str(tmp_path / "missing.yaml")) == 2
    hub = dict(TINY, spec=dict(TINY["spec"], model={"base": "Qwen/Qwen3-14B"}))
    assert run_file(_write(tmp_path, hub), out_dir=str(tmp_path / "o")) == 2
    assert "spec.model.base: model 'Qwen/Qwen3-14B': could not fetch it" in capsys.readouterr().err
    sglang = dict(TINY, spec=dict(TINY["spec"], rollout=dict(TINY["spec"]["rollout"], engine="sglang")))
    assert run_file(_write(tmp_path, sglang), out_dir=str(tmp_path / "o")) == 2
    assert "spec.rollout.engine is sglang but no engines are named" in capsys.readouterr().err
    assert run_file(_write(tmp_path, TINY), out_dir=str(tmp_path / "o"), engines="http://127.0.0.1:9") == 2
    assert "--engines conflicts with spec.rollout.engine: local" in capsys.readouterr().err
    auto = dict(TINY, spec=dict(TINY["spec"], rollout=dict(TINY["spec"]["rollout"], engine="auto")))
    assert run_file(_write(tmp_path, auto), out_dir=str(tmp_path / "o"), engines="http://127.0.0.1:9") == 2
    assert "builtin:tiny-gpt runs on the local engine only" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_run_file_real_sandbox_and_ray(tmp_path, monkeypatch):
    """Also: the Ray actor's kuberl_rollout_* series reach the driver's exporter (mirrored)."""
    pytest.importorskip("kuberl.sandbox.service.local", reason="the sandbox component is not in this checkout yet")
    from prometheus_client import REGISTRY

    from kuberl.trainer import metrics

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 8)
    monkeypatch.delenv("KUBERL_NO_RAY", raising=False)
    monkeypatch.delenv("KUBERL_SANDBOX_URL", raising=False)
    monkeypatch.setenv("KUBERL_METRICS_PORT", "0")
    engine = {"engine": "local-0"}
    # Under Ray no LocalEngine runs in this process: only the mirror can move this counter.
    before = REGISTRY.get_sample_value("kuberl_rollout_generated_tokens_total", engine) or 0.0
    out = tmp_path / "run"
    assert run_file(_write(tmp_path, TINY), out_dir=str(out), ablation="grpo") == 0
    steps = _lines(out / "metrics.jsonl")
    rl = [s for s in steps if s.get("type") == "rl"]
    assert len(rl) == 2 and all(s["algorithm"] == "grpo" and s["rollouts"] == 4 for s in rl)
    assert (out / "checkpoints").is_dir() and (out / "tokenizer.json").is_file()
    assert [s["label"] for s in steps if s.get("type") == "eval"] == ["sft", "rl"]
    generated = REGISTRY.get_sample_value("kuberl_rollout_generated_tokens_total", engine) - before
    assert generated >= 8 + 2 * 4  # at least one token per eval and per RL rollout
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics._SERVER_PORT}/metrics", timeout=5) as r:  # noqa: S310
        text = r.read().decode()
    for name in ("kv_cache_utilization", "requests_inflight", "generated_tokens_total"):
        assert f'kuberl_rollout_{name}{{engine="local-0"}}' in text, name


def test_rollout_mirror_sets_gauges_and_advances_the_counter_by_deltas():
    from prometheus_client import REGISTRY

    from kuberl.rollout.mirror import RolloutMirror

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"engine": "mirrored-0"}) or 0.0

    base = value("kuberl_rollout_generated_tokens_total")
    mirror = RolloutMirror()
    row = {
        "engine": "mirrored-0",
        "kv_cache_utilization": 0.25,
        "requests_inflight": 3,
        "generated_tokens": 100,
    }
    mirror.apply([row])
    assert (
        value("kuberl_rollout_kv_cache_utilization") == 0.25
        and value("kuberl_rollout_requests_inflight") == 3
    )
    mirror.apply([dict(row, generated_tokens=130, requests_inflight=0)])
    assert value("kuberl_rollout_generated_tokens_total") - base == 130
    assert value("kuberl_rollout_requests_inflight") == 0
    mirror.apply([dict(row, generated_tokens=20)])  # the worker restarted: its new total counts
    assert value("kuberl_rollout_generated_tokens_total") - base == 150
    mirror.apply([dict(row, generated_tokens=None)])  # an engine that does not count tokens
    assert value("kuberl_rollout_generated_tokens_total") - base == 150


@pytest.mark.parametrize(
    ("env", "bound"), [({}, "0.0.0.0"), ({"KUBERL_METRICS_ADDR": "127.0.0.1"}, "127.0.0.1")]
)
def test_metrics_exporter_listens_on_all_interfaces_unless_told(tmp_path, env, bound):
    """The operator gives trainer pods a metrics containerPort: loopback-only would be unscrapable."""
    code = (
        "import urllib.request\n"
        "from kuberl.trainer.metrics import MetricsSink\n"
        f"s = MetricsSink('j', {str(tmp_path)!r})\n"
        "body = urllib.request.urlopen(f'http://127.0.0.1:{s.port}/metrics', timeout=5).read()\n"
        "print(s.addr, b'kuberl_' in body or b'python_info' in body)\n"
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != "KUBERL_METRICS_ADDR"},
        "KUBERL_METRICS_PORT": "0",
        **env,
    }
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-2:] == [bound, "True"]


def test_two_mini_batches_clip_and_really_update(tmp_path, monkeypatch):
    """The second mini-batch is off-policy, so the clip-higher machinery is exercised in a real run."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    doc = json.loads(json.dumps(TINY))
    spec = doc["spec"]
    spec["model"]["config"] = {"nLayer": 1, "nEmbd": 64, "nHead": 2}
    spec["algorithm"].update(batchPrompts=4, miniBatches=2, learningRate=0.005)
    spec["rollout"]["maxResponseTokens"] = 48
    spec["stages"] = [
        {"name": "sft", "type": "sft", "steps": 60, "learningRate": 0.01, "batchSize": 8},
        {"name": "rl", "type": "rl", "steps": 3},
    ]
    job = find_one(load_manifests(_write(tmp_path, doc)), AgenticRLJob)
    res = run_job(job, tmp_path / "out", use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    rl = [h for h in res.history if h.type == "rl"]
    assert all(h.opt_steps == 2 for h in rl if h.rollouts_kept > 0) and any(
        h.rollouts_kept for h in rl
    )
    assert sum(h.clip_low + h.clip_high for h in rl) > 0, rl
    assert all(h.rollout_logprob_gap < 1e-4 for h in rl)  # engine and trainer hold the same weights


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

    class ScriptedClient:
        """A rollout client whose rollouts are scripted; every other request answers None."""

        def generate(self, request):
            calls.append(("rollouts", request))
            # problem i is solved by rollout j iff j < i % 4: i % 4 == 3 -> 3/3 solved -> dropped
            return [
                [
                    Scored(
                        Trajectory([1], [2], [1], [0.0], 1, 1, 0, 0, "x", False, "answer", text="<answer>"),
                        1.0 if j < i % 4 else 0.0,
                    )
                    for j in range(request.n)
                ]
                for i in range(len(request.prompts))
            ]

        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, args, kwargs))

    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2))
    pipe = Pipeline(
        job,
        model,
        tok,
        ScriptedClient(),
        CheckpointStore(str(tmp_path / "ck")),
        MetricsSink("t", tmp_path),
        algorithm="grpo-roc",
        device="cpu",
    )
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    opt_before = None

    def spy(stage, rec):
        nonlocal opt_before
        if stage.name == "stage-2":
            opt_before = pipe.optimizer
        return orig(stage, rec)

    orig = pipe.after_step
    pipe.after_step = spy
    pipe.run()
    kept = pipe.state.extra["filter:stage-3"]
    pool_size = 2 * 4  # steps x batchSize
    assert kept == [0, 1, 2, 4, 5, 6]
    filt = [c for c in calls if c[0] == "rollouts" and c[1].n == 3]
    assert len(filt) == 1 and len(filt[0][1].prompts) == pool_size
    assert pipe.optimizer is not opt_before
    events = [e["text"] for e in _lines(tmp_path / "events.jsonl")]
    assert any("difficulty filter kept" in t for t in events)
    assert any("optimizer reset before stage-3" in t for t in events)
