"""What `kuberl status` shows: a run's figures on one screen, from a run folder or a job's status.

Pure functions (dicts in, lines out), so the local and the cluster views are tested without a
terminal or a cluster; :mod:`kuberl.cli_status` reads the run folder or the API and prints.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from pathlib import Path
from typing import Any

from kuberl.api.job import PRIORITY_LABEL, QUEUE_LABEL
from kuberl.trainer.progress import duration, eta_seconds, step_figures, tokens_per_second
from kuberl.trainer.step_record import StepRecord


def _f(v: Any, fmt: str = ".3f") -> str:
    return (
        format(v, fmt)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        else "-"
    )


def _mean(xs: list[Any]) -> float | None:
    vals = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


# --- a local run folder ------------------------------------------------------------------------


def read_run_folder(run_dir: str | Path) -> tuple[list[StepRecord], list[dict], dict]:
    """metrics.jsonl, events.jsonl and run.json of a run folder (ValueError naming what to pass)."""
    from kuberl.trainer.report import ReportError, load_run

    d = Path(run_dir)
    try:
        records, events = load_run(d)
    except ReportError as err:
        raise ValueError(str(err)) from None
    info_path = d / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    return records, events, info


def local_lines(
    run_dir: str, records: list[StepRecord], events: list[dict], info: dict, now: float | None = None
) -> list[str]:
    """The one-screen view of a run folder."""
    now = time.time() if now is None else now
    steps = [r for r in records if r.type in ("sft", "rl")]
    job = info.get("job") or next((r.job for r in records if r.job), "?")
    stages = [(s["name"], s["type"], int(s["steps"])) for s in info.get("stages", [])]
    totals = {name: n for name, _, n in stages}
    last_event = events[-1] if events else {}
    last_time = max([r.time or 0 for r in records] + [e.get("time") or 0 for e in events])
    if last_event.get("kind") == "done":
        state = str(last_event.get("text", "finished"))
    else:
        state = f"running, or interrupted (last record {duration(now - last_time)} ago)"
    lines = [f"run {run_dir} (job {job}): {state}"]
    if not steps:
        return [*lines, "no step finished yet"]
    last = steps[-1]
    stage = last.stage
    stage_total = totals.get(stage)
    of = f"/{stage_total}" if stage_total else ""
    run_total = f"/{sum(totals.values())}" if totals else ""
    lines.append(f"stage {stage} ({last.type}) step {last.stage_step}{of}, run step {last.step}{run_total}")
    rl = [r for r in steps if r.type == "rl"]
    if rl:
        recent = _mean([x.reward_mean for x in rl[-5:]])
        lines.append(
            f"{step_figures(rl[-1])}  (mean reward of the last {min(5, len(rl))} steps {_f(recent)})"
        )
    elif last.type == "sft":
        lines.append(f"sft {step_figures(last)}")
    evals = [r for r in records if r.type == "eval"]
    if evals:
        lines.append("held-out accuracy: " + ", ".join(f"{e.label} {_f(e.accuracy)}" for e in evals))
    by_kind: dict[str, float] = {}
    for kind in ("sft", "rl"):
        m = _mean([x.step_seconds for x in steps if x.type == kind][-20:])
        if m is not None:
            by_kind[kind] = m
    eta = eta_seconds(stages, stage, last.stage_step or 0, by_kind) if stages else None
    tps = tokens_per_second(rl[-1]) if rl else None
    timing = f"step time {_f(last.step_seconds, '.1f')} s"
    if tps is not None:
        timing += f"  {tps:.0f} tok/s"
    if "done" != last_event.get("kind"):
        timing += f"  ETA {duration(eta)}"
    lines.append(timing)
    ckpt = [e for e in events if e.get("kind") == "checkpoint"]
    if ckpt:
        lines.append(f"last checkpoint: step {ckpt[-1].get('step')} ({ckpt[-1].get('text')})")
    return lines


# --- a job on a cluster ------------------------------------------------------------------------


def _age(ts: str | None, now: datetime.datetime) -> str:
    if not ts:
        return "-"
    try:
        t = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    return duration((now - t).total_seconds())


def job_row(obj: dict[str, Any], now: datetime.datetime) -> list[str]:
    """One line of the job list: NAME PHASE STAGE STEP REWARD PASS TOOL-ERR AGE."""
    st = obj.get("status") or {}
    summary = st.get("summary") or {}
    meta = obj.get("metadata") or {}
    return [
        meta.get("name", "?"),
        st.get("phase") or "-",
        st.get("stage") or "-",
        str(st["step"]) if st.get("step") is not None else "-",
        _f(summary.get("rewardMean")),
        _f(summary.get("passRate")),
        _f(summary.get("toolErrorRatio")),
        _age(meta.get("creationTimestamp"), now),
    ]


LIST_HEADER = ["NAME", "PHASE", "STAGE", "STEP", "REWARD", "PASS", "TOOL-ERR", "AGE"]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _ready(kind: str, obj: dict[str, Any] | None) -> str:
    if obj is None:
        return "not found"
    st = obj.get("status") or {}
    if kind == "Job":
        want = (obj.get("spec") or {}).get("parallelism", 1)
        done = int(st.get("succeeded") or 0)
        failed = int(st.get("failed") or 0)
        text = f"{int(st.get('ready') or 0)}/{want} ready, {int(st.get('active') or 0)} active"
        if done or failed:
            text += f", {done} succeeded, {failed} failed"
        return text
    want = (obj.get("spec") or {}).get("replicas", st.get("replicas", 0))
    return f"{int(st.get('readyReplicas') or 0)}/{want} ready ({st.get('phase') or '-'})"


def cluster_lines(
    obj: dict[str, Any], children: list[tuple[str, str, dict[str, Any] | None]], now: datetime.datetime
) -> list[str]:
    """The one-screen view of one AgenticRLJob: its status and each child's readiness.

    ``children``: (kind, name, live object or None) of the trainer Job, the fleet and the pool.
    """
    meta = obj.get("metadata") or {}
    st = obj.get("status") or {}
    summary = st.get("summary") or {}
    gen, seen = meta.get("generation"), st.get("observedGeneration")
    stale = "" if gen is None or seen == gen else f"  (status of generation {seen}, spec is at {gen})"
    lines = [
        f"AgenticRLJob {meta.get('namespace', '?')}/{meta.get('name', '?')}: {st.get('phase') or 'no status yet'}{stale}"
    ]
    labels = meta.get("labels") or {}
    if labels.get(QUEUE_LABEL):
        held = next((c for c in st.get("conditions") or [] if c.get("type") == "Suspended"), {})
        priority = f", priority class {labels[PRIORITY_LABEL]}" if labels.get(PRIORITY_LABEL) else ""
        state = f"{held.get('reason')}: {held.get('message', '')}" if held else "not seen by the operator yet"
        lines.append(f"queue: LocalQueue {labels[QUEUE_LABEL]}{priority}; {state}")
    stages = ((obj.get("spec") or {}).get("stages")) or []
    total = sum(int(s.get("steps") or 0) for s in stages)
    step = st.get("step")
    lines.append(
        f"stage {st.get('stage') or '-'}  step {step if step is not None else '-'}{f'/{total}' if total else ''}  "
        f"reward {_f(summary.get('rewardMean'))}  pass rate {_f(summary.get('passRate'))}  "
        f"tool-err+ {_f(summary.get('toolErrorRatio'))}"
    )
    started = st.get("startTime")
    if started:
        ended = st.get("completionTime")
        lines.append(
            f"started {started}"
            + (f", completed {ended}" if ended else f", running for {_age(started, now)}")
        )
    if st.get("lastCheckpoint"):
        lines.append(f"last checkpoint: {st['lastCheckpoint']}")
    lines.append("children:")
    lines += [f"  {kind} {name}: {_ready(kind, child)}" for kind, name, child in children]
    conds = st.get("conditions") or []
    if conds:
        lines.append("conditions:")
        lines += [
            f"  {c.get('type')}={c.get('status')} {c.get('reason', '')}: {c.get('message', '')}"
            for c in conds
        ]
    return lines


def child_refs(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of the objects a job's readiness depends on: its trainer Job, its fleet (inline,
    named ``<job>-rollout``, or spec.rollout.fleetRef) and its pool (``<job>-sandbox`` or poolRef)."""
    from kuberl.operator.render.job_builder import inline_fleet_name, inline_pool_name, trainer_name

    name = (obj.get("metadata") or {}).get("name", "")
    spec = obj.get("spec") or {}
    rollout, sandbox = spec.get("rollout") or {}, spec.get("sandbox") or {}
    out = [("Job", trainer_name(name))]
    if rollout.get("fleetRef"):
        out.append(("RolloutFleet", rollout["fleetRef"]))
    elif rollout.get("fleet") is not None:
        out.append(("RolloutFleet", inline_fleet_name(name)))
    if sandbox.get("poolRef"):
        out.append(("SandboxPool", sandbox["poolRef"]))
    elif sandbox.get("pool") is not None:
        out.append(("SandboxPool", inline_pool_name(name)))
    return out
