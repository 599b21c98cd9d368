"""`kuberl report`: the run's curves as one self-contained HTML page, checked in headless Chromium."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import pytest
import yaml
from trainer_fakes import FakeSandbox

from kuberl.cli import main
from kuberl.trainer.report import ReportError, build_charts, load_run, render_html, write_report
from kuberl.trainer.step_record import StepRecord
from kuberl.trainer.svg import Chart, Series, nice_ticks, render, segments
from tests.test_trainer_pipeline import TINY


def test_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(3, 47) == [0, 20, 40, 60]
    assert nice_ticks(0.5, 0.5)[0] <= 0.5 <= nice_ticks(0.5, 0.5)[-1]  # a flat series still gets an axis


def test_a_missing_value_breaks_the_line_and_no_data_says_so():
    pts = ((1, 0.1), (2, 0.2), (3, float("nan")), (4, None), (5, 0.5), (6, 0.6))
    assert segments(pts) == [[(1, 0.1), (2, 0.2)], [(5, 0.5), (6, 0.6)]]
    svg = render(Chart("r", [Series("a", pts)]))
    assert svg.count("<polyline") == 2 and "no data" not in svg
    empty = render(Chart("r", [Series("a", ((1, None),))]))
    assert "<polyline" not in empty and "no data in this run" in empty
    dots = render(Chart("acc", [Series("eval", ((4, 0.2), (9, 0.7)), markers=True)]))
    assert dots.count("<circle") == 2


def _records() -> tuple[list[StepRecord], list[dict]]:
    recs = [{"job": "j", "type": "sft", "stage": "sft", "step": i, "stage_step": i, "loss": 1 / i, "token_acc": 0.5,
             "step_seconds": 1.0, "time": 100.0 + i} for i in range(1, 5)]  # fmt: skip
    recs.append({"type": "eval", "stage": "sft", "step": 4, "label": "sft", "accuracy": 0.25})
    for i in range(1, 4):
        recs.append(
            {"job": "j", "type": "rl", "stage": "rl", "step": 4 + i, "stage_step": i, "reward_mean": 0.1 * i,
             "clip_low": 0.01, "clip_high": 0.02, "response_length": 50.0, "response_clip_ratio": 0.0,
             "tool_error_ratio_positive": math.nan if i == 2 else 0.1, "tool_calls_stdout": 3.0,
             "tool_latency_p50": 0.1, "response_tokens": 400.0, "step_seconds": 2.0, "time": 110.0 + i}
        )  # fmt: skip
    events = [
        {"kind": "stage", "text": "stage sft (sft) starts", "stage": "sft", "step": 0},
        {"kind": "stage", "text": "optimizer reset before rl", "stage": "rl", "step": 4},
        {"kind": "stage", "text": "stage rl (rl) starts", "stage": "rl", "step": 4},
        {"kind": "done", "text": "run finished", "stage": None, "step": 7},
    ]
    return [StepRecord.from_json(r) for r in recs], events


def test_panels_follow_the_training_dashboard_and_mark_stage_starts():
    recs, events = _records()
    charts = {c.title: c for c in build_charts(recs, events)}
    reward = charts["Reward (mean)"].series[0]
    assert reward.points == ((5.0, 0.1), (6.0, 0.2), (7.0, 0.30000000000000004))
    assert [(m.x, m.label) for m in charts["Reward (mean)"].marks] == [(0.0, "sft"), (4.0, "rl")]
    assert charts["Held-out accuracy (sampled, T=rollout temperature)"].series[0].points == ((4.0, 0.25),)
    assert charts["Rollout tokens/s"].series[0].points[0] == (5.0, 200.0)
    for title in (
        "PG clip fraction (low / high)",
        "Tool-call latency",
        "Tool-call outcomes per step",
        "Step time",
    ):
        assert any(y is not None for s in charts[title].series for _, y in s.points), title
    html = render_html(recs, events, "kuberl run: j")
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    assert "https://" not in html and "<script src" not in html and "<link" not in html
    assert "run finished" in html and "held-out accuracy after sft" in html


def test_bad_run_folders_get_errors_that_say_what_to_pass(tmp_path):
    with pytest.raises(ReportError, match="not a folder"):
        load_run(tmp_path / "nope")
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"type": "sft"}\nnot json\n{"type": "sft"}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2 is not JSON"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"type": "sft", "step": 1}\n{"type": "s')  # a run mid-write
    assert load_run(tmp_path)[0] == [StepRecord(type="sft", step=1)]
    (tmp_path / "metrics.jsonl").write_text('{"type": "sft", "stage": "sft"}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl: record 1: step record without 'step'"):
        load_run(tmp_path)
    assert main(["report", str(tmp_path / "nope")]) == 2


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium)")


def _browser(*args: str) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--enable-logging=stderr", "--v=0", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_report_of_a_real_run_renders_in_headless_chromium(tmp_path, monkeypatch, capsys):
    """A real (tiny) run writes report.html at its end; Chromium opens it: the script ran to its
    end without an error, every panel with data has drawn marks, and the screenshot is not blank."""
    pytest.importorskip("PIL")
    from PIL import Image

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 8)
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(TINY))
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.trainer.local import run_job

    run = tmp_path / "run"
    run_job(
        find_one(load_manifests(str(f)), AgenticRLJob),
        run,
        use_ray=False,
        executor_factory=FakeSandbox,
        quiet=True,
    )
    page = run / "report.html"
    assert page.is_file()  # written at the end of the run
    assert main(["report", str(run), "--out", str(tmp_path / "again.html")]) == 0
    assert "again.html" in capsys.readouterr().out

    dom = _browser("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr and "SyntaxError" not in dom.stderr, dom.stderr[-2000:]
    charts = len(build_charts(*load_run(run)))
    # the page's script sets this as its last act: it ran, and found every chart in the DOM
    assert f'data-report-ready="{charts}"' in dom.stdout
    panels = re.findall(r'<section class="panel( empty)?"><h2>([^<]*)</h2>(.*?)</section>', dom.stdout, re.S)
    drawn = {
        title: body.count("<polyline") + body.count("<circle") for empty, title, body in panels if not empty
    }
    for title in ("Reward (mean)", "Response length (tokens)", "Step time", "SFT loss and token accuracy",
                  "Held-out accuracy (sampled, T=rollout temperature)", "Tool-call outcomes per step",
                  "Rollout tokens/s", "KV-cache use"):  # fmt: skip
        assert drawn.get(title, 0) > 0, (title, drawn)

    shot = tmp_path / "shot.png"
    res = _browser("--window-size=1400,2000", f"--screenshot={shot}", page.as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 2000)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, axes and coloured curves, not a blank page
    curve_blue = sum(n for n, (r, g, b) in colors if b > 150 and r < 80 and g < 160)
    assert curve_blue > 200  # the first series' colour (#1f77b4) was drawn


def test_metrics_lines_match_what_the_report_reads(tmp_path):
    recs, events = _records()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    path = write_report(tmp_path)
    assert path == tmp_path / "report.html" and "kuberl run: j" in path.read_text()
