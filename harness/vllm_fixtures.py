"""The real model and the real vLLM server for the tests (session-wide: a start costs ~30 s).

Both are prepared by `.ci/run` (``kuberl vllm install``, ``kuberl models prepare``). Without them
the tests that need them skip with the command to run, except where ``KUBERL_REQUIRE_VLLM=1``
(CI), where a missing piece fails the test instead of hiding it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL_NAME = "smollm2-135m-instruct"


def require_or_skip(reason: str) -> None:
    if os.environ.get("KUBERL_REQUIRE_VLLM") == "1":
        pytest.fail(f"KUBERL_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(reason)


def model_dir() -> Path:
    """The prepared SmolLM2 folder ($KUBERL_TEST_MODEL_DIR or the default prepare target)."""
    return Path(
        os.environ.get("KUBERL_TEST_MODEL_DIR") or Path.home() / ".cache" / "kuberl" / "models" / "hf" / MODEL_NAME
    )


def prepared_model() -> Path:
    from kuberl.trainer.pretrained import is_prepared

    d = model_dir()
    if not is_prepared(d, MODEL_NAME):
        require_or_skip(f"no prepared model at {d}: run `kuberl models prepare {MODEL_NAME} {d}`")
    return d


def vllm_available() -> None:
    from kuberl.rollout.vllm_server import vllm_python

    try:
        vllm_python()
    except RuntimeError as err:
        require_or_skip(str(err))


def marked_processes(token: str, command: str = "") -> list[int]:
    """PIDs of live processes whose environment carries ``token`` and whose command line holds
    ``command``: what one run started, when the run starts with the token in its environment
    (``KUBERL_TEST_RUN``), and nothing of another test's or another session's on this machine."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (
                token.encode() in (d / "environ").read_bytes()
                and command.encode() in (d / "cmdline").read_bytes()
                and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def small_rl_job(
    model: Path, ckpt: Path, name: str, *, async_level: int, every_steps: int = 100, keep: int = 1, max_turns: int = 1
) -> dict:
    """A run of 3 small GRPO steps on the real model, rolled out on a local vLLM server (the
    AgenticRLJob document)."""
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"base": str(model)},
            "data": {"train": "builtin:arith"},
            "algorithm": {
                "groupSize": 2, "oversample": 1, "batchPrompts": 2, "learningRate": 1e-5,
                "miniBatches": 1, "asyncLevel": async_level,
            },
            "rollout": {"engine": "vllm", "maxTurns": max_turns, "maxResponseTokens": 48, "promptTemplate": "compact"},
            "stages": [{"name": "rl", "type": "rl", "steps": 3}],
            "trainer": {"device": "cpu", "threads": 1},
            "checkpoint": {"uri": str(ckpt), "everySteps": every_steps, "keep": keep},
        },
    }  # fmt: skip
