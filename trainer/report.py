"""``kuberl report RUN_DIR``: one self-contained HTML page with a run's curves.

For people without Grafana: the panels of the training dashboard (dashboards/definitions.py)
drawn from the run folder's metrics.jsonl and events.jsonl, with the stage boundaries marked.
The page has no external reference at all (charts are inline SVG from :mod:`kuberl.trainer.svg`,
styles and the legend script inline), so it opens offline and can be kept as a CI artifact.
``kuberl run`` writes it to ``RUN_DIR/report.html`` at the end of every run.

Pure core: :func:`build_charts` (records and events in, charts out) and :func:`render_html`;
:func:`write_report` is the I/O shell.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from kuberl.sandbox.types import OUTCOMES
from kuberl.trainer.progress import duration, tokens_per_second
from kuberl.trainer.step_record import StepRecord
from kuberl.trainer.svg import Chart, Mark, Series, has_data, legend, render

REPORT_NAME = "report.html"


class ReportError(ValueError):
    """The folder is not a run folder (no metrics.jsonl), or a line of it is not JSON or not a
    step record."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if n == len(lines):
                break  # the last line of a run still being written may be cut short
            raise ReportError(f"{path}:{n} is not JSON ({err.msg})") from None
    return out


def load_run(run_dir: str | Path) -> tuple[list[StepRecord], list[dict[str, Any]]]:
    """The step records and events of a run folder (what ``kuberl run --out`` wrote)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ReportError(f"{d} is not a folder; pass the run folder of `kuberl run` (default runs/<job>)")
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(
            f"{d} has no metrics.jsonl: it is not a run folder, or the run has not finished a step yet"
        )
    records = []
    for n, obj in enumerate(read_jsonl(metrics), 1):
        try:
            records.append(StepRecord.from_json(obj))
        except (TypeError, ValueError) as err:
            raise ReportError(f"{metrics}: record {n}: {err}") from None
    return records, read_jsonl(d / "events.jsonl")


Figure = Callable[[StepRecord], float | None]


def _pts(recs: Sequence[StepRecord], fig: Figure) -> tuple[tuple[float, float | None], ...]:
    return tuple((float(r.step), fig(r)) for r in recs)


def stage_marks(events: Sequence[dict[str, Any]]) -> list[Mark]:
    """Where each stage started (its ``stage ... starts`` event), once per stage."""
    marks, seen = [], set()
    for e in events:
        if (
            e.get("kind") == "stage"
            and str(e.get("text", "")).endswith("starts")
            and e.get("stage") not in seen
        ):
            seen.add(e.get("stage"))
            marks.append(Mark(float(e.get("step") or 0), str(e.get("stage"))))
    return marks


def build_charts(records: Sequence[StepRecord], events: Sequence[dict[str, Any]]) -> list[Chart]:
    """The report's panels, in the training dashboard's order, over global step."""
    rl = [r for r in records if r.type == "rl"]
    sft = [r for r in records if r.type == "sft"]
    evals = [r for r in records if r.type == "eval"]
    marks = stage_marks(events)
    xs = [float(r.step) for r in records] + [m.x for m in marks]
    x_range = (min(xs), max(xs)) if xs and max(xs) > min(xs) else None

    def chart(title: str, series: list[Series], **kw) -> Chart:
        return Chart(title, series, marks=marks, x_range=x_range, **kw)

    charts = [
        chart(
            "Reward (mean)",
            [
                Series("all rollouts", _pts(rl, lambda r: r.reward_mean)),
                Series("kept (after RoC)", _pts(rl, lambda r: r.reward_kept_mean)),
            ],
            y_min=0,
            y_max=1,
        ),
        chart(
            "Held-out accuracy (sampled, T=rollout temperature)",
            [
                Series(
                    "eval after " + "/".join(sorted({str(e.label) for e in evals})),
                    _pts(evals, lambda r: r.accuracy),
                    True,
                )
            ]
            if evals
            else [Series("eval", ())],
            y_min=0,
            y_max=1,
            note="One point per evaluation (the end of each stage).",
        ),
        chart(
            "Tool-error ratio in positive rollouts",
            [
                Series("train rollouts", _pts(rl, lambda r: r.tool_error_ratio_positive)),
                Series("held-out eval", _pts(evals, lambda r: r.tool_error_ratio_positive), True),
            ],
            y_min=0,
            note="Tool errors per tool call inside correct rollouts (rStar2-Agent fig. 4); GRPO-RoC should push it down.",
        ),
        chart(
            "PG clip fraction (low / high)",
            [
                Series("low (1-eps_low)", _pts(rl, lambda r: r.clip_low)),
                Series("high (1+eps_high)", _pts(rl, lambda r: r.clip_high)),
            ],
            y_min=0,
        ),
        chart("Response length (tokens)", [Series("mean", _pts(rl, lambda r: r.response_length))], y_min=0),
        chart(
            "Response truncation",
            [Series("truncated at maxResponseTokens", _pts(rl, lambda r: r.response_clip_ratio))],
            y_min=0,
            note="Rising values mean the stage's response budget is too small.",
        ),
        chart(
            "Tool-call latency",
            [Series(q, _pts(rl, lambda r, q=q: r.tool_latency.get(q))) for q in ("p50", "p95", "max")],
            unit="s",
            y_min=0,
            note="Submission to result, as the rollouts saw it.",
        ),
        chart(
            "Tool-call outcomes per step",
            [Series(o, _pts(rl, lambda r, o=o: r.tool_calls.get(o))) for o in OUTCOMES],
            y_min=0,
        ),
        chart(
            "Rollout tokens/s",
            [Series("response tokens / step wall time", _pts(rl, tokens_per_second))],
            y_min=0,
        ),
        chart(
            "KV-cache use",
            [Series("peak", _pts(rl, lambda r: r.kv_cache_utilization))],
            y_min=0,
            y_max=1,
            note="Highest reserved KV-cache tokens / capacity of any engine during the step (the scheduler's book-keeping).",
        ),
        chart(
            "Step time",
            [
                Series("step", _pts(sft + rl, lambda r: r.step_seconds)),
                Series("waiting for rollouts", _pts(rl, lambda r: r.rollout_seconds)),
                Series("update", _pts(rl, lambda r: r.update_seconds)),
            ],
            unit="s",
            y_min=0,
        ),
        chart(
            "SFT loss and token accuracy",
            [Series("loss", _pts(sft, lambda r: r.loss)), Series("token accuracy", _pts(sft, lambda r: r.token_acc))],
            y_min=0,
        ),
    ]
    targets = sorted({t for r in rl for t in r.length_gap_by_target})
    if targets:  # a run with spec.algorithm.lengthReward
        for title, overall, per_target, y_max, note in (
            ("|l_target - l_y| (tokens)", lambda r: r.length_gap_mean, lambda r: r.length_gap_by_target, None,
             "Mean distance of the response length from the target its prompt named (INTELLECT-2 section 3.1.2)."),
            ("adherence", lambda r: r.length_adherence, lambda r: r.length_adherence_by_target, 1,
             "Fraction of rollouts within 10 % of their target length."),
        ):  # fmt: skip
            series = [Series("all", _pts(rl, overall))]
            series += [Series(f"target {t}", _pts(rl, lambda r, t=t, f=per_target: f(r).get(t))) for t in targets]
            series.append(Series("held-out eval", _pts(evals, overall), True))
            charts.append(chart(f"Thinking budgets: {title}", series, y_min=0, y_max=y_max, note=note))
    return charts


def _num(v: Any, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def summary_rows(records: Sequence[StepRecord], events: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Headline figures of the page (job, last step, evals, how the run ended)."""
    steps = [r for r in records if r.type in ("sft", "rl")]
    evals = [r for r in records if r.type == "eval"]
    rows = [("job", str(next((r.job for r in records if r.job), "-")))]
    if steps:
        last = steps[-1]
        rows.append(("last step", f"{last.step} (stage {last.stage}, step {last.stage_step})"))
        t0, t1 = records[0].time, records[-1].time
        if t0 is not None and t1 is not None:
            rows.append(("time covered", duration(t1 - t0 + (steps[0].step_seconds or 0))))
    rl = [r for r in records if r.type == "rl"]
    if rl:
        rows.append(("reward (last RL step)", _num(rl[-1].reward_mean)))
    for e in evals:
        rows.append((f"held-out accuracy after {e.label}", _num(e.accuracy)))
    done = [e for e in events if e.get("kind") == "done"]
    rows.append(
        ("state", done[-1].get("text", "finished") if done else "running (or stopped without a final event)")
    )
    return rows


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:0 0 4px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:16px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.note{font-size:12px;color:#666;margin:2px 0 6px}
.key{font-size:12px;border:1px solid #ddd;background:#fff;border-radius:4px;margin:4px 4px 0 0;cursor:pointer}
.key span{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.key.off{opacity:.4}
table{border-collapse:collapse;font-size:13px;margin:8px 0 16px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
"""

SCRIPT = """
(function () {
  document.querySelectorAll('.panel').forEach(function (panel) {
    panel.querySelectorAll('button.key').forEach(function (key) {
      key.addEventListener('click', function () {
        var off = key.classList.toggle('off');
        panel.querySelectorAll('g.series').forEach(function (g) {
          if (g.getAttribute('data-series') === key.getAttribute('data-series')) {
            g.style.display = off ? 'none' : '';
          }
        });
      });
    });
  });
  document.documentElement.setAttribute('data-report-ready', String(document.querySelectorAll('svg.chart').length));
})();
"""


def render_html(records: Sequence[StepRecord], events: Sequence[dict[str, Any]], title: str) -> str:
    charts = build_charts(records, events)
    panels = []
    for c in charts:
        note = f'<p class="note">{escape(c.note)}</p>' if c.note else ""
        empty = "" if has_data(c) else " empty"
        panels.append(
            f'<section class="panel{empty}"><h2>{escape(c.title)}</h2>{note}{render(c)}'
            f"<div>{legend(c)}</div></section>"
        )
    summary = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in summary_rows(records, events)
    )
    ev_rows = "".join(
        f"<tr><td>{escape(str(e.get('step')))}</td><td>{escape(str(e.get('kind')))}</td>"
        f"<td>{escape(str(e.get('text')))}</td></tr>"
        for e in events
        if e.get("kind") != "metrics"
    )
    made = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{escape(title)}</h1><p class="note">kuberl run report, written {made}; x axes: global step, '
        "dashed lines: stage starts.</p>"
        f"<table>{summary}</table>"
        f'<div class="grid">{"".join(panels)}</div>'
        f'<h2 style="margin-top:16px">Events</h2><table><tr><th>step</th><th>kind</th><th>text</th></tr>{ev_rows}</table>'
        f"<script>{SCRIPT}</script></body></html>"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` (default ``RUN_DIR/report.html``) and return its path."""
    records, events = load_run(run_dir)
    job = next((r.job for r in records if r.job), Path(run_dir).name)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(records, events, f"kuberl run: {job}"), encoding="utf-8")
    tmp.replace(path)  # a browser reloading the page never sees half of it
    return path
