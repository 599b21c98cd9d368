"""The CLI seams between components: what the operator writes into pods is what the CLI reads."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.api.sandbox_pool import SandboxLimits, SandboxPool
from kuberl.cli import (
    GRAFANA_TOKEN_ENV,
    UsageError,
    build_parser,
    crd_targets,
    is_source_checkout,
    main,
    sandbox_limits,
)
from kuberl.operator.render.builders import build_sandbox_pool

REPO = Path(__file__).resolve().parent.parent


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


# --- the command line itself ------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser, path: str = "kuberl"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


def test_every_command_and_option_is_described():
    missing = []
    for path, parser in _subparsers(build_parser()):
        if not parser.description:
            missing.append(f"{path}: description")
        for action in parser._actions:
            if action.help is None and not isinstance(action, argparse._SubParsersAction):
                missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_validate_help_explains_files_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "several documents separated by ---" in text
    assert "exit status: 0 every document is valid, 1 at least one file is invalid" in text


def test_source_checkout_is_recognised_by_its_pyproject(tmp_path):
    assert is_source_checkout(REPO)
    assert crd_targets(None, REPO) == [REPO / "crds", REPO / "charts" / "kuberl" / "crds"]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert not is_source_checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert not is_source_checkout(tmp_path)
    with pytest.raises(UsageError, match="not a kuberl source checkout, .*; pass --out DIR"):
        crd_targets(None, tmp_path / "site-packages")
    assert crd_targets(["a", "b"], tmp_path) == [Path("a"), Path("b")]


def test_run_without_the_train_extra_says_what_to_install():
    # torch blocked the way a missing install blocks it: ModuleNotFoundError named 'torch'.
    code = (
        "import sys; sys.modules['torch'] = None; from kuberl.cli import main; "
        "sys.exit(main(['run', 'examples/quickstart.yaml']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "torch is not installed): pip install 'kuberl[train]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_reraises_import_errors_that_are_bugs(monkeypatch):
    import kuberl.trainer.local as local

    def broken(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'kuberl.trainer.nope'", name="kuberl.trainer.nope")

    monkeypatch.setattr(local, "run_file", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["run", "examples/quickstart.yaml"])


def test_run_says_why_it_stopped_early(monkeypatch, tmp_path, capsys):
    import kuberl.trainer.local as local
    from kuberl.trainer.stage_host import RunResult
    from kuberl.trainer.step_record import StepRecord

    seen = {}

    def stopped(job, out, *, algorithm=None, max_minutes=None, **kwargs):
        seen.update(out=out, max_minutes=max_minutes)
        return RunResult(history=[StepRecord(type="sft", stage="sft", step=7)], stopped_early=True)

    monkeypatch.setattr(local, "run_job", stopped)
    rc = main(
        ["run", str(REPO / "examples" / "quickstart.yaml"), "--out", str(tmp_path), "--max-minutes", "0.5"]
    )
    assert rc == 0 and seen == {"out": str(tmp_path), "max_minutes": 0.5}
    err = capsys.readouterr().err
    assert "stopped in stage sft after global step 7: the --max-minutes limit (0.5 min) was reached" in err
    assert "run the same command again to resume from the last checkpoint" in err


def test_dashboards_token_comes_from_the_environment(monkeypatch, capsys):
    import kuberl.dashboards.cli as dashboards

    got = []
    monkeypatch.setattr(dashboards, "run", lambda args: got.append(args.token) or 0)
    monkeypatch.delenv(GRAFANA_TOKEN_ENV, raising=False)
    assert main(["dashboards", "upload", "--url", "http://g:3000"]) == 2
    assert f"pass --token or set ${GRAFANA_TOKEN_ENV}" in capsys.readouterr().err
    monkeypatch.setenv(GRAFANA_TOKEN_ENV, "from-env")
    assert main(["dashboards", "upload", "--url", "http://g:3000"]) == 0
    assert main(["dashboards", "upload", "--url", "http://g:3000", "--token", "flag"]) == 0
    assert got == ["from-env", "flag"]
