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
