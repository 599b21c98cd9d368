"""Issue 14 item 14: `kuberl validate` says what it could not check, checks a fleet referenced in
the same file like an inline one, and warns when concurrent tool calls can outgrow their pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import builders
import pytest
import yaml

from kuberl.cli import main

# a job on the pool "tools" whose one RL stage answers in up to 8192 tokens
TRAIN = builders.job_manifest(
    "train", sandbox={"poolRef": "tools"}, stages=[{"name": "rl", "type": "rl", "steps": 1, "maxResponseTokens": 8192}]
)


def _validate(tmp_path: Any, capsys: Any, *docs: dict[str, Any]) -> tuple[int, str, str]:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dangling_references_are_reported_as_not_checked(tmp_path: Any, capsys: Any) -> None:
    rc, out, _ = _validate(tmp_path, capsys, builders.job_manifest(of=TRAIN, rollout={"fleetRef": "gen"}))
    assert rc == 0
    assert "not checked: spec.rollout.fleetRef names RolloutFleet 'gen'" in out
    assert "not checked: spec.sandbox.poolRef names SandboxPool 'tools'" in out


def test_a_fleet_in_the_same_file_gets_the_context_length_check(tmp_path: Any, capsys: Any) -> None:
    pool = {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "tools"}, "spec": {}}
    on_gen = builders.job_manifest(of=TRAIN, rollout={"fleetRef": "gen"})
    rc, out, err = _validate(tmp_path, capsys, builders.fleet_manifest("gen", weightSync={"claimName": "w"}, engine={"contextLength": 4096}), pool, on_gen)
    assert rc == 1
    assert "RolloutFleet gen (in this file) has engine.contextLength 4096" in err
    assert "not checked" not in out
    rc, _, _ = _validate(tmp_path, capsys, builders.fleet_manifest("gen", weightSync={"claimName": "w"}, engine={"contextLength": 16384}), pool, on_gen)
    assert rc == 0


def test_per_call_memory_times_workers_above_the_pod_limit_warns(tmp_path: Any, capsys: Any) -> None:
    pool = {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": "tools"},
        "spec": {
            "workersPerPod": 16,
            "limits": {"memoryMB": 2048},
            "resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        },
    }
    rc, out, _ = _validate(tmp_path, capsys, pool)
    assert rc == 0
    assert "warning: spec.workersPerPod (16) x limits.memoryMB (2048) = 32.0 GiB exceeds" in out


@pytest.mark.parametrize(
    ("level", "epochs", "minis", "warned"),
    [(2, 2, 1, True), (3, 1, 2, True), (2, 1, 1, False), (1, 2, 2, False), (0, 4, 1, False)],
)
def test_several_optimizer_steps_on_rollouts_two_versions_old_warn(
    tmp_path: Any, capsys: Any, level: int, epochs: int, minis: int, warned: bool
) -> None:
    job = builders.job_manifest(of=TRAIN, rollout={"engine": "local"})
    job["spec"]["sandbox"] = {}
    job["spec"].setdefault("algorithm", {}).update(
        asyncLevel=level, ppoEpochs=epochs, miniBatches=minis, batchPrompts=max(2, minis)
    )
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert (f"warning: spec.algorithm.asyncLevel {level} with {epochs * minis} optimizer steps" in out) is warned


def test_checkpoints_that_would_not_survive_the_pod_are_flagged(tmp_path: Any, capsys: Any) -> None:
    job = builders.job_manifest(of=TRAIN, rollout={"engine": "local"})
    job["spec"]["sandbox"] = {}
    job["spec"]["checkpoint"] = {"uri": "/ckpt/run"}
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert rc == 0 and "warning: checkpoint.uri /ckpt/run is not on a volume the trainer mounts" in out
    job["spec"]["trainer"] = {
        "podTemplate": {
            "spec": {
                "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                "containers": [{"name": "trainer", "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}],
            }
        }
    }
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert rc == 0 and "checkpoint.uri" not in out
    job["spec"]["checkpoint"] = {"uri": "s3://b/run"}
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert "needs S3 credentials" in out


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        (("rollout", "fleetRef"), "Gen_Fleet", "spec.rollout.fleetRef: must be a lowercase RFC 1035 label"),
        (("rollout", "fleetRef"), "7b-fleet", "spec.rollout.fleetRef: must be a lowercase RFC 1035 label"),
        (("sandbox", "poolRef"), "Python Tools", "spec.sandbox.poolRef: must be a lowercase RFC 1035 label"),
        (("checkpoint", "storageClassName"), "Fast_SSD", "spec.checkpoint.storageClassName: must be a DNS subdomain"),
        (("tracking", "wandb"), {"project": "p", "apiKeySecret": {"name": "WandB"}}, "apiKeySecret.name: must be a DNS"),
        (("tracking", "wandb"), {"project": "p", "apiKeySecret": {"name": "w", "key": "api key"}}, "must be a Secret key"),
        (("tracking", "wandb"), {"project": "p", "apiKeySecret": {"name": "w", "key": "..k"}}, "may not be '.' nor start"),
    ],
)
def test_names_that_can_never_resolve_are_refused_not_left_unchecked(
    tmp_path: Any, capsys: Any, path: tuple[str, str], value: Any, fragment: str
) -> None:
    """A reference no object can carry (an RFC 1035 name for a fleet or pool, a DNS subdomain for a
    Secret or StorageClass) is an error, by the model and by the CRD, not a "not checked" note: the
    operator would wait forever for a fleet called ``Gen_Fleet``, and the API server refuses the
    trainer Job whose env names Secret ``WandB``."""
    from kuberl.api.crdgen import all_crds
    from tests.apiserver_emulation import admission_errors

    doc = builders.job_manifest(of=TRAIN, rollout={"fleetRef": "gen"})
    doc["spec"].setdefault(path[0], {})[path[1]] = value
    rc, out, err = _validate(tmp_path, capsys, doc)
    assert rc == 1 and fragment in err, (out, err)
    if not fragment.startswith("may not"):  # a Go-regex pattern can say what the model says, except this
        assert admission_errors(list(all_crds().values()), doc), "the CRD admits it"


def test_the_memory_warning_reads_the_pod_as_rendered(tmp_path: Any, capsys: Any) -> None:
    """The limit that OOM-kills the pod is the sandbox container's after the podTemplate merge,
    for a standalone pool and a job's inline pool alike."""
    mem = {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    override = {"spec": {"containers": [{"name": "sandbox", "resources": mem}]}}
    pool = {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": "tools"},
        "spec": {"workersPerPod": 4, "limits": {"memoryMB": 1024}, "podTemplate": override},
    }
    rc, out, _ = _validate(tmp_path, capsys, pool)
    assert rc == 0 and "= 4.0 GiB exceeds the pod's memory limit (1Gi)" in out, out
    job = builders.job_manifest(of=TRAIN, rollout={"engine": "local"})
    job["spec"]["sandbox"] = {"pool": pool["spec"]}
    rc, out, _ = _validate(tmp_path, capsys, job)
    assert "warning: spec.sandbox.pool.workersPerPod (4)" in out and "(1Gi)" in out, out
    del pool["spec"]["podTemplate"]  # the default 8Gi holds 4 x 1 GiB
    rc, out, _ = _validate(tmp_path, capsys, pool)
    assert "exceeds the pod" not in out


def test_a_reference_resolves_in_its_own_namespace_only(tmp_path: Any, capsys: Any) -> None:
    """A fleet of another namespace in the same file is not the one the job will get: no
    context-length verdict from it, and the reference is reported as not checked."""
    fleet = builders.fleet_manifest("gen", weightSync={"claimName": "w"}, engine={"contextLength": 4096})
    fleet["metadata"]["namespace"] = "other"
    rc, out, _ = _validate(tmp_path, capsys, fleet, builders.job_manifest(of=TRAIN, rollout={"fleetRef": "gen"}))
    assert rc == 0, out
    assert "not checked: spec.rollout.fleetRef names RolloutFleet 'gen', which is not in this file (namespace default)" in out


def test_two_resources_that_would_create_the_same_object_are_refused(tmp_path: Any, capsys: Any) -> None:
    """Job ``train``'s inline pool is SandboxPool ``train-sandbox`` (with its Deployment, Service,
    ...): a standalone pool of that name in the same file would have two owners."""
    job = builders.job_manifest(of=TRAIN, rollout={"engine": "local"})
    job["spec"]["sandbox"] = {"pool": {"replicas": 1}}
    pool = {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "train-sandbox"}, "spec": {}}
    rc, _, err = _validate(tmp_path, capsys, job, pool)
    assert rc == 1
    assert "SandboxPool/train-sandbox is also created by AgenticRLJob/train in this file" in err
    pool["metadata"]["name"] = "tools"
    rc, _, err = _validate(tmp_path, capsys, job, pool)
    assert rc == 0, err
    rc, _, err = _validate(tmp_path, capsys, pool, pool)
    assert rc == 1 and "SandboxPool/tools is also created by SandboxPool/tools" in err


def test_validate_server_without_a_kubeconfig_says_what_is_missing(tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    """--server with no kubeconfig: the local verdict still prints, then one line naming what is
    missing, and the exit status says the check could not be made."""
    from kuberl.cli import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent.kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    rc = main(["validate", "--server", str(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "quickstart.yaml: AgenticRLJob/quickstart" in out
    assert "--server needs a kubeconfig" in err
