"""Issue 40 leftovers: the fleet's KV cache against the batch, the model facts it is computed from
(a table by name, config.json for a local model), and the run-schedule warnings (a checkpoint
interval no step reaches, one turn with tools, a warm-up longer than a stage). Each prints as a
`Warning:` (or a stdout ``warning:`` note), fails --strict where it is a `Warning:`, and comes back
from the webhook alike."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import builders
import pytest
import yaml

from kuberl.cli import main
from kuberl.operator.validate import admission
from kuberl.operator.validate.models import model_attention, model_parameters

# 512 prompts x 32 rollouts of Qwen2.5-7B (56 KiB of KV a token) on inline H100 engines
KV_JOB = builders.job_manifest(
    "kv",
    model={"base": "Qwen/Qwen2.5-7B-Instruct"},
    rollout={"fleet": {"replicas": 1, "accelerator": {"profile": "h100", "count": 1}, "weightSync": {"claimName": "w"}}},
    sandbox={"pool": {"replicas": 16, "workersPerPod": 8}},
    trainer={"replicas": 2, "accelerator": {"profile": "h100", "count": 8}},
    stages=[{"name": "rl", "type": "rl", "steps": 10}],
    algorithm={"warmupSteps": 5},
    checkpoint={"everySteps": 5},
)


def _validate(tmp_path: Any, capsys: Any, *docs: dict[str, Any], flags: tuple[str, ...] = ()) -> tuple[int, str, str]:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    rc = main(["validate", *flags, str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_table_and_a_local_config_give_the_kv_shape(tmp_path: Any) -> None:
    assert model_attention("Qwen/Qwen2.5-7B-Instruct").kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2
    assert model_attention("HuggingFaceTB/SmolLM2-135M-Instruct").kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    assert model_attention("Qwen/Qwen3-30B-A3B").layers == 48
    assert model_attention("Qwen/Qwen2-7B") is None and model_attention("s3://b/policy") is None
    # a local model: its config.json, shape and size (tied embeddings counted once)
    cfg = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_attention(str(tmp_path)) == model_attention("SmolLM2-135M")
    assert model_parameters(str(tmp_path)) == pytest.approx(134.5e6, rel=0.01)


def test_a_fleet_whose_kv_cache_holds_a_sliver_of_the_batch_warns(tmp_path: Any, capsys: Any) -> None:
    """One engine holds about 0.94M tokens after 14 GB of weights: 102 of the 16384 rollouts at
    9216 tokens, 160 waves; 16 engines take it under 16 waves, and --strict fails on it."""
    rc, _, err = _validate(tmp_path, capsys, KV_JOB)
    assert rc == 0
    assert (
        "spec.rollout.fleet.engine: Qwen/Qwen2.5-7B-Instruct's KV cache takes 56 KiB per token, and an engine's "
        "1 x 80 GB h100 at memFractionStatic 0.85 leaves it room for about"
    ) in err
    assert "the fleet (replicas 1) holds about 102 of the 16384 rollouts in flight at full length" in err
    assert "160 waves" in err
    assert _validate(tmp_path, capsys, KV_JOB, flags=("--strict",))[0] == 1
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    rc, _, err = _validate(tmp_path, capsys, job, flags=("--strict",))
    assert rc == 0 and "Warning:" not in err, err
    # autoscaling counts at its maximum
    job["spec"]["rollout"]["fleet"].update(replicas=1, autoscaling={"minReplicas": 1, "maxReplicas": 16})
    assert "Warning:" not in _validate(tmp_path, capsys, job)[2]


def test_an_engine_that_cannot_hold_one_rollout_warns(tmp_path: Any, capsys: Any) -> None:
    """SmolLM2-1.7B has 32 KV heads (192 KiB a token): memFractionStatic 0.1 of an H100 leaves
    about 24K tokens, under one 33K-token rollout."""
    job = builders.job_manifest(of=KV_JOB, model={"base": "HuggingFaceTB/SmolLM2-1.7B-Instruct"})
    job["spec"]["rollout"]["fleet"].update(replicas=64, engine={"memFractionStatic": 0.1})
    job["spec"]["stages"][0]["maxResponseTokens"] = 32768
    err = _validate(tmp_path, capsys, job)[2]
    assert "fewer than one rollout at full length (1024 prompt + 32768 maxResponseTokens): vLLM refuses to start" in err
    job["spec"]["stages"][0]["maxResponseTokens"] = 8192
    assert "fewer than one rollout" not in _validate(tmp_path, capsys, job)[2]


def test_a_referenced_fleet_in_the_file_and_the_webhook_weigh_the_kv_cache_too(tmp_path: Any, capsys: Any) -> None:
    fleet = builders.fleet_manifest("gen", model={"uri": "Qwen/Qwen2.5-7B-Instruct"}, weightSync={"claimName": "w"},
                                    accelerator={"profile": "h100", "count": 1})
    job = builders.job_manifest(of=KV_JOB, rollout={"fleetRef": "gen"})
    rc, _, err = _validate(tmp_path, capsys, fleet, job)
    assert rc == 0
    assert "RolloutFleet gen (spec.rollout.fleetRef) spec.engine: Qwen/Qwen2.5-7B-Instruct's KV cache" in err

    async def lookup(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return fleet if (kind, name) == ("RolloutFleet", "gen") else None

    warned = asyncio.run(admission.validation_warnings(job, lookup))
    assert any("RolloutFleet gen (spec.rollout.fleetRef) spec.engine" in w and "160 waves" in w for w in warned)
    # a model kuberl knows nothing of says nothing
    fleet["spec"]["model"]["uri"] = job["spec"]["model"]["base"] = "s3://bucket/policy"
    assert "KV cache" not in _validate(tmp_path, capsys, fleet, job)[2]


def test_a_checkpoint_interval_no_step_reaches_warns(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=KV_JOB, checkpoint={"everySteps": 10})
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.checkpoint.everySteps: 10 is not below the run's 10 steps (all stages)" in err
    assert "restarts (trainer.maxRestarts) from step 0" in err
    job["spec"]["checkpoint"]["everySteps"] = 9
    assert "everySteps" not in _validate(tmp_path, capsys, job)[2]


def test_one_turn_with_tools_warns(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    job["spec"]["stages"][0]["maxTurns"] = 1
    err = _validate(tmp_path, capsys, job)[2]
    assert "spec.rollout.maxTurns: 1 turn for RL stage 'rl': a tool call's output comes back in the next turn" in err
    job["spec"]["rollout"]["tools"] = []
    assert "maxTurns" not in _validate(tmp_path, capsys, job)[2]


def test_a_warm_up_longer_than_a_stage_is_noted(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["algorithm"]["warmupSteps"] = 40
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "warning: spec.algorithm.warmupSteps 40 exceeds stage 'rl''s 10 steps: its learning rate never gets past 25%" in out
    assert _validate(tmp_path, capsys, job, flags=("--strict",))[0] == 1
    job["spec"]["algorithm"]["warmupSteps"] = 10
    rc, out, _ = _validate(tmp_path, capsys, job, flags=("--strict",))
    assert rc == 0 and "warmupSteps" not in out


def test_a_trainer_on_cpu_holding_gpus_warns(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    job["spec"]["trainer"]["device"] = "cpu"
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.trainer.device: cpu on h100 pods: the trainer computes on CPUs while its 16 GPUs" in err
    job["spec"]["trainer"]["device"] = "auto"
    assert _validate(tmp_path, capsys, job, flags=("--strict",))[0] == 0


@pytest.mark.parametrize(("workers", "cpu", "warned"), [(32, "2", True), (8, "2", False), (9, "2", True), (64, "16", False)])
def test_sandbox_workers_far_over_their_cpus_warn(tmp_path: Any, capsys: Any, workers: int, cpu: str, warned: bool) -> None:
    pool = {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "tools"},
            "spec": {"workersPerPod": workers, "limits": {"memoryMB": 64},
                     "resources": {"requests": {"cpu": cpu, "memory": "8Gi"}, "limits": {"cpu": cpu, "memory": "8Gi"}}}}
    rc, _, err = _validate(tmp_path, capsys, pool)
    assert rc == 0
    said = f"spec.workersPerPod: {workers} workers share the sandbox container's {cpu} CPUs (resources limits.cpu)"
    assert (said in err) is warned, err
    # the same pool inline in a job
    job = builders.job_manifest(of=KV_JOB, sandbox={"pool": pool["spec"]})
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    assert (f"spec.sandbox.pool.workersPerPod: {workers} workers share" in _validate(tmp_path, capsys, job)[2]) is warned


def test_a_response_budget_too_short_for_a_tool_call_warns(tmp_path: Any, capsys: Any) -> None:
    """A rollout can still answer without tools in 24 tokens (refused under 16), but no tool call
    and its output fit: it learns no tool use."""
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    job["spec"]["stages"][0]["maxResponseTokens"] = 24
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.stages[0].maxResponseTokens: 24 tokens for stage 'rl' cannot hold a tool call" in err
    job["spec"]["rollout"]["tools"] = []
    assert "cannot hold a tool call" not in _validate(tmp_path, capsys, job)[2]
    job["spec"]["rollout"]["tools"] = ["python"]
    job["spec"]["stages"][0]["maxResponseTokens"] = 64
    assert "cannot hold a tool call" not in _validate(tmp_path, capsys, job)[2]


def test_trackers_a_trainer_pod_cannot_log_to_are_noted(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=KV_JOB, tracking={"wandb": {"project": "p"}, "mlflow": {}})
    job["spec"]["rollout"]["fleet"]["replicas"] = 16
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "not checked: spec.tracking.wandb logs online but names no apiKeySecret" in out
    assert "warning: spec.tracking.mlflow has no trackingUri: its file store (mlruns/ in the run folder)" in out
    assert _validate(tmp_path, capsys, job, flags=("--strict",))[0] == 1
    job["spec"]["tracking"] = {"wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}},
                               "mlflow": {"trackingUri": "http://mlflow:5000"}}
    rc, out, _ = _validate(tmp_path, capsys, job, flags=("--strict",))
    assert rc == 0 and "tracking" not in out
    job["spec"]["tracking"] = {"wandb": {"project": "p", "mode": "offline"}}
    assert "tracking" not in _validate(tmp_path, capsys, job)[1]


def test_a_context_length_without_room_for_the_prompt_warns(tmp_path: Any, capsys: Any) -> None:
    """contextLength 8300 passes the schema's rule (above maxResponseTokens 8192) but leaves 108
    tokens of a ~1024-token rStar2 prompt."""
    job = builders.job_manifest(of=KV_JOB)
    job["spec"]["rollout"]["fleet"].update(replicas=16, engine={"contextLength": 8300})
    job["spec"]["stages"][0]["maxResponseTokens"] = 8192
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.rollout.fleet.engine.contextLength: 8300 leaves stage 'rl' 108 tokens for the prompt" in err
    assert "raise contextLength to 9216 or more" in err
    job["spec"]["rollout"]["fleet"]["engine"]["contextLength"] = 9216
    assert "contextLength" not in _validate(tmp_path, capsys, job)[2]
