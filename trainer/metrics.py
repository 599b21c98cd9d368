"""Training metrics: prometheus-client gauges (DESIGN.md names), metrics.jsonl and events.jsonl.

The gauges live in the default registry (created once per process, labelled by ``job``), and
are served over HTTP when ``KUBERL_METRICS_PORT`` is set (0 picks a free port, which is
printed and logged as an event) on all interfaces, so that Prometheus can scrape the trainer
pod through the containerPort the operator declares; ``KUBERL_METRICS_ADDR`` narrows it (e.g.
``127.0.0.1`` on a shared workstation). ``metrics.jsonl`` has one JSON object per step;
``events.jsonl`` has stage changes, checkpoints and the end of the run, for Grafana annotations.

The rollout side's ``kuberl_rollout_*`` series are exported by this process too: in-process
they are the Scheduler's and engine's own; a remote (Ray) rollout worker is mirrored by
:class:`kuberl.rollout.mirror.RolloutMirror`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, start_http_server

from kuberl.rollout.engine import ENGINE_FAULTS
from kuberl.trainer.step_record import StepRecord

RUN_INFO = "run.json"
KEPT_RUN_FILES = ("events.jsonl", "metrics.jsonl", RUN_INFO)
"""Run-folder files also kept beside the checkpoints (a trainer pod's run folder dies with it)."""
_GAUGES: dict[str, Gauge] = {}
_SERVER_PORT: int | None = None
_SERVER_ADDR: str | None = None


def _gauges() -> dict[str, Gauge]:
    if not _GAUGES:
        _GAUGES.update(
            reward=Gauge("kuberl_train_reward_mean", "Mean binary reward of the step's rollouts", ["job"]),
            clip=Gauge("kuberl_train_clip_ratio", "Token-level pg clip fraction", ["job", "side"]),
            resp_clip=Gauge(
                "kuberl_train_response_clip_ratio", "Fraction of rollouts truncated at max length", ["job"]
            ),
            tool_err=Gauge(
                "kuberl_train_tool_error_ratio_positive",
                "Tool errors / tool calls in correct rollouts",
                ["job"],
            ),
            length=Gauge("kuberl_train_response_length_tokens", "Mean response length (tokens)", ["job"]),
            step=Gauge("kuberl_train_step", "Current training step", ["job", "stage"]),
            step_s=Gauge("kuberl_train_step_seconds", "Wall time of the last step", ["job"]),
            staleness=Gauge(
                "kuberl_train_rollout_staleness",
                "Rollouts of the last step by policy versions behind the trained one (asyncLevel)",
                ["job", "age"],
            ),
            engine_gap=Gauge(
                "kuberl_train_engine_logprob_gap",
                "Mean |engine - trainer| log-prob of the step's fresh rollouts, per engine (spot check)",
                ["job", "engine"],
            ),
            length_penalty=Gauge(
                "kuberl_train_length_penalty_mean",
                "Mean alpha * |l_target - l_y| subtracted from the task reward (lengthReward)",
                ["job"],
            ),
            length_gap=Gauge(
                "kuberl_train_length_gap_tokens",
                "Mean |l_target - l_y| of the step's rollouts, per target length and over all (lengthReward)",
                ["job", "target"],
            ),
            length_adherence=Gauge(
                "kuberl_train_length_adherence",
                "Fraction of the step's rollouts within 10 % of their target length, per target and over all",
                ["job", "target"],
            ),
            rollout_wait=Gauge(
                "kuberl_train_rollout_wait_ratio",
                "Fraction of the last RL step the trainer waited for its rollouts (asyncLevel > 0: "
                "starved for rollouts, the fleet autoscaler adds engines), by the RolloutFleet it uses",
                ["job", "fleet"],
            ),
            engine_idle=Gauge(
                "kuberl_train_engine_idle_ratio",
                "Fraction of the last RL step no rollout batch was generating (asyncLevel > 0: engines "
                "waiting for weights, the fleet autoscaler removes engines), by the RolloutFleet it uses",
                ["job", "fleet"],
            ),
            engines_served=Gauge(
                "kuberl_train_engines_in_service",
                "Engines serving the trainer's rollouts at the end of its last RL step (asyncLevel > 0: "
                "the fleet autoscaler sizes the pipeline from them, not from replicas still starting), "
                "by the RolloutFleet it uses",
                ["job", "fleet"],
            ),
            stale=Counter(
                "kuberl_train_rollouts_stale",
                "Rollouts dropped for being older than asyncLevel or from a version never pushed",
                ["job"],
            ),
            engine_faults=Counter(
                "kuberl_rollout_engine_version_faults",
                "Engine answers from weights the trainer did not push (version_mismatch), the "
                "re-pushes that put the weights back (repush), requests that waited for a restarted "
                "engine (reconnect)",
                ["job", "kind"],
            ),
        )
    return _GAUGES


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class SinkListener(Protocol):
    """Sees every record the sink writes: log progress lines, experiment trackers."""

    def step(self, record: StepRecord) -> None: ...

    def event(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsSink:
    def __init__(self, job: str, out_dir: str | Path, listeners: Sequence[SinkListener] = ()):
        self.job = job
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.listeners: list[SinkListener] = list(listeners)
        self._failures: dict[int, int] = {}
        self.port: int | None = None
        self.addr: str | None = None
        port = os.environ.get("KUBERL_METRICS_PORT")
        if port is not None and port != "":
            global _SERVER_PORT, _SERVER_ADDR
            if _SERVER_PORT is None:  # one exporter per process, shared by successive runs
                addr = os.environ.get("KUBERL_METRICS_ADDR") or "0.0.0.0"  # noqa: S104 - scraped in-cluster
                server, _ = start_http_server(int(port), addr=addr)
                _SERVER_PORT, _SERVER_ADDR = server.server_port, server.server_address[0]
                print(f"metrics: http://{addr}:{_SERVER_PORT}/metrics")
            self.port, self.addr = _SERVER_PORT, _SERVER_ADDR
            self.event("metrics", f"prometheus metrics on port {self.port}")

    def forget_after(self, step: int) -> int:
        """Drop the records of global steps after ``step`` from metrics.jsonl (a run resumed
        from the checkpoint at ``step`` trains them again: each step keeps one record, the one
        whose update the run kept); returns how many were dropped."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return 0
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [ln for ln in lines if not _after(ln, step)]
        if len(kept) == len(lines):
            return 0
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)
        return len(lines) - len(kept)

    def step(self, record: StepRecord) -> None:
        """Append one step record and update the gauges it has values for."""
        rec = dataclasses.replace(record, time=time.time(), job=self.job)
        line = {k: _clean(v) for k, v in rec.to_json().items()}
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self._notify("step", rec)
        g = _gauges()
        if rec.stage is not None:
            g["step"].labels(self.job, rec.stage).set(rec.step)
        if rec.step_seconds is not None:
            g["step_s"].labels(self.job).set(rec.step_seconds)
        if rec.type != "rl":
            return
        setters = [
            ("reward", rec.reward_mean, ()),
            ("resp_clip", rec.response_clip_ratio, ()),
            ("tool_err", rec.tool_error_ratio_positive, ()),
            ("length", rec.response_length, ()),
            ("clip", rec.clip_low, ("low",)),
            ("clip", rec.clip_high, ("high",)),
        ]
        for gauge, v, extra in setters:
            if v is not None and math.isfinite(v):
                g[gauge].labels(self.job, *extra).set(v)
        step_s = rec.step_seconds or 0.0
        if rec.async_level and step_s > 0:  # the pipeline's sides, for the fleet autoscaler
            fleet = os.environ.get("KUBERL_ROLLOUT_FLEET", "")  # set by the operator on a cluster
            g["rollout_wait"].labels(self.job, fleet).set(min(1.0, (rec.rollout_seconds or 0.0) / step_s))
            if rec.engine_busy_seconds is not None:
                g["engine_idle"].labels(self.job, fleet).set(max(0.0, 1.0 - rec.engine_busy_seconds / step_s))
            if rec.engines_in_service:
                g["engines_served"].labels(self.job, fleet).set(rec.engines_in_service)
        for engine, gap in rec.engine_logprob_gap.items():
            g["engine_gap"].labels(self.job, engine).set(gap)
        if rec.length_penalty_mean is not None:
            g["length_penalty"].labels(self.job).set(rec.length_penalty_mean)
            for stat, overall, by_target in (
                ("length_gap", rec.length_gap_mean, rec.length_gap_by_target),
                ("length_adherence", rec.length_adherence, rec.length_adherence_by_target),
            ):
                if overall is not None:
                    g[stat].labels(self.job, "all").set(overall)
                for target, value in by_target.items():
                    g[stat].labels(self.job, str(target)).set(value)
        for _, key, kind in ENGINE_FAULTS:
            if count := getattr(rec, key):
                g["engine_faults"].labels(self.job, kind).inc(count)
        if rec.staleness_max is not None:
            for age in range(int(rec.staleness_max) + 1):
                g["staleness"].labels(self.job, str(age)).set(rec.staleness.get(age, 0.0))
            g["stale"].labels(self.job).inc(rec.rollouts_stale or 0.0)

    @property
    def events_path(self) -> Path:
        return self.out / "events.jsonl"

    def describe_run(self, stages: list[dict[str, Any]]) -> None:
        """run.json: the job's stages (name, type, steps), so readers of the run folder
        (``kuberl status``, the report) know each stage's length without the manifest."""
        path = self.out / RUN_INFO
        path.write_text(json.dumps({"job": self.job, "stages": stages}, indent=1) + "\n", encoding="utf-8")

    def event(self, kind: str, text: str, stage: str | None = None, step: int | None = None) -> None:
        rec = {"time": time.time(), "kind": kind, "text": text, "stage": stage, "step": step}
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        self._notify("event", rec)

    def _notify(self, method: str, rec: StepRecord | dict[str, Any]) -> None:
        """Hand ``rec`` to every listener. A failing one (a tracking server gone) costs its own
        records, never the run's: it is reported on stderr at its 1st, 10th, 100th... failure."""
        for listener in self.listeners:
            try:
                getattr(listener, method)(rec)
            except Exception as err:  # noqa: BLE001 - see above
                n = self._failures[id(listener)] = self._failures.get(id(listener), 0) + 1
                if math.log10(n).is_integer():
                    print(
                        f"warning: {type(listener).__name__} failed ({n} time{'s' if n > 1 else ''}): {err}",
                        file=sys.stderr,
                    )

    def close(self) -> None:
        """Close every listener (a tracker finishes its run); one failing is reported on stderr
        and does not stop the rest, nor fail a run whose checkpoints and metrics are written."""
        for listener in self.listeners:
            try:
                listener.close()
            except Exception as err:  # noqa: BLE001 - see above
                print(f"warning: closing {type(listener).__name__} failed: {err}", file=sys.stderr)
        self.listeners = []


def _after(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line is the record of a global step after ``step`` (a line that is
    not a record, a torn last line of a killed run included, is not kept either)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return True
    return not isinstance(rec, dict) or (isinstance(rec.get("step"), int) and rec["step"] > step)


class NullSink:
    """The sink of FSDP ranks other than 0: rank 0 alone writes records, events and gauges."""

    port: int | None = None
    events_path: Path | None = None

    def describe_run(self, stages: list[dict[str, Any]]) -> None:
        pass

    def step(self, record: StepRecord) -> None:
        pass

    def forget_after(self, step: int) -> int:
        return 0

    def event(self, kind: str, text: str, stage: str | None = None, step: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass

