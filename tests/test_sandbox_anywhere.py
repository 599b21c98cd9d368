"""The sandbox holds wherever Python is installed: here, a newcomer's layout, a clone under /tmp
with its virtual environment inside it (``python -m venv .venv``).

The interpreter's packages then lie inside the checkout and under /tmp, which both isolation
modes keep out of a call's sight otherwise (the call's scratch space is /tmp in a private root);
the isolation tests must pass there as they do from the system interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, _copy_source, _has_build_requirements
from venvs import venv_like_this_interpreter

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's isolation is Linux's")


@pytest.fixture(scope="module")
def clone_with_venv() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="kuberl-clone-", dir="/tmp"))
    top.chmod(0o755)  # a non-root service (basic mode) must reach its interpreter
    clone = top / "kuberl"
    try:
        _copy_source(REPO, clone)
        python = venv_like_this_interpreter(clone / ".venv")
        # our pip and setuptools build the editable install into the venv (its own would need
        # PyPI), where they are new enough (a venv made by `python -m venv` holds ensurepip's
        # older setuptools: pip then builds in an isolated environment of its own); the venv's
        # site-packages then map kuberl to the clone, ahead of the ones it falls back on
        isolation = ["--no-build-isolation"] if _has_build_requirements() else []
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
             "--no-deps", *isolation, "-e", str(clone)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stdout + installed.stderr
        yield clone
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_venv_serves_the_clones_code(clone_with_venv):
    python = clone_with_venv / ".venv" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import sys, kuberl.sandbox as s; print(s.__file__, sys.prefix)"],
        cwd="/", capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert found == [str(clone_with_venv / "sandbox" / "__init__.py"), str(clone_with_venv / ".venv")]


@pytest.mark.timeout(900)
def test_the_isolation_tests_pass_from_a_venv_inside_a_clone_under_tmp(clone_with_venv):
    python = clone_with_venv / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    run = subprocess.run(
        # one process (-n 0): this test's own worker already shares the machine with the others
        [str(python), "-m", "pytest", "-x", "-n", "0", "tests/test_sandbox_isolation.py"],
        cwd=clone_with_venv, env=env, capture_output=True, text=True,
    )  # fmt: skip
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "failed" not in run.stdout, tail
