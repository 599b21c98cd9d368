"""Experiment trackers (``spec.tracking``): Weights & Biases, MLflow, TensorBoard.

Each tracker is a :class:`~kuberl.trainer.metrics.MetricsSink` listener: it sees the same step
records and events as metrics.jsonl and logs them under the Prometheus series names
(:func:`tracker_metrics`), over the global step. The packages are an optional extra and are
imported only when a job names their tracker; a missing one is a :class:`ManifestError` that
names the extra to install.

A resumed run continues the same tracked run: the W&B run id and the MLflow run id are kept in
``tracking.json`` in the run folder and next to the checkpoints (a trainer pod's run folder
dies with the pod, its checkpoints do not). The trackers' local stores (MLflow's default file
store, TensorBoard's default log dir, W&B's offline runs) live in the run folder, or in
``$KUBERL_TRACKING_DIR``, which the operator points at the checkpoint volume: a restarted
trainer pod then finds the MLflow run it resumes into, and the event files it continues. A kept
run id that the store no longer holds (a local store lost with its pod) starts a new tracked run
with a warning instead of failing the run. Steps logged after the checkpoint a run resumes
from are logged again by the resumed run: TensorBoard is told to drop the old ones
(``purge_step``), W&B plots against ``global_step`` (a metric, so a repeated step is allowed),
MLflow keeps both values of such a step.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import ManifestError
from kuberl.api.tracking import MlflowSpec, TensorBoardSpec, WandbSpec
from kuberl.trainer.step_record import StepRecord

STATE_FILE = "tracking.json"
DIR_ENV = "KUBERL_TRACKING_DIR"
"""Where the trackers' local stores go instead of the run folder (set by the operator)."""
EXTRA = "pip install 'kuberl[tracking]'"

# step record figure -> the Prometheus series it is exported as (trainer/metrics.py, DESIGN.md)
SERIES = {
    "reward_mean": "kuberl_train_reward_mean",
    "response_clip_ratio": "kuberl_train_response_clip_ratio",
    "tool_error_ratio_positive": "kuberl_train_tool_error_ratio_positive",
    "response_length": "kuberl_train_response_length_tokens",
    "step_seconds": "kuberl_train_step_seconds",
    "clip_low": "kuberl_train_clip_ratio/low",
    "clip_high": "kuberl_train_clip_ratio/high",
    "rollouts_stale": "kuberl_train_rollouts_stale",
    "kv_cache_utilization": "kuberl_rollout_kv_cache_utilization",
}
SKIP = {"time", "step", "stage_step", "staleness_max"}
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def _name(key: str) -> str:
    """A metric name every tracker accepts (MLflow allows letters, digits, _ - . space /)."""
    return _UNSAFE.sub("_", key)


def tracker_metrics(rec: StepRecord) -> dict[str, float]:
    """The numbers of one step record (its metrics.jsonl form) under the names the trackers log them as.

    RL records use the Prometheus series names (labels become a ``/suffix``: clip side, staleness
    age, engine); tool-call figures ``kuberl_tool_calls/<outcome>`` and
    ``kuberl_tool_call_latency_seconds/<quantile>``; any other RL figure ``kuberl_train_<key>``;
    SFT ``kuberl_sft_<key>``; evals ``kuberl_eval_<key>``. Unknown values (None, NaN) are left out.
    """
    kind = rec.type
    out: dict[str, float] = {}
    for key, value in rec.to_json().items():
        if key in SKIP:
            continue
        if isinstance(value, dict) and key == "engine_logprob_gap":
            for engine, gap in value.items():
                if isinstance(gap, (int, float)) and math.isfinite(gap):
                    out[_name(f"kuberl_train_engine_logprob_gap/{engine}")] = float(gap)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if kind == "eval":
            name = f"kuberl_eval_{key}"
        elif kind == "sft":
            name = "kuberl_train_step_seconds" if key == "step_seconds" else f"kuberl_sft_{key}"
        elif key in SERIES:
            name = SERIES[key]
        elif key.startswith("staleness_") and key[len("staleness_") :].isdigit():
            name = f"kuberl_train_rollout_staleness/age_{key[len('staleness_') :]}"
        elif key.startswith("tool_calls_") and key != "tool_calls_mean":
            name = f"kuberl_tool_calls/{key[len('tool_calls_') :]}"
        elif key.startswith("tool_latency_"):
            name = f"kuberl_tool_call_latency_seconds/{key[len('tool_latency_') :]}"
        else:
            name = f"kuberl_train_{key}"
        out[_name(name)] = float(value)
    return out


def _need(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ManifestError(
            f"spec.tracking.{what} needs the {module.split('.')[0]} package, which is not installed "
            f"({err}): {EXTRA}"
        ) from None


class TrackingState:
    """Run ids that make a resumed run log into the same tracked run (``tracking.json``)."""

    def __init__(self, out: Path, store: Any = None, resume: bool = True):
        """``resume`` False (no checkpoint to resume from): new tracked runs, whatever ids are kept."""
        self.path = out / STATE_FILE
        self.store = store
        if resume and not self.path.is_file() and store is not None:
            store.get_file(STATE_FILE, self.path)  # a restarted pod's run folder is new: the kept ids
        self.ids: dict[str, str] = json.loads(self.path.read_text()) if resume and self.path.is_file() else {}

    def get(self, key: str) -> str | None:
        return self.ids.get(key)

    def put(self, key: str, value: str) -> None:
        self.ids[key] = value
        self.path.write_text(json.dumps(self.ids, indent=1, sort_keys=True) + "\n")
        if self.store is not None:
            self.store.put_file(self.path, STATE_FILE)


class _Tracker:
    """Base: ``log(metrics, step)`` and ``note(text, step)`` per tracker; records are converted once."""

    def step(self, rec: StepRecord) -> None:
        metrics = tracker_metrics(rec)
        if metrics:
            self.log(metrics, rec.step)

    def event(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "done":
            self.done = rec.get("text") == "run finished"
        self.note(f"{rec.get('kind')}: {rec.get('text')}", rec.get("step"))

    done = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def note(self, text: str, step: int | None) -> None:
        pass

    def close(self) -> None:
        pass


class WandbTracker(_Tracker):
    def __init__(self, spec: WandbSpec, job: AgenticRLJob, out: Path, state: TrackingState):
        wandb = _need("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE") or spec.mode
        if mode == "online" and not _wandb_key_available():
            raise ManifestError(
                "spec.tracking.wandb is online but no W&B API key is set: give spec.tracking.wandb.apiKeySecret "
                "(a Secret the operator puts into WANDB_API_KEY), set WANDB_API_KEY, or use mode: offline"
            )
        run_id = state.get("wandb_run_id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            name=job.metadata.name,
            id=run_id,
            resume="allow",
            dir=str(out),
            mode=mode,
            tags=list(spec.tags) or None,
            config=job.spec.wire(),
        )
        state.put("wandb_run_id", self.run.id)
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "global_step": step})

    def close(self) -> None:
        self.run.finish(exit_code=0)


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


class MlflowTracker(_Tracker):
    def __init__(self, spec: MlflowSpec, job: AgenticRLJob, out: Path, state: TrackingState):
        _need("mlflow", "mlflow")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = spec.tracking_uri or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store only on request; it is what a local run without a
            # server (or sqlalchemy) can use, and the tracking server reads it the same.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.Metric = Metric
        name = spec.experiment or job.metadata.name
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run_id = state.get("mlflow_run_id")
        if run_id is not None and not self._holds(run_id):
            print(
                f"[kuberl] tracking: MLflow run {run_id} is not in {uri} (a store lost with its pod?); "
                "logging to a new run",
                file=sys.stderr,
            )
            run_id = None
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=job.metadata.name)
            run_id = run.info.run_id
            a = job.spec.algorithm
            params = {"algorithm": a.name, "group_size": a.group_size, "learning_rate": a.learning_rate,
                      "batch_prompts": a.batch_prompts, "async_level": a.async_level, "model": job.spec.model.base,
                      "stages": ",".join(f"{s.name}:{s.type}x{s.steps}" for s in job.spec.stages)}  # fmt: skip
            self.client.log_batch(
                run_id,
                params=[Param(k, str(v)) for k, v in params.items()],
                tags=[RunTag("kuberl.job", job.metadata.name)],
            )
            state.put("mlflow_run_id", run_id)
        self.run_id = run_id

    def _holds(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, now, step) for k, v in metrics.items()])

    def note(self, text: str, step: int | None) -> None:
        self.client.set_tag(self.run_id, "kuberl.last_event", f"step {step}: {text}"[:5000])

    def close(self) -> None:
        # FINISHED only when the last stage ran; a time-limited stop resumes into this run later
        self.client.set_terminated(self.run_id, "FINISHED" if self.done else "KILLED")


class TensorBoardTracker(_Tracker):
    """Scalars and events (as text) in event files. The writer opens at the first step this
    process logs, with ``purge_step`` = that step, so TensorBoard drops what a run before a
    resume logged past the checkpoint."""

    def __init__(self, spec: TensorBoardSpec, job: AgenticRLJob, out: Path, state: TrackingState):
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.SummaryWriter = SummaryWriter
        self.log_dir = spec.log_dir or str(out / "tensorboard")
        self.writer = None
        self._pending: list[tuple[str, int | None]] = []

    def _open(self, step: int):
        if self.writer is None:
            self.writer = self.SummaryWriter(log_dir=self.log_dir, purge_step=step)
            for text, at in self._pending:
                self.writer.add_text("events", text, at)
            self._pending = []
        return self.writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        w = self._open(step)
        for k, v in metrics.items():
            w.add_scalar(k, v, step)

    def note(self, text: str, step: int | None) -> None:
        if self.writer is None:
            self._pending.append((text, step))
        else:
            self.writer.add_text("events", text, step)

    def close(self) -> None:
        if self.writer is None and self._pending:
            self._open(min((s for _, s in self._pending if s is not None), default=0))
        if self.writer is not None:
            self.writer.close()


TRACKERS: dict[str, Callable[..., _Tracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "tensorboard": TensorBoardTracker,
}


MODULES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}


def check_installed(job: AgenticRLJob) -> None:
    """Fail before any training when a named tracker's package is missing."""
    if job.spec.tracking is not None:
        for name in job.spec.tracking.enabled():
            _need(MODULES[name], name)


def open_trackers(
    job: AgenticRLJob, out: str | Path, store: Any = None, resume: bool = False
) -> list[_Tracker]:
    """The trackers ``job.spec.tracking`` names, started for the run folder ``out``, or with
    ``resume`` (the run resumes from a checkpoint) continuing the tracked runs it logged to.

    ``store`` (a CheckpointStore) keeps ``tracking.json`` beside the checkpoints. The trackers'
    default local stores go under ``$KUBERL_TRACKING_DIR`` when set, else ``out``. If one tracker
    fails to start, those already started are closed before the error is raised.
    """
    tracking = job.spec.tracking
    if tracking is None:
        return []
    out = Path(out)
    state = TrackingState(out, store, resume)
    root = Path(os.environ.get(DIR_ENV) or out)
    root.mkdir(parents=True, exist_ok=True)
    opened: list[_Tracker] = []
    try:
        for name in tracking.enabled():
            opened.append(TRACKERS[name](getattr(tracking, name), job, root, state))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened
