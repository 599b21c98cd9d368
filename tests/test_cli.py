"""The CLI seams between components: what the operator writes into pods is what the CLI reads."""

from __future__ import annotations

import pytest

from kuberl.api.sandbox_pool import SandboxLimits, SandboxPool
from kuberl.cli import sandbox_limits
from kuberl.operator.builders import build_sandbox_pool


def _pool_env(limits: dict) -> str:
    pool = SandboxPool.model_validate({"metadata": {"name": "sbx"}, "spec": {"limits": limits}})
    deploy = next(m for m in build_sandbox_pool(pool) if m["kind"] == "Deployment")
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "KUBERL_SANDBOX_LIMITS")


def test_pod_env_limits_reach_the_service():
    wanted = {"timeoutSeconds": 3.5, "memoryMB": 256, "maxOutputBytes": 4096, "maxProcesses": 8}
    got = sandbox_limits(_pool_env(wanted), {})
    assert got == SandboxLimits.model_validate(wanted)


def test_flags_override_env_limits():
    got = sandbox_limits(_pool_env({"memoryMB": 256}), {"memoryMB": 512, "timeoutSeconds": None})
    assert (got.memory_mb, got.timeout_seconds) == (512, 10.0)


def test_no_env_gives_defaults():
    assert sandbox_limits(None, {}) == SandboxLimits()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"memoryMB": 1}', "invalid sandbox limits"),
    ],
)
def test_bad_env_limits_are_clear(env, message):
    with pytest.raises(SystemExit, match=message):
        sandbox_limits(env, {})
