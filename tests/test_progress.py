"""Progress for logs (stdout not a terminal) and the per-step tool-call figures behind it."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import yaml
from trainer_fakes import FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.rollout.tool_stats import ToolTally, summarize
from kuberl.trainer.progress import LogProgress, duration, eta_seconds, format_step, use_plain
from kuberl.trainer.step_record import StepRecord
from tests.test_trainer_pipeline import TINY

STAGES = [("sft", "sft", 4), ("rl", "rl", 10)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _rl(stage_step: int, step: int, **kw) -> StepRecord:
    return StepRecord(type="rl", stage="rl", stage_step=stage_step, step=step, step_seconds=2.0, **kw)


def test_eta_uses_each_stage_types_mean_step_time():
    # 2 sft steps left at 1 s, then 10 rl steps at the rl mean (3 s)
    assert eta_seconds(STAGES, "sft", 2, {"sft": 1.0, "rl": 3.0}) == 2 * 1.0 + 10 * 3.0
    # rl never seen yet: the current stage's mean stands in for it
    assert eta_seconds(STAGES, "sft", 2, {"sft": 1.0}) == 2 + 10
    assert eta_seconds(STAGES, "rl", 10, {"rl": 3.0}) == 0
    assert eta_seconds(STAGES, "nope", 1, {"rl": 1.0}) is None
    assert duration(3725) == "1h02m" and duration(125) == "2m05s" and duration(None) == "-"


def test_step_line_has_every_figure_a_log_reader_needs():
    rec = _rl(
        3, 7, reward_mean=0.4375, tool_error_ratio_positive=0.125, clip_low=0.0123, clip_high=0.004,
        response_clip_ratio=0.0625, response_length=88.2, response_tokens=1000.0,
    )  # fmt: skip
    line = format_step(rec, 10, 7, 14, 65.0)
    assert line == (
        "[kuberl] rl 3/10 (run 7/14) reward 0.44 tool-err+ 0.12 clip 0.012/0.004 trunc 0.06 len 88 "
        "step 2.0s 500 tok/s ETA 1m05s"
    )
    # a value the step could not measure (NaN: no correct rollout used a tool) prints as '-'
    assert "tool-err+ -" in format_step(_rl(1, 1, tool_error_ratio_positive=float("nan")), 10, 1, 14, None)


def test_lines_every_n_steps_or_s_seconds_and_at_stage_edges():
    out, clock = io.StringIO(), Clock()
    p = LogProgress(STAGES, out, every_steps=4, every_seconds=30, clock=clock)
    for i in range(1, 11):
        clock.t += 1
        p.step(_rl(i, 4 + i, reward_mean=0.5))
    steps = [line.split()[2] for line in out.getvalue().splitlines()]
    assert steps == ["1/10", "4/10", "8/10", "10/10"]  # first, every 4th, last
    out.truncate(0), out.seek(0)
    p.every_steps = 0
    for i in range(1, 9):
        clock.t += 20  # a line at most every 30 s: steps 1 (edge), 3, 5, 7 (40 s after the last)
        p.step(_rl(i, i))
    assert [line.split()[2] for line in out.getvalue().splitlines()] == ["1/10", "3/10", "5/10", "7/10"]
    out.truncate(0), out.seek(0)
    p.step(StepRecord(type="eval", label="sft", step=4, accuracy=0.25, tool_error_ratio_positive=0.5))
    p.event({"kind": "checkpoint", "text": "checkpoint ck/ckpt-4.pt", "stage": "sft", "step": 4})
    assert out.getvalue().splitlines() == [
        "[kuberl] eval after sft (step 4): held-out accuracy 0.250 tool-err+ 0.50",
        "[kuberl] checkpoint: checkpoint ck/ckpt-4.pt (step 4)",
    ]


def test_plain_unless_a_terminal_and_the_environment_can_force_either():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_plain(io.StringIO(), {}) and not use_plain(Tty(), {})
    assert use_plain(Tty(), {"KUBERL_PROGRESS": "plain"})
    assert not use_plain(io.StringIO(), {"KUBERL_PROGRESS": "rich"})
    with pytest.raises(ValueError, match="KUBERL_PROGRESS must be auto, plain or rich"):
        use_plain(io.StringIO(), {"KUBERL_PROGRESS": "fancy"})
    with pytest.raises(ValueError, match="KUBERL_PROGRESS_EVERY_STEPS must be a number"):
        LogProgress(STAGES, io.StringIO(), env={"KUBERL_PROGRESS_EVERY_STEPS": "ten"})


def test_tool_tally_counts_outcomes_and_latency_between_takes():
    async def go():
        tally = ToolTally(FakeSandbox())
        await tally.execute("print(1)")
        await tally.execute("1 / 0")
        await tally.execute("x = 2")
        first = tally.take()
        assert await tally.verify("1", "1")  # everything else passes through
        return first, tally.take()

    first, second = asyncio.run(go())
    assert (first["tool_calls_stdout"], first["tool_calls_error"], first["tool_calls_no_stdout"]) == (1, 1, 1)
    assert 0 <= first["tool_latency_p50"] <= first["tool_latency_p95"] <= first["tool_latency_max"]
    assert second == summarize([], []) and "tool_latency_p50" not in second


def test_run_to_a_file_prints_progress_lines_while_it_runs(tmp_path, monkeypatch):
    """What a pod's log or `kuberl run > run.log` shows: lines per step, evals and events, no bars."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 8)
    monkeypatch.setenv("KUBERL_PROGRESS_EVERY_STEPS", "2")
    monkeypatch.delenv("KUBERL_PROGRESS", raising=False)
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(TINY))
    job = find_one(load_manifests(str(f)), AgenticRLJob)
    from kuberl.trainer.local import run_job

    out = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stdout", out)
    run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox)
    monkeypatch.undo()
    lines = [x for x in out.getvalue().splitlines() if x.startswith("[kuberl] ")]
    steps = [x.split()[1:3] for x in lines if "(run " in x]
    assert steps == [["sft", "1/4"], ["sft", "2/4"], ["sft", "4/4"], ["rl", "1/2"], ["rl", "2/2"]]
    assert any(x.startswith("[kuberl] eval after sft") for x in lines)
    assert any(x.startswith("[kuberl] stage: stage rl (rl) starts") for x in lines)
    rl_line = next(x for x in lines if x.split()[1:3] == ["rl", "2/2"])
    assert "reward " in rl_line and "tok/s" in rl_line and "ETA 0s" in rl_line
    rl = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("type") == "rl"]
    calls = sum(r[f"tool_calls_{o}"] for r in rl for o in ("stdout", "no_stdout", "error"))
    assert calls >= 1  # the seeded run makes one
    assert calls == sum(r["tool_calls_mean"] * r["rollouts"] for r in rl)  # every call of the step, once


def test_sandbox_window_line_and_idle_silence():
    from kuberl.sandbox.service.progress import Window, format_window

    w = Window()
    assert format_window(w.take(), 60, 0, 0, 4, 0) is None  # idle: no line
    for s in (0.01, 0.02, 0.03, 0.5):
        w.add_exec("stdout", s)
    w.add_exec("error", 0.04)
    w.add_verify("correct")
    line = format_window(w.take(), 60, 3, 2, 4, 1)
    assert line == (
        "[kuberl sandbox] last 60s: 5 exec (stdout 4, error 1; latency p50 0.030s p95 0.500s); "
        "1 verify (correct 1); queue 3, 2/4 workers busy, 1 worker restarts"
    )
    assert sum(w.exec.values()) == 0  # taken


def test_sandbox_serve_logs_what_it_did(tmp_path):
    """`kuberl sandbox serve` (a pod's log): a line per window in which calls were answered."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    env = dict(os.environ, KUBERL_PROGRESS_EVERY_SECONDS="0.5")
    cmd = [sys.executable, "-P", "-m", "kuberl", "sandbox", "serve", "--port", "0", "--workers", "1",
           "--isolation", "basic"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = proc.stdout.readline().split("listening on ", 1)[1].strip()
        assert "ready" in proc.stdout.readline()
        body = json.dumps({"id": "call-1", "code": "print(6 * 7)", "stdin": ""}).encode()
        req = urllib.request.Request(url + "/v1/execute", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as rsp:
            assert json.loads(rsp.read())["outcome"] == "stdout"
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and not line.startswith("[kuberl sandbox]"):
            line = proc.stdout.readline()
        assert line.startswith("[kuberl sandbox] last 0.5s: 1 exec (stdout 1; latency p50 "), line
        assert "0 verify; queue 0, 0/1 workers busy, 0 worker restarts" in line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_failing_listener_costs_its_records_not_the_run(tmp_path, capsys):
    from kuberl.trainer.metrics import MetricsSink

    class Broken:
        def step(self, rec):
            raise ConnectionError("tracking server gone")

        event = step

        def close(self):
            raise ConnectionError("still gone")

    seen = []

    class Fine:
        def step(self, rec):
            seen.append(rec.step)

        def event(self, rec):
            pass

        def close(self):
            pass

    sink = MetricsSink("j", tmp_path, [Broken(), Fine()])
    for i in range(1, 13):
        sink.step(StepRecord(type="sft", stage="sft", step=i, loss=1.0))
    assert seen == list(range(1, 13))  # the next listener still got every record
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 12
    sink.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "warning: Broken failed (1 time): tracking server gone",
        "warning: Broken failed (10 times): tracking server gone",
        "warning: closing Broken failed: still gone",
    ]
