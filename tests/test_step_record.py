"""The typed step record: its metrics.jsonl form round-trips, a bad line says what is wrong, and
every reader (gauges, trackers, progress lines, the report, ``kuberl status``, the run summary)
reads a record of each type by attribute, so a field renamed in the record and not in a reader
fails here."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest

from kuberl.status_view import local_lines
from kuberl.trainer.local import _brief, stop_reason, summarize
from kuberl.trainer.metrics import MetricsSink
from kuberl.trainer.progress import LogProgress, format_step, step_figures
from kuberl.trainer.report import build_charts, load_run, render_html, summary_rows
from kuberl.trainer.stage_host import RunResult
from kuberl.trainer.step_record import StepRecord, figure_fields
from kuberl.trainer.tracking import SERIES, SKIP, tracker_metrics

_VALUES = {
    "int": 3,
    "int | None": 3,
    "float | None": 0.25,
    "str | None": "x",
    "dict[int, float]": {1: 0.5, 64: 0.75},
    "dict[str, float]": {"stdout": 2.0, "p50": 0.1},
}


def _full(kind: str, step: int, stage_step: int) -> StepRecord:
    """A record with every field set: the report, trackers and status view find all they read."""
    values = {}
    for f in dataclasses.fields(StepRecord):
        if f.name in ("type", "step", "stage", "stage_step", "label", "job", "time"):
            continue
        values[f.name] = _VALUES[str(f.type)]
    stage = "sft" if kind == "sft" else "rl"
    return StepRecord(
        type=kind, step=step, stage=stage, stage_step=stage_step, label=stage, job="j", time=100.0 + step,
        **values,
    )  # fmt: skip


def _run() -> list[StepRecord]:
    return [
        _full("sft", 1, 1),
        _full("sft", 2, 2),
        dataclasses.replace(_full("eval", 2, 0), stage_step=None),
        _full("rl", 3, 1),
        _full("rl", 4, 2),
    ]


STAGES = [("sft", "sft", 2), ("rl", "rl", 2)]
EVENTS = [
    {"kind": "stage", "text": "stage sft (sft) starts", "stage": "sft", "step": 0, "time": 100.0},
    {"kind": "stage", "text": "stage rl (rl) starts", "stage": "rl", "step": 2, "time": 102.0},
    {"kind": "checkpoint", "text": "checkpoint ck/ckpt-4.pt", "stage": "rl", "step": 4, "time": 104.0},
]


def test_every_field_round_trips_through_its_metrics_line():
    for rec in _run():
        line = json.dumps(rec.to_json())
        assert StepRecord.from_json(json.loads(line)) == rec
    flat = _full("rl", 3, 1).to_json()
    # families are flat keys on disk, as the Prometheus and tracker names expect
    assert flat["staleness_1"] == 0.5 and flat["length_gap_t64"] == 0.75 and flat["tool_calls_stdout"] == 2.0
    assert flat["engine_logprob_gap"] == {"stdout": 2.0, "p50": 0.1}
    assert list(flat)[:6] == ["time", "job", "type", "stage", "step", "stage_step"]
    assert StepRecord(type="sft", step=1).to_json() == {"type": "sft", "step": 1}  # unmeasured: left out


def test_a_bad_record_says_what_is_missing_or_unknown():
    with pytest.raises(ValueError, match="without 'step'"):
        StepRecord.from_json({"type": "rl", "stage": "rl", "reward_mean": 0.5})
    with pytest.raises(ValueError, match="without 'type', 'step'"):
        StepRecord.from_json({"stage": "rl"})
    with pytest.raises(ValueError, match="unknown type 'ppo'"):
        StepRecord.from_json({"type": "ppo", "step": 1})
    # a writer's typo is caught where the record is made
    with pytest.raises(ValueError, match="'reward_avg' is no figure of a step record"):
        figure_fields({"reward_avg": 0.5})
    with pytest.raises(ValueError, match="'staleness_x' is no figure"):
        figure_fields({"staleness_x": 1.0})


def test_a_record_from_a_newer_kuberl_reads_back_with_the_figures_this_one_knows():
    """metrics.jsonl outlives the kuberl that wrote it: `kuberl status` and the report of a run
    written by a newer version skip the figures added since, and keep the rest."""
    newer = {"type": "rl", "step": 3, "stage": "rl", "reward_mean": 0.5, "staleness_1": 0.25,
             "kv_evictions": 7.0, "staleness_x": 1.0, "tool_calls_stdout": 2.0}
    rec = StepRecord.from_json(newer)
    assert (rec.type, rec.step, rec.stage, rec.reward_mean) == ("rl", 3, "rl", 0.5)
    assert rec.staleness == {1: 0.25} and rec.tool_calls == {"stdout": 2.0}
    assert "kv_evictions" not in rec.to_json()
    # what identifies a record is still required
    with pytest.raises(ValueError, match="without 'step'"):
        StepRecord.from_json({"type": "rl", "kv_evictions": 7.0})


def test_a_run_folder_is_read_back_as_records(tmp_path):
    recs = _run()
    sink = MetricsSink("j", tmp_path)
    for r in recs:
        sink.step(r)
    back, _ = load_run(tmp_path)
    assert [dataclasses.replace(r, time=None) for r in back] == [
        dataclasses.replace(r, time=None) for r in recs
    ]
    # a newer kuberl's figure is skipped; a record without its step is still named
    (tmp_path / "metrics.jsonl").write_text(
        '{"type": "rl", "step": 1, "reward_mean": 0.5, "mean_reward_v2": 0.5}\n{"type": "rl"}\n'
    )
    with pytest.raises(ValueError, match="record 2: step record without 'step'"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"type": "rl", "step": 1, "reward_mean": 0.5, "mean_reward_v2": 0.5}\n')
    assert [r.reward_mean for r in load_run(tmp_path)[0]] == [0.5]


def test_every_reader_reads_every_record_type():
    recs = _run()
    rl, sft, ev = recs[-1], recs[0], recs[2]
    # progress lines and the live bar: one formatting of a step's figures
    assert step_figures(rl) in format_step(rl, 2, 4, 4, 10.0) and step_figures(rl) in _brief(rl)
    assert step_figures(sft) in format_step(sft, 2, 1, 4, 10.0) and step_figures(sft) in _brief(sft)
    out = io.StringIO()
    progress = LogProgress(STAGES, out, every_steps=1, every_seconds=0)
    for r in recs:
        progress.step(r)
    assert len(out.getvalue().splitlines()) == len(recs)
    # kuberl status
    lines = local_lines("runs/j", recs, EVENTS, {"job": "j", "stages": [
        {"name": n, "type": t, "steps": s} for n, t, s in STAGES]}, now=110.0)  # fmt: skip
    assert step_figures(rl) in lines[2] and "held-out accuracy: rl 0.250" in lines
    assert "sft" in local_lines("runs/j", recs[:2], EVENTS[:1], {}, now=110.0)[2]
    # the report
    charts = build_charts(recs, EVENTS)
    for c in charts:  # every panel has a point: each figure it draws was found
        assert any(y is not None for s in c.series for _, y in s.points), c.title
    assert ("reward (last RL step)", "0.250") in summary_rows(recs, EVENTS)
    assert "kuberl run: j" in render_html(recs, EVENTS, "kuberl run: j")
    # trackers: every named series is a figure of the record
    for r in (rl, sft, ev):
        assert tracker_metrics(r)
    assert set(SERIES) <= set(rl.to_json()), set(SERIES) - set(rl.to_json())
    assert set(SKIP) <= set(rl.to_json())
    # the run summary and the stop reason
    s = summarize(RunResult(history=recs, evals={"sft": 0.2, "rl": 0.3}))
    assert s["reward_last"] == 0.25 and s["final_accuracy"] == 0.3 and not math.isnan(s["rl_step_seconds"])
    assert "in stage rl after global step 4" in stop_reason(RunResult(history=recs, stopped_early=True), 1.0)


def test_the_gauges_read_every_figure_they_export(tmp_path):
    from prometheus_client import REGISTRY

    sink = MetricsSink("record-gauges", tmp_path)
    rec = dataclasses.replace(_full("rl", 3, 1), async_level=1, staleness_max=1.0)
    sink.step(rec)
    job = {"job": "record-gauges"}
    assert REGISTRY.get_sample_value("kuberl_train_reward_mean", job) == 0.25
    assert REGISTRY.get_sample_value("kuberl_train_clip_ratio", {**job, "side": "high"}) == 0.25
    assert REGISTRY.get_sample_value("kuberl_train_rollout_staleness", {**job, "age": "1"}) == 0.5
    assert REGISTRY.get_sample_value("kuberl_train_length_gap_tokens", {**job, "target": "64"}) == 0.75
    assert REGISTRY.get_sample_value("kuberl_train_engine_logprob_gap", {**job, "engine": "p50"}) == 0.1
    assert (
        REGISTRY.get_sample_value("kuberl_rollout_engine_version_faults_total", {**job, "kind": "reconnect"})
        == 0.25
    )
