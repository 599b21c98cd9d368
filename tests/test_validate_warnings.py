"""`kuberl validate`'s warnings: the API server's own warnings on the children kuberl renders and
the capacity mismatches kuberl computes, printed as `Warning:` lines on stderr, errors under
--strict, and the same list from the admission webhook."""

from __future__ import annotations

import asyncio
from typing import Any

import builders
import pytest
import yaml

from kuberl.cli import main
from kuberl.operator.validate import admission
from kuberl.operator.validate.podwarnings import object_warnings, pod_spec_warnings

# a job on a 1.5B model: an inline fleet of 8 H100 engines (their KV caches hold the default
# batch's 16384 rollouts in about 8 waves) and a 128-worker inline pool, one RL stage
W_JOB = builders.job_manifest(
    "w",
    model={"base": "Qwen/Qwen2.5-1.5B-Instruct"},
    rollout={
        "fleet": {"replicas": 8, "accelerator": {"profile": "h100", "count": 1}, "weightSync": {"claimName": "w"}}
    },
    sandbox={"pool": {"replicas": 16, "workersPerPod": 8}},
    stages=[{"name": "rl", "type": "rl", "steps": 1}],
)


def _validate(tmp_path: Any, capsys: Any, doc: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc = main(["validate", *flags, str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


FRACTIONAL = 'fractional byte value "2500m" is invalid, must be an integer'


def test_a_fractional_memory_quantity_warns_as_the_api_server_does(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=W_JOB)
    job["spec"]["rollout"]["fleet"]["resources"] = {"requests": {"memory": "2500m"}}
    rc, out, err = _validate(tmp_path, capsys, job)
    assert rc == 0 and "ok" in out
    assert (
        f"Warning: {tmp_path / 'm.yaml'}: AgenticRLJob/w: Deployment/w-rollout: "
        f"spec.template.spec.containers[sglang].resources.requests[memory]: {FRACTIONAL}"
    ) in err
    rc, _, err = _validate(tmp_path, capsys, job, "--strict")
    assert rc == 1 and "INVALID" in err and FRACTIONAL in err


def test_whole_bytes_give_no_warning_and_strict_passes(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=W_JOB)
    job["spec"]["rollout"]["fleet"]["resources"] = {"requests": {"memory": "2500"}}
    rc, _, err = _validate(tmp_path, capsys, job, "--strict")
    assert rc == 0 and "Warning:" not in err


def test_a_sandbox_pool_far_below_the_rollouts_in_flight_warns(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=W_JOB, sandbox={"pool": {"replicas": 1, "workersPerPod": 1}}, algorithm={"batchPrompts": 64})
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.sandbox.pool: 1 sandbox workers (replicas 1 x workersPerPod 1) for up to 2048 tool-calling" in err
    # the worker generates max(1, asyncLevel) batches at once: level 1 keeps one, level 2 two
    job["spec"]["algorithm"]["asyncLevel"] = 1
    assert "up to 2048 tool-calling rollouts" in _validate(tmp_path, capsys, job)[2]
    job["spec"]["algorithm"]["asyncLevel"] = 2
    assert "up to 4096 tool-calling rollouts" in _validate(tmp_path, capsys, job)[2]
    # autoscaling counts at its maximum
    job["spec"]["sandbox"]["pool"] = {"replicas": 1, "workersPerPod": 8, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}}
    assert "Warning:" not in _validate(tmp_path, capsys, job)[2]
    # no tools, no calls
    job["spec"]["sandbox"]["pool"] = {"replicas": 1, "workersPerPod": 1}
    job["spec"]["rollout"]["tools"] = []
    assert "Warning:" not in _validate(tmp_path, capsys, job)[2]


def test_a_referenced_pool_in_the_file_is_weighed_too(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=W_JOB, sandbox={"poolRef": "tools"})
    pool = {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "tools"},
            "spec": {"replicas": 1, "workersPerPod": 1}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all([pool, job]))
    assert main(["validate", str(path)]) == 0
    assert "SandboxPool tools (spec.sandbox.poolRef) spec: 1 sandbox workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "warning"),
    [
        ({"overhead": {"memory": "0.5"}}, 'P.overhead[memory]: fractional byte value "0.5" is invalid'),
        ({"containers": [{"name": "c", "resources": {"limits": {"ephemeral-storage": "1.5"}}}]},
         'P.containers[c].resources.limits[ephemeral-storage]: fractional byte value "1.5"'),
        ({"containers": [{"name": "c", "env": [{"name": "A"}, {"name": "A"}]}]},
         'P.containers[c].env[1]: hides previous definition of "A"'),
        ({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostIP": "1.2.3.4"}]}]},
         "P.containers[c].ports[0]: hostIP set without hostPort"),
        ({"containers": [{"name": "a", "ports": [{"containerPort": 80}]}, {"name": "b", "ports": [{"containerPort": 80}]}]},
         "P.containers[b].ports[0]: duplicate port definition with P.containers[a].ports[0]"),
        ({"imagePullSecrets": [{"name": "s"}, {"name": "s"}]}, 'P.imagePullSecrets[1].name: duplicate name "s"'),
        ({"imagePullSecrets": [{}]}, 'P.imagePullSecrets[0].name: invalid empty name ""'),
        ({"terminationGracePeriodSeconds": -1}, "P.terminationGracePeriodSeconds: must be >= 0"),
        ({"topologySpreadConstraints": [{"maxSkew": 1}]},
         "P.topologySpreadConstraints[0].labelSelector: a null labelSelector results in matching no pod"),
        ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "k"}}]}}},
         "preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.labelSelector: a null labelSelector"),
        ({"volumes": [{"name": "v", "gitRepo": {"repository": "r"}}]}, "P.volumes[0].gitRepo: deprecated in v1.11"),
    ],
)
def test_the_api_servers_pod_warnings(spec: dict[str, Any], warning: str) -> None:
    warned = pod_spec_warnings(spec, "P")
    assert any(warning in w for w in warned), warned


def test_deprecated_annotations_of_a_template_warn() -> None:
    obj = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {
        "metadata": {"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "runtime/default"}},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"memory": "1Gi"}}}]}}}}
    assert object_warnings(obj) == [
        "Deployment/d: spec.template.metadata.annotations[seccomp.security.alpha.kubernetes.io/pod]: "
        'non-functional in v1.27+; use the "seccompProfile" field instead'
    ]


def test_the_webhook_returns_the_warnings_validate_prints(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=W_JOB, sandbox={"pool": {"replicas": 1, "workersPerPod": 1}})
    job["spec"]["rollout"]["fleet"]["resources"] = {"requests": {"memory": "2500m"}}
    _, _, err = _validate(tmp_path, capsys, job)
    printed = [line.split("AgenticRLJob/w: ", 1)[1] for line in err.splitlines() if line.startswith("Warning:")]
    assert len(printed) == 2
    assert asyncio.run(admission.validation_errors(job, None)) == []
    assert asyncio.run(admission.validation_warnings(job, None)) == printed


def test_every_example_passes_strict(capsys: Any) -> None:
    """The shipped examples are what users copy: none may warn."""
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        rc = main(["validate", "--strict", str(path)])
        assert rc == 0, (path.name, capsys.readouterr())


def test_training_state_over_the_trainers_accelerators_warns(tmp_path: Any, capsys: Any) -> None:
    """16 bytes a parameter (float32 weights, gradients, two AdamW moments) over the trainer's
    GPUs: 235B on 8 MI300X is 470 GB a GPU against 192; on 8 x 8 it fits."""
    job = builders.job_manifest(of=W_JOB, model={"base": "Qwen/Qwen3-235B-A22B"},
                                trainer={"replicas": 1, "accelerator": {"profile": "mi300x", "count": 8}})
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.trainer: Qwen/Qwen3-235B-A22B's float32 weights, gradients and AdamW moments take 3760 GB" in err
    assert "470 GB on each of its 8 mi300x accelerators" in err and "raise trainer.replicas" in err
    assert _validate(tmp_path, capsys, job, "--strict")[0] != 0
    job["spec"]["trainer"]["replicas"] = 8
    assert "spec.trainer" not in _validate(tmp_path, capsys, job)[2]
    # a name without a size says nothing of the model: no warning
    job["spec"]["trainer"]["replicas"] = 1
    job["spec"]["model"]["base"] = "s3://bucket/checkpoints/policy"
    assert "spec.trainer" not in _validate(tmp_path, capsys, job)[2]


def test_served_weights_that_leave_no_kv_cache_warn(tmp_path: Any, capsys: Any) -> None:
    """An inline fleet serves the job's model: 70B in bf16 is 140 GB, over the 68 GB that
    memFractionStatic 0.85 leaves of one H100; tensorParallel 4 makes it 35 GB a GPU."""
    job = builders.job_manifest(of=W_JOB, model={"base": "meta-llama/Llama-3.1-70B-Instruct"},
                                trainer={"replicas": 16, "accelerator": {"profile": "h100", "count": 8}})
    err = _validate(tmp_path, capsys, job)[2]
    assert "spec.rollout.fleet.engine: meta-llama/Llama-3.1-70B-Instruct's weights take 140 GB" in err
    assert "raise engine.tensorParallel" in err
    job["spec"]["rollout"]["fleet"]["accelerator"]["count"] = 4
    job["spec"]["rollout"]["fleet"]["engine"] = {"tensorParallel": 4}
    # the weights fit (the KV cache then holds too little of the default batch: kvcache's warning)
    assert "Llama-3.1-70B-Instruct's weights take" not in _validate(tmp_path, capsys, job)[2]
    fleet = builders.fleet_manifest("big", model={"uri": "Qwen/Qwen3-235B-A22B"}, weightSync={"claimName": "w"})
    err = _validate(tmp_path, capsys, fleet)[2]
    assert "spec.engine: Qwen/Qwen3-235B-A22B's weights take 470 GB on each of the engine's 1" in err


def test_a_cpu_sglang_fleet_on_the_default_image_warns_that_sglang_publishes_none(tmp_path: Any, capsys: Any) -> None:
    fleet = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": "f"},
             "spec": {"model": {"uri": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "accelerator": {"profile": "cpu", "count": 1},
                      "weightSync": {"claimName": "w"}}}  # fmt: skip
    rc, _, err = _validate(tmp_path, capsys, fleet)
    assert rc == 0 and "localhost/sglang-cpu:v0.5.4 is built, not pulled" in err and "engine.image" in err, err
    assert _validate(tmp_path, capsys, fleet, "--strict")[0] == 1
    # an image of one's own, or vLLM (whose cpu image kuberl builds): no such warning
    own = {**fleet, "spec": {**fleet["spec"], "engine": {"image": "registry.example/sglang-xeon:v0.5.4"}}}
    assert "built, not pulled" not in _validate(tmp_path, capsys, own)[2]
    vllm = {**fleet, "spec": {**fleet["spec"], "engine": {"type": "vllm"}}}
    assert "built, not pulled" not in _validate(tmp_path, capsys, vllm)[2]
    # a job whose inline cpu fleet a cluster creates (engine auto) hears it too; engine local does not
    job = builders.job_manifest("j", rollout={"fleet": {"accelerator": {"profile": "cpu", "count": 1}}})
    assert "spec.rollout.fleet.engine: the default image" in _validate(tmp_path, capsys, job)[2]
    local = builders.job_manifest("j", rollout={"engine": "local", "fleet": {"accelerator": {"profile": "cpu", "count": 1}}})
    assert "built, not pulled" not in _validate(tmp_path, capsys, local)[2]
