"""`kuberl validate`'s warnings: the API server's own warnings on the children kuberl renders and
the capacity mismatches kuberl computes, printed as `Warning:` lines on stderr, errors under
--strict, and the same list from the admission webhook."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from kuberl.cli import main
from kuberl.operator.validate import admission
from kuberl.operator.validate.podwarnings import object_warnings, pod_spec_warnings


def _job(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": "w"},
        "spec": {
            "model": {"base": "Qwen/Qwen2.5-1.5B-Instruct"},
            "data": {"train": "d"},
            "rollout": {"fleet": {"accelerator": {"profile": "h100", "count": 1}, "weightSync": {"claimName": "w"}}},
            "sandbox": {"pool": {"replicas": 16, "workersPerPod": 8}},
            "stages": [{"name": "rl", "type": "rl", "steps": 1}],
            **spec,
        },
    }


def _validate(tmp_path: Any, capsys: Any, doc: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc = main(["validate", *flags, str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


FRACTIONAL = 'fractional byte value "2500m" is invalid, must be an integer'


def test_a_fractional_memory_quantity_warns_as_the_api_server_does(tmp_path: Any, capsys: Any) -> None:
    job = _job()
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
    job = _job()
    job["spec"]["rollout"]["fleet"]["resources"] = {"requests": {"memory": "2500"}}
    rc, _, err = _validate(tmp_path, capsys, job, "--strict")
    assert rc == 0 and "Warning:" not in err


def test_a_sandbox_pool_far_below_the_rollouts_in_flight_warns(tmp_path: Any, capsys: Any) -> None:
    job = _job(sandbox={"pool": {"replicas": 1, "workersPerPod": 1}}, algorithm={"batchPrompts": 64})
    rc, _, err = _validate(tmp_path, capsys, job)
    assert rc == 0
    assert "spec.sandbox.pool: 1 sandbox workers (replicas 1 x workersPerPod 1) for up to 2048 tool-calling" in err
    # an asynchronous run generates asyncLevel + 1 batches at once
    job["spec"]["algorithm"]["asyncLevel"] = 1
    assert "up to 4096 tool-calling rollouts" in _validate(tmp_path, capsys, job)[2]
    # autoscaling counts at its maximum
    job["spec"]["sandbox"]["pool"] = {"replicas": 1, "workersPerPod": 8, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}}
    assert "Warning:" not in _validate(tmp_path, capsys, job)[2]
    # no tools, no calls
    job["spec"]["sandbox"]["pool"] = {"replicas": 1, "workersPerPod": 1}
    job["spec"]["rollout"]["tools"] = []
    assert "Warning:" not in _validate(tmp_path, capsys, job)[2]


def test_a_referenced_pool_in_the_file_is_weighed_too(tmp_path: Any, capsys: Any) -> None:
    job = _job(sandbox={"poolRef": "tools"})
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
    job = _job(sandbox={"pool": {"replicas": 1, "workersPerPod": 1}})
    job["spec"]["rollout"]["fleet"]["resources"] = {"requests": {"memory": "2500m"}}
    _, _, err = _validate(tmp_path, capsys, job)
    printed = [line.split("AgenticRLJob/w: ", 1)[1] for line in err.splitlines() if line.startswith("Warning:")]
    assert len(printed) == 2
    assert asyncio.run(admission.validation_errors(job, None)) == []
    assert asyncio.run(admission.validation_warnings(job, None)) == printed
