"""spec.tracking: W&B (offline), MLflow (file store) and TensorBoard, against the real libraries.

The tracked values are read back from what each library wrote (W&B's run file, MLflow's store,
TensorBoard's event files) and compared with metrics.jsonl; a run stopped mid-RL and resumed
must continue the same W&B and MLflow runs.
"""

from __future__ import annotations

import copy
import json
import struct
import sys

import builders
import pytest
from trainer_fakes import FakeSandbox

from kuberl.api.loader import ManifestError
from kuberl.operator.render.builders import build_for
from kuberl.trainer.step_record import StepRecord
from kuberl.trainer.tracking import STATE_FILE, open_trackers, tracker_metrics
from tests.test_trainer_pipeline import TINY


def test_records_are_logged_under_the_prometheus_series_names():
    rl = {"type": "rl", "stage": "rl", "step": 7, "stage_step": 2, "time": 1.0, "algorithm": "grpo-roc",
          "reward_mean": 0.5, "clip_low": 0.01, "clip_high": 0.02, "response_length": 80.0,
          "response_clip_ratio": 0.1, "tool_error_ratio_positive": None, "staleness_0": 6.0, "staleness_max": 1.0,
          "tool_calls_error": 2.0, "tool_calls_mean": 1.5, "tool_latency_p95": 0.3, "grad_norm": 1.2,
          "engine_logprob_gap": {"http://10.0.0.1:30000": 0.03}, "kv_cache_utilization": 0.4}  # fmt: skip
    assert tracker_metrics(StepRecord.from_json(rl)) == {
        "kuberl_train_reward_mean": 0.5,
        "kuberl_train_clip_ratio/low": 0.01,
        "kuberl_train_clip_ratio/high": 0.02,
        "kuberl_train_response_length_tokens": 80.0,
        "kuberl_train_response_clip_ratio": 0.1,
        "kuberl_train_rollout_staleness/age_0": 6.0,
        "kuberl_tool_calls/error": 2.0,
        "kuberl_train_tool_calls_mean": 1.5,
        "kuberl_tool_call_latency_seconds/p95": 0.3,
        "kuberl_train_grad_norm": 1.2,
        "kuberl_train_engine_logprob_gap/http_//10.0.0.1_30000": 0.03,
        "kuberl_rollout_kv_cache_utilization": 0.4,
    }
    sft = {"type": "sft", "step": 1, "loss": 2.0, "token_acc": 0.5, "step_seconds": 1.0}
    assert tracker_metrics(StepRecord.from_json(sft)) == {
        "kuberl_sft_loss": 2.0,
        "kuberl_sft_token_acc": 0.5,
        "kuberl_train_step_seconds": 1.0,
    }
    ev = {
        "type": "eval",
        "step": 4,
        "label": "sft",
        "accuracy": 0.25,
        "tool_error_ratio_positive": float("nan"),
    }
    assert tracker_metrics(StepRecord.from_json(ev)) == {"kuberl_eval_accuracy": 0.25}


def test_tracking_spec_validates_and_the_wandb_key_comes_from_a_secret(tmp_path):
    tracking = {"wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}}, "tensorboard": {}}
    job = builders.load_job(tmp_path, TINY, tracking=tracking)
    assert job.spec.tracking.enabled() == ["wandb", "tensorboard"]
    trainer = next(m for m in build_for(job, namespace="ns") if m["kind"] == "Job")
    env = trainer["spec"]["template"]["spec"]["containers"][0]["env"]
    key = [e for e in env if e["name"] == "WANDB_API_KEY"]
    assert key == [
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    ]
    plain = next(m for m in build_for(builders.load_job(tmp_path, TINY), namespace="ns") if m["kind"] == "Job")
    assert "WANDB_API_KEY" not in json.dumps(plain)
    with pytest.raises(ManifestError, match="project"):
        builders.load_job(tmp_path, TINY, tracking={"wandb": {"mode": "offline"}})
    with pytest.raises(ManifestError, match="mode"):
        builders.load_job(tmp_path, TINY, tracking={"wandb": {"project": "p", "mode": "cloud"}})


def test_the_crd_takes_what_the_model_takes(tmp_path):
    """kubectl apply of spec.tracking against the generated CRD (the API server's checks, emulated)."""
    from kuberl.api.crdgen import all_crds
    from tests.apiserver_emulation import admission_errors

    crds = list(all_crds().values())
    doc = copy.deepcopy(TINY)
    doc["spec"]["tracking"] = {
        "wandb": {"project": "p", "mode": "offline", "apiKeySecret": {"name": "wandb"}, "tags": ["a"]},
        "mlflow": {"trackingUri": "http://mlflow:5000", "experiment": "e"},
        "tensorboard": {"logDir": "/runs/tb"},
    }
    assert admission_errors(crds, doc) == []
    doc["spec"]["tracking"]["wandb"]["mode"] = "cloud"
    doc["spec"]["tracking"]["mlflow"]["uri"] = "x"
    layers = {layer for layer, _ in admission_errors(crds, doc)}
    assert layers == {"fields", "schema"}  # the unknown field and the enum


def test_a_tracker_that_is_not_installed_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    job = builders.load_job(tmp_path, TINY, tracking={"mlflow": {}})
    with pytest.raises(
        ManifestError, match=r"spec.tracking.mlflow needs the mlflow package.*kuberl\[tracking\]"
    ):
        open_trackers(job, tmp_path / "run")
    from kuberl.trainer.local import run_file

    assert run_file(str(tmp_path / "job.yaml"), out_dir=str(tmp_path / "o")) == 2  # before any training
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_online_wandb_without_a_key_says_where_to_put_one(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ManifestError, match="apiKeySecret.*WANDB_API_KEY.*mode: offline"):
        open_trackers(builders.load_job(tmp_path, TINY, tracking={"wandb": {"project": "p"}}), tmp_path / "run")


def read_wandb_history(path) -> tuple[str, list[dict]]:
    """(run id, history rows) of a W&B run file: a 7-byte header, then LevelDB-log records
    (checksum 4, length 2, type 1; 32 KiB blocks) holding protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, chunks, out, run_id = 7, 32768, b"", [], ""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            which = rec.WhichOneof("record_type")
            if which == "run":
                run_id = rec.run.run_id
            elif which == "history":
                out.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
        elif kind == 0:
            break
    return run_id, out


def test_a_run_cut_mid_rl_and_resumed_continues_the_same_tracked_runs(tmp_path, monkeypatch):
    """The real libraries, offline: what each wrote equals metrics.jsonl, in one run per tracker."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kuberl.trainer.local import run_job
    from kuberl.trainer.stages import Pipeline

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 8)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = {"wandb": {"project": "kuberl-test"}, "mlflow": {}, "tensorboard": {}}
    job = builders.load_job(tmp_path, TINY, tracking=tracking)
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Pipeline, "out_of_time", lambda self: self.state.global_step >= 5)  # after RL step 1
        cut = run_job(job, run, use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert cut.stopped_early
    ids = json.loads((run / STATE_FILE).read_text())
    assert (run / "checkpoints" / STATE_FILE).is_file()  # kept beside the checkpoints, for a new pod
    res = run_job(job, run, use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert not res.stopped_early and json.loads((run / STATE_FILE).read_text()) == ids

    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    reward = {r["step"]: r["reward_mean"] for r in records if r["type"] == "rl"}
    loss = {r["step"]: r["loss"] for r in records if r["type"] == "sft"}
    acc = {r["step"]: r["accuracy"] for r in records if r["type"] == "eval"}
    assert sorted(reward) == [5, 6] and sorted(loss) == [1, 2, 3, 4]

    # W&B: two offline run folders (before and after the resume) of one run id, whose history
    # together is the run's
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    history = []
    for f in files:
        run_id, rows = read_wandb_history(f)
        assert run_id == ids["wandb_run_id"]
        history += rows
    logged = {
        h["global_step"]: h["kuberl_train_reward_mean"] for h in history if "kuberl_train_reward_mean" in h
    }
    assert logged == pytest.approx(reward)
    assert {
        h["global_step"]: h["kuberl_sft_loss"] for h in history if "kuberl_sft_loss" in h
    } == pytest.approx(loss)

    # MLflow: one run, finished, with every step of both processes
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    mrun = client.get_run(ids["mlflow_run_id"])
    assert mrun.info.status == "FINISHED" and mrun.data.params["algorithm"] == "grpo-roc"
    hist = client.get_metric_history(ids["mlflow_run_id"], "kuberl_train_reward_mean")
    assert {m.step: m.value for m in hist} == pytest.approx(reward)
    hist = client.get_metric_history(ids["mlflow_run_id"], "kuberl_eval_accuracy")
    assert {m.step: m.value for m in hist} == pytest.approx(acc)
    runs = client.search_runs([mrun.info.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow_run_id"]]

    # TensorBoard: the event files of both processes, read back
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    assert {e.step: e.value for e in ea.Scalars("kuberl_train_reward_mean")} == pytest.approx(reward)
    assert {e.step: e.value for e in ea.Scalars("kuberl_train_clip_ratio/low")}.keys() == reward.keys()
    assert sorted({e.step for e in ea.Scalars("kuberl_sft_loss")}) == [1, 2, 3, 4]


def test_a_fresh_run_in_a_used_folder_starts_new_tracked_runs(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    job = builders.load_job(tmp_path, TINY, tracking={"mlflow": {}})
    first = open_trackers(job, tmp_path, resume=False)
    first[0].close()
    again = open_trackers(job, tmp_path, resume=True)
    assert again[0].run_id == first[0].run_id  # a resume logs into the same run
    again[0].close()
    fresh = open_trackers(job, tmp_path, resume=False)  # no checkpoint: a new run, not the old one
    assert fresh[0].run_id != first[0].run_id
    fresh[0].close()


def test_a_restarted_trainer_pod_continues_the_tracked_runs_from_the_checkpoint_volume(tmp_path, monkeypatch, capsys):
    """On a cluster the run folder dies with the pod and the checkpoint volume does not: the
    operator points $KUBERL_TRACKING_DIR at that volume, so a new pod (fresh run folder) resumes
    into the same MLflow run and TensorBoard log dir. A kept run id whose store is gone (no such
    volume) starts a new run with a warning instead of failing every restart."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kuberl.operator.render.trainer_runs import CHECKPOINT_DIR
    from kuberl.trainer.checkpoint import CheckpointStore

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    job = builders.load_job(tmp_path, TINY, tracking={"mlflow": {}, "tensorboard": {}})
    trainer = next(m for m in build_for(job, namespace="ns") if m["kind"] == "Job")
    env = {e["name"]: e.get("value") for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBERL_TRACKING_DIR"] == f"{CHECKPOINT_DIR}/tracking"  # on the job's checkpoint PVC

    kept = tmp_path / "pvc"
    store = CheckpointStore(str(kept / "checkpoints"))
    monkeypatch.setenv("KUBERL_TRACKING_DIR", str(kept / "tracking"))
    for pod in ("pod-1", "pod-2", "pod-3"):
        (tmp_path / pod).mkdir()
    ml, tb = open_trackers(job, tmp_path / "pod-1", store, resume=False)
    for t in (ml, tb):
        t.step(StepRecord(type="rl", step=1, reward_mean=0.25))
        t.close()
    ml2, tb2 = open_trackers(job, tmp_path / "pod-2", store, resume=True)  # a new pod's empty run folder
    assert ml2.run_id == ml.run_id
    for t in (ml2, tb2):
        t.step(StepRecord(type="rl", step=2, reward_mean=0.5))
        t.close()
    client = MlflowClient(tracking_uri=(kept / "tracking" / "mlruns").resolve().as_uri())
    hist = client.get_metric_history(ml.run_id, "kuberl_train_reward_mean")
    assert {m.step: m.value for m in hist} == {1: 0.25, 2: 0.5}
    ea = EventAccumulator(str(kept / "tracking" / "tensorboard"))
    ea.Reload()
    assert {e.step: e.value for e in ea.Scalars("kuberl_train_reward_mean")} == {1: 0.25, 2: 0.5}

    # the ids were kept but the store went with the old pod: a new run, said so, not a crash
    monkeypatch.delenv("KUBERL_TRACKING_DIR")
    ml3, tb3 = open_trackers(job, tmp_path / "pod-3", store, resume=True)
    assert ml3.run_id != ml.run_id
    assert f"MLflow run {ml.run_id} is not in" in capsys.readouterr().err
    for t in (ml3, tb3):
        t.close()
