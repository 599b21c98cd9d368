"""`kuberl run` ends with everything it started (the sandbox service, its workers and zygotes,
Ray), whichever signal ends it, SIGKILL included; its checkpoints stay whole and the same
command resumes from them."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kuberl.util.lifetime import descendants
from tests.test_trainer_pipeline import TINY

REPO = Path(__file__).resolve().parent.parent


def alive(pids: set[int]) -> dict[int, str]:
    """The pids of ``pids`` still running (zombies count as gone), with their command lines."""
    out = {}
    for pid in pids:
        try:
            state = _stat(pid)[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            out[pid] = cmd[:160]
    return out


def _manifest(tmp_path: Path) -> Path:
    doc = copy.deepcopy(TINY)
    doc["metadata"]["name"] = "shutdown"
    doc["spec"]["stages"][1]["steps"] = 30
    doc["spec"]["checkpoint"] = {"uri": str(tmp_path / "ck"), "everySteps": 2, "keep": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(manifest: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, RAY_DISABLE_USAGE_STATS="1")
    env.pop("KUBERL_NO_RAY", None)  # Ray's processes are among those that must end
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "kuberl", "run", str(manifest), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=manifest.parent,
    )  # fmt: skip


def _wait_for_rl_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        events = out / "events.jsonl"
        if events.is_file():
            lines = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
            stages = [e for e in lines if e["kind"] == "stage" and "rl" in e["text"]]
            if stages and any(e["kind"] == "checkpoint" and e["step"] > stages[0]["step"] for e in lines):
                return
        time.sleep(0.5)
    raise AssertionError("no checkpoint of the RL stage within the time limit")


@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGKILL, -9)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_a_run_ends_with_everything_it_started(tmp_path, sig, code):
    manifest, out = _manifest(tmp_path), tmp_path / "out"
    proc = _start(manifest, out)
    try:
        _wait_for_rl_checkpoint(proc, out)
        started = set(descendants(proc.pid))
        assert any("kuberl sandbox serve" in c for c in alive(started).values()), alive(started)
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kuberl run still running 60 s after {sig.name}")
        assert proc.returncode == code, proc.stdout.read() if proc.stdout else ""
        deadline = time.monotonic() + 30
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert alive(started) == {}, f"left running after {sig.name}: {alive(started)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig in (signal.SIGTERM, signal.SIGKILL):
        # the same command again resumes from the newest checkpoint, which is whole, and finishes
        again = _start(manifest, out)
        text, _ = again.communicate(timeout=600)
        assert again.returncode == 0, text[-3000:]
        assert "resumed from" in text, text[-3000:]
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        rl_steps = sorted({r["step"] for r in records if r.get("type") == "rl"})
        assert rl_steps[-1] == 4 + 30, rl_steps  # 4 SFT steps, then every RL step


def test_a_run_whose_sandbox_workers_are_killed_trains_every_step(tmp_path):
    """SIGKILL of the sandbox's worker (in its own PID namespace: its whole call tree goes),
    three times during the RL stage, each once its replacement has run for a second: the
    service replaces it, a call that was running comes back as a failed tool call, and every
    step trains on all of its rollouts."""
    doc = copy.deepcopy(TINY)
    doc["metadata"]["name"] = "worker-kills"
    doc["spec"]["stages"] = [
        {"name": "sft", "type": "sft", "steps": 60, "learningRate": 0.01, "batchSize": 8},
        {"name": "rl", "type": "rl", "steps": 6},
    ]
    doc["spec"]["algorithm"]["batchPrompts"] = 4
    doc["spec"]["sandbox"]["pool"]["workersPerPod"] = 1
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    env = dict(os.environ, KUBERL_NO_RAY="1")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kuberl", "run", str(manifest), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 480
        while proc.poll() is None and time.monotonic() < deadline and len(killed) < 3:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and '"label": "sft"' in metrics.read_text():  # the RL stage runs
                workers = {pid for pid, cmd in alive(set(descendants(proc.pid))).items()
                           if "kuberl.sandbox.process.worker" in cmd and not cmd.startswith("/usr/bin/unshare")}
                for pid in workers:
                    with contextlib.suppress(OSError):  # gone meanwhile
                        # the worker itself, not a process it forked (whose command line is the
                        # worker's): its whole call tree goes with it
                        if _parent(pid) not in workers and time.monotonic() - _started(pid) > 1.0:
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
            time.sleep(0.3)
        output = proc.communicate(timeout=480)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert len(killed) == 3, "the worker was found and killed three times"
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"type": "rl"' in x]
    assert len(rl) == 6, rl
    assert all(r["rollouts"] == 4 * 2 * 2 and r["rollouts_aborted"] == 0 for r in rl), rl


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first; proc(5)'s 3rd on)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _started(pid: int) -> float:
    """When ``pid`` started, on time.monotonic()'s clock (both count from boot)."""
    ticks = int(_stat(pid)[19])
    return ticks / os.sysconf("SC_CLK_TCK")
