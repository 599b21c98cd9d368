"""A suspended or preempted trainer (SIGTERM from the kubelet) finishes its step, writes a
checkpoint there and ends with 143; the same run started again resumes at that step, and its
metrics hold every step once: none lost, none trained twice. Real training on the local engine."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.test_trainer_pipeline import TINY

SFT_STEPS, RL_STEPS = 4, 30


def _manifest(tmp_path: Path) -> Path:
    doc = copy.deepcopy(TINY)
    doc["metadata"]["name"] = "suspended"
    doc["spec"]["stages"][1]["steps"] = RL_STEPS
    # no periodic checkpoint in the RL stage: the one it resumes from is the SIGTERM's
    doc["spec"]["checkpoint"] = {"uri": str(tmp_path / "ck"), "everySteps": 1000, "keep": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(manifest: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, KUBERL_NO_RAY="1")
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "kuberl", "run", str(manifest), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=manifest.parent,
    )  # fmt: skip


def _records(out: Path, name: str) -> list[dict]:
    path = out / name
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in _records(out, "metrics.jsonl") if r.get("type") in ("sft", "rl")]


def test_sigterm_checkpoints_the_step_and_the_run_resumes_there(tmp_path):
    manifest, out = _manifest(tmp_path), tmp_path / "out"
    proc = _run(manifest, out)
    try:
        deadline = time.monotonic() + 300
        while max(_steps(out), default=0) < SFT_STEPS + 3:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no third RL step within 300 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)  # within a pod's grace period: one step and a save
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, text[-3000:]
    stopped_at = max(_steps(out))
    assert SFT_STEPS + 3 <= stopped_at < SFT_STEPS + RL_STEPS
    events = _records(out, "events.jsonl")
    saves = [e["step"] for e in events if e["kind"] == "checkpoint"]
    assert saves[-1] == stopped_at, (saves, stopped_at)  # the step in flight finished and was saved
    assert events[-1]["kind"] == "done" and "SIGTERM" in events[-1]["text"], events[-1]
    assert not [e for e in events if e["kind"] == "eval" and e["step"] == stopped_at]  # no eval in the grace

    again = _run(manifest, out)
    text, _ = again.communicate(timeout=600)
    assert again.returncode == 0, text[-3000:]
    resumes = [e["text"] for e in _records(out, "events.jsonl") if e["kind"] == "resume"]
    assert resumes == [f"resumed at global step {stopped_at}"], resumes
    # every step once, in order: nothing lost beyond the checkpoint, nothing trained twice
    assert _steps(out) == list(range(1, SFT_STEPS + RL_STEPS + 1)), _steps(out)



def test_the_relay_ends_a_command_that_fails_after_sigterm_with_143(tmp_path):
    """torchrun ends with 1 on SIGTERM; under the relay the trainer pod ends with 143, which its
    Job's pod failure policy ignores. Other ends pass through as they are."""
    child = tmp_path / "child.py"
    child.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(sys.argv[1])))\n"
        "print('ready', flush=True)\n"
        "time.sleep(float(sys.argv[3]))\n"
        "sys.exit(int(sys.argv[2]))\n"
    )

    def run(on_term: int, at_end: int, sleep: float, signal_it: bool) -> int:
        args = [sys.executable, "-m", "kuberl.util.relay", sys.executable, str(child), str(on_term), str(at_end), str(sleep)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if signal_it:
            proc.send_signal(signal.SIGTERM)
        return proc.wait(90)

    assert run(1, 0, 60, True) == 143  # torchrun's 1 after the SIGTERM
    assert run(3, 0, 60, True) == 143
    assert run(0, 0, 60, True) == 0  # done anyway: a success stays one
    assert run(0, 3, 0, False) == 3  # no SIGTERM: its own exit code
