"""Checkpoints: local and S3 (a real moto server on loopback), pruning, and bit-for-bit resume."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import builders
import pytest
import torch
import yaml
from trainer_fakes import CoinVerifySandbox, FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.trainer.checkpoint import CheckpointStore, TrainState, apply_payload, make_payload
from kuberl.trainer.local import run_job
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.step_record import StepRecord


def _model_opt(seed: int):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randint(0, 32, (2, 8)))[0].sum().backward()
    opt.step()
    return m, opt


def _roundtrip(store: CheckpointStore) -> None:
    m, opt = _model_opt(0)
    st = TrainState(stage_index=1, stage_step=2, global_step=7, cursor=40, extra={"k": [1, 2]})
    for step in (3, 5, 7):
        where = store.save(make_payload(m, opt, st, "{}", m.config.to_dict()), step)
    assert where.endswith("ckpt-00000007.pt")
    assert store.names() == ["ckpt-00000005.pt", "ckpt-00000007.pt"]  # keep=2 pruned step 3
    expected_next = torch.rand(3)  # the RNG stream right after the save...
    m2, opt2 = _model_opt(1)
    payload = store.load()
    assert payload is not None
    st2, restored = apply_payload(payload, m2, opt2)
    assert restored
    assert torch.equal(torch.rand(3), expected_next)  # ...is restored by the load
    assert st2 == st
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(FileNotFoundError):
        store.load("ckpt-00000003.pt")


def test_local_store(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    assert store.load() is None
    _roundtrip(store)
    with pytest.raises(ValueError):
        CheckpointStore(str(tmp_path), keep=0)


@contextlib.contextmanager
def _moto_s3(monkeypatch, bucket: str):
    """A real S3 endpoint (moto server on loopback) with ``bucket``; yields a boto3 client."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
        client.create_bucket(Bucket=bucket)
        yield client
    finally:
        server.stop()


def test_a_full_disk_is_named_and_the_checkpoints_already_there_survive(tmp_path, monkeypatch):
    """A disk without room for the blob fails with the folder and the space it needs, before
    writing (the tensors' bytes are known), or after torch's zip writer stops short ("unexpected
    pos", how ENOSPC surfaces from torch.save); no partial file stays and older ones are intact."""
    from collections import namedtuple

    import kuberl.trainer.checkpoint as ckpt

    m, opt = _model_opt(0)
    payload = make_payload(m, opt, TrainState(), "{}", m.config.to_dict())
    store = CheckpointStore(str(tmp_path), keep=2)
    store.save(payload, 1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        ckpt.CheckpointSpaceError,
        match=rf"ckpt-00000002.pt does not fit: it needs at least .* in {tmp_path} .*spec.checkpoint.keep",
    ):
        store.save(payload, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]

    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: usage(10**12, 0, 10**12))
    real_save = torch.save

    def short_write(obj, f, *a, **kw):  # writes part of the blob, then the disk is full
        real_save({"part": torch.zeros(10)}, f)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 224603904 vs 224603792"
        )

    monkeypatch.setattr(ckpt.torch, "save", short_write)
    with pytest.raises(
        ckpt.CheckpointSpaceError, match="stopped short .*unexpected pos.*disk is likely full"
    ):
        store.save(payload, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert store.load()["state"] == payload["state"]

    def other_failure(obj, f, *a, **kw):  # not a space problem: the original error, unchanged
        raise RuntimeError("cannot pickle 'generator' object")

    monkeypatch.setattr(ckpt.torch, "save", other_failure)
    with pytest.raises(RuntimeError, match="cannot pickle") as err:
        store.save(payload, 2)
    assert not isinstance(err.value, ckpt.CheckpointSpaceError)


def test_s3_store_on_moto_server(monkeypatch):
    with _moto_s3(monkeypatch, "ckpts"):
        store = CheckpointStore("s3://ckpts/runs/a", keep=2)
        assert store.load() is None
        _roundtrip(store)
        with pytest.raises(ValueError, match="bucket"):
            CheckpointStore("s3:///x")


TINY = """
apiVersion: kuberl.io/v1alpha1
kind: AgenticRLJob
metadata: {name: tiny}
spec:
  model: {base: builtin:tiny-gpt, tokenizer: builtin:arith-bpe, config: {nLayer: 1, nEmbd: 32, nHead: 2}}
  data: {train: builtin:arith}
  algorithm: {groupSize: 2, learningRate: 0.001, warmupSteps: 1, batchPrompts: 2}
  rollout: {engine: local, maxTurns: 3, maxResponseTokens: 48, promptTemplate: compact}
  stages:
    - {name: sft, type: sft, steps: 4, learningRate: 0.003, batchSize: 4}
    - {name: rl, type: rl, steps: 2}
  trainer: {device: cpu, threads: 1}
  checkpoint: {uri: ck, everySteps: 3, keep: 5}
"""


def test_resume_is_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.load_job(tmp_path, TINY)
    full = tmp_path / "full"
    run_job(job, full, use_ray=False, executor_factory=FakeSandbox, quiet=True)
    names = CheckpointStore(str(full / "checkpoints")).names()
    assert names == ["ckpt-00000003.pt", "ckpt-00000004.pt", "ckpt-00000006.pt"]  # every 3 + stage ends
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / names[0], resumed / "checkpoints" / names[0])
    shutil.copy(full / "tokenizer.json", resumed / "tokenizer.json")
    res = run_job(job, resumed, use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert [h.step for h in res.history] == [1, 2, 3, 4, 5, 6]  # history restored, then 4..6 run
    # SFT step 4, then two RL steps (seeded rollouts; this barely trained model mostly gets all-zero
    # groups, which the online filter drops, so the bit-for-bit claim is mainly about SFT + state)
    a = CheckpointStore(str(full / "checkpoints")).load(names[-1])
    b = CheckpointStore(str(resumed / "checkpoints")).load(names[-1])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["state"]["cursor"] == b["state"]["cursor"] and b["state"]["global_step"] == 6
    events = yaml.safe_load("[" + ",".join((resumed / "events.jsonl").read_text().splitlines()) + "]")
    assert any(e["kind"] == "resume" for e in events)


# -- resume in mid-RL -------------------------------------------------------------------------

# SFT long enough that the policy writes answers, then RL steps that really update (the coin
# verifier rewards about half of the answers), 2 mini-batches, a checkpoint after 2 RL steps.
LEARNING = """
apiVersion: kuberl.io/v1alpha1
kind: AgenticRLJob
metadata: {name: rl-resume}
spec:
  model: {base: builtin:tiny-gpt, tokenizer: builtin:arith-bpe, config: {nLayer: 1, nEmbd: 64, nHead: 2}}
  data: {train: builtin:arith}
  algorithm: {groupSize: 2, learningRate: 0.001, warmupSteps: 1, batchPrompts: 4, miniBatches: 2}
  rollout: {engine: local, maxTurns: 3, maxResponseTokens: 48, promptTemplate: compact}
  stages:
    - {name: sft, type: sft, steps: 60, learningRate: 0.01, batchSize: 8}
    - {name: rl, type: rl, steps: 4}
  trainer: {device: cpu, threads: 1}
  checkpoint: {uri: ck, everySteps: 62, keep: 10}
"""
# wall-clock fields, and the engine's batch-dependent float noise (its log-probs vs the trainer's)
TIMING = {
    "time", "step_seconds", "rollout_seconds", "update_seconds", "engine_busy_seconds", "tool_seconds",
    "sync_seconds", "pi_old_seconds", "spot_check_seconds", "optimizer_seconds",
    "tool_latency_p50", "tool_latency_p95", "tool_latency_max", "kv_cache_utilization",
    # the engine's log-probs depend on how requests shared its batches (noise at 1e-7)
    "rollout_logprob_gap", "engine_logprob_gap",
}  # fmt: skip


def _learning_job(tmp_path) -> AgenticRLJob:
    f = tmp_path / "learning.yaml"
    f.write_text(LEARNING)
    return find_one(load_manifests(f), AgenticRLJob)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _untimed(records: list[StepRecord] | list[dict]) -> str:
    """The records (a run's history, or metrics.jsonl lines) without wall-clock fields, as JSON
    (NaN == NaN there, unlike in dicts)."""
    flat = [r.to_json() if isinstance(r, StepRecord) else r for r in records]
    return json.dumps([{k: v for k, v in r.items() if k not in TIMING} for r in flat], sort_keys=True)


def _evals(evals: dict) -> str:
    return json.dumps({k: v for k, v in evals.items() if k != "wall_seconds"}, sort_keys=True)


def _assert_same_training_state(a: dict, b: dict) -> None:
    assert (
        a["state"]["global_step"] == b["state"]["global_step"]
        and a["state"]["cursor"] == b["state"]["cursor"]
    )
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    if a["optimizer"] is None or b["optimizer"] is None:  # an optimizer that has not stepped yet
        assert a["optimizer"] is b["optimizer"] is None
        return
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def full_rl_run(tmp_path_factory):
    """The uninterrupted run: (job, out dir, result)."""
    import kuberl.trainer.problems as problems

    mp = pytest.MonkeyPatch()
    mp.setattr(problems, "EVAL_SIZE", 4)
    try:
        tmp = tmp_path_factory.mktemp("rl-full")
        job = _learning_job(tmp)
        res = run_job(job, tmp / "full", use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
        yield job, tmp / "full", res
    finally:
        mp.undo()


def test_rl_resume_through_s3_matches_the_uninterrupted_run(full_rl_run, tmp_path, monkeypatch):
    """Resume after 2 of 4 updating RL steps, from s3://, with a stale tokenizer.json lying around."""
    from kuberl.trainer.tokenizer import train_bpe

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job, full, ref = full_rl_run
    names = CheckpointStore(str(full / "checkpoints")).names()
    assert names == ["ckpt-00000060.pt", "ckpt-00000062.pt", "ckpt-00000064.pt"]
    rl = [h for h in ref.history if h.type == "rl"]
    assert all(h.rollouts_kept > 0 and h.opt_steps == 2 for h in rl), rl  # real 2-mini-batch updates
    mid = CheckpointStore(str(full / "checkpoints")).load("ckpt-00000062.pt")
    end = CheckpointStore(str(full / "checkpoints")).load("ckpt-00000064.pt")
    assert not torch.equal(mid["model"]["lm_head.weight"], end["model"]["lm_head.weight"])
    assert end["optimizer"]["state"]  # the RL optimizer has moments to compare

    with _moto_s3(monkeypatch, "ckpts") as s3:
        s3.upload_file(str(full / "checkpoints" / "ckpt-00000062.pt"), "ckpts", "rl/ckpt-00000062.pt")
        # what the pod before the restart kept of its events
        before = json.dumps(
            {"time": 1.0, "kind": "checkpoint", "text": "from the pod before", "stage": "rl", "step": 62}
        )
        s3.put_object(Bucket="ckpts", Key="rl/events.jsonl", Body=(before + "\n").encode())
        job = job.model_copy(deep=True)
        job.spec.checkpoint.uri = "s3://ckpts/rl"
        out = tmp_path / "resumed"
        out.mkdir()
        train_bpe(["a different corpus 12*34=408"], vocab_size=300).save(out / "tokenizer.json")
        res = run_job(job, out, use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
        store = CheckpointStore("s3://ckpts/rl", keep=10)
        assert store.names() == ["ckpt-00000062.pt", "ckpt-00000064.pt"]
        _assert_same_training_state(end, store.load("ckpt-00000064.pt"))
        # the run's events outlive its folder (a trainer pod's emptyDir): kept beside the checkpoints
        events = s3.get_object(Bucket="ckpts", Key="rl/events.jsonl")["Body"].read().decode()
        assert events == (out / "events.jsonl").read_text() and '"kind": "done"' in events
        assert events.startswith(before + "\n") and '"kind": "resume"' in events  # continued, not replaced
    assert (out / "tokenizer.json").read_text() == (full / "tokenizer.json").read_text()  # the checkpoint's
    assert _untimed(res.history) == _untimed(ref.history)  # every step's reward, clip, loss, ratio...
    assert _evals(res.evals) == _evals(ref.evals)
    steps = [r for r in _lines(out / "metrics.jsonl") if r["type"] != "eval"]
    assert [r["step"] for r in steps] == [63, 64]
    ref_steps = [r for r in _lines(full / "metrics.jsonl") if r["type"] != "eval" and r["step"] > 62]
    assert _untimed(steps) == _untimed(ref_steps)
    # the SFT eval is in the checkpoint: only the RL stage's eval ran again
    assert [r["label"] for r in _lines(out / "metrics.jsonl") if r["type"] == "eval"] == ["rl"]


def test_resuming_a_finished_run_repeats_nothing(full_rl_run, monkeypatch):
    """The stage-end checkpoint is written after the stage's eval: nothing is trained or evaluated."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job, full, ref = full_rl_run
    before = len(_lines(full / "metrics.jsonl"))
    res = run_job(job, full, use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    assert len(_lines(full / "metrics.jsonl")) == before
    assert _untimed(res.history) == _untimed(ref.history) and _evals(res.evals) == _evals(ref.evals)
    assert CheckpointStore(str(full / "checkpoints")).names()[-1] == "ckpt-00000064.pt"


def test_a_run_killed_after_its_last_checkpoint_trains_each_lost_step_once_more_and_records_it_once(
    full_rl_run, tmp_path, monkeypatch
):
    """Killed after step 64 was recorded but before its checkpoint (and mid-way through writing
    a record): the resumed run goes back to step 62's checkpoint, trains 63 and 64 again, and
    metrics.jsonl holds each step once, the same records as the uninterrupted run's."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job, full, ref = full_rl_run
    out = tmp_path / "killed"
    shutil.copytree(full, out)
    (out / "checkpoints" / "ckpt-00000064.pt").unlink()
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"time": 1.0, "type": "rl", "st')  # the record being written when the kill came
    res = run_job(job, out, use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    records = _lines(out / "metrics.jsonl")
    steps = [r["step"] for r in records if r["type"] != "eval"]
    assert steps == sorted(set(steps)) and steps[-2:] == [63, 64], steps  # each step once, in order
    assert _untimed(records) == _untimed(_lines(full / "metrics.jsonl"))
    assert _untimed(res.history) == _untimed(ref.history)
    events = _lines(out / "events.jsonl")
    resumed = [e["text"] for e in events if e["kind"] == "resume"]
    assert resumed and "resumed at global step 62; 4 records of later steps" in resumed[-1], resumed


def test_deadline_exit_checkpoints_and_resume_continues(tmp_path, monkeypatch):
    """--max-minutes stops between steps with a checkpoint; the resumed run ends where a full one does."""
    from kuberl.trainer.stages import Pipeline

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.load_job(tmp_path, TINY)
    job.spec.checkpoint.every_steps = 100  # only stage ends and the deadline write checkpoints
    full = run_job(job, tmp_path / "full", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    with monkeypatch.context() as m:
        m.setattr(Pipeline, "out_of_time", lambda self: self.state.global_step >= 5)  # in mid-RL
        cut = run_job(job, tmp_path / "cut", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert cut.stopped_early and [h.step for h in cut.history] == [1, 2, 3, 4, 5]
    assert CheckpointStore(str(tmp_path / "cut" / "checkpoints")).names() == [
        "ckpt-00000004.pt",
        "ckpt-00000005.pt",
    ]
    res = run_job(job, tmp_path / "cut", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert not res.stopped_early and _untimed(res.history) == _untimed(full.history)
    a = CheckpointStore(str(tmp_path / "full" / "checkpoints")).load("ckpt-00000006.pt")
    b = CheckpointStore(str(tmp_path / "cut" / "checkpoints")).load("ckpt-00000006.pt")
    _assert_same_training_state(a, b)


def test_a_new_pod_continues_the_run_record_and_the_report_outlives_it(tmp_path, monkeypatch):
    """A trainer pod's run folder dies with the pod; its checkpoints (a PVC) do not. The step
    records, events and stages are kept beside the checkpoints at each checkpoint, a restarted pod
    continues them, and the run report is kept there at the end: `kuberl report` of the
    checkpoint folder shows the whole run (issue 16 item 3, on a cluster)."""
    from kuberl.trainer.report import write_report
    from kuberl.trainer.stages import Pipeline

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.load_job(tmp_path, TINY)
    kept = tmp_path / "pvc"
    job.spec.checkpoint.uri = str(kept)
    with monkeypatch.context() as m:
        m.setattr(Pipeline, "out_of_time", lambda self: self.state.global_step >= 5)
        run_job(job, tmp_path / "pod-1", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert [r["step"] for r in _lines(kept / "metrics.jsonl") if r["type"] != "eval"] == [1, 2, 3, 4, 5]
    pod2 = tmp_path / "pod-2"
    run_job(job, pod2, use_ray=False, executor_factory=FakeSandbox, quiet=True)
    steps = [r["step"] for r in _lines(pod2 / "metrics.jsonl") if r["type"] != "eval"]
    assert steps == [1, 2, 3, 4, 5, 6]  # the first pod's records, then this one's
    assert (kept / "metrics.jsonl").read_text() == (pod2 / "metrics.jsonl").read_text()
    assert (kept / "report.html").read_text() == (pod2 / "report.html").read_text()
    assert (kept / "run.json").is_file()
    write_report(kept)  # the checkpoint folder is a run folder `kuberl report` reads


# -- a trainer killed (SIGKILL) mid-update and mid-checkpoint-write, then resumed --------------

KILL = Path(__file__).resolve().parents[1] / "harness" / "kill_during.py"
SFT_STEPS, RL_MINI_BATCHES = 60, 2


def _killed_run(job_file, out, point: str, at: int) -> None:
    done = subprocess.run([sys.executable, str(KILL), point, str(at), str(job_file), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-3000:])


def _steps_once(out) -> list[int]:
    steps = [r["step"] for r in _lines(out / "metrics.jsonl") if r["type"] != "eval"]
    assert steps == sorted(set(steps)), steps  # each step once, in order
    return steps


@pytest.mark.parametrize("point", ["update", "checkpoint"])
def test_a_trainer_killed_mid_update_or_mid_checkpoint_resumes_as_if_never_killed(
    full_rl_run, tmp_path, monkeypatch, point
):
    """SIGKILL half-way through RL step 63's update (one of its two optimizer steps applied in
    memory), or half-way through writing step 62's checkpoint (half its bytes on disk): the
    resumed run starts from the last whole checkpoint (62, or 60 for the torn one, which is
    never loaded and is replaced), and its records, evals and final weights are the
    uninterrupted run's, bit for bit."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job, full, ref = full_rl_run
    job_file = tmp_path / "job.yaml"
    job_file.write_text(LEARNING)
    out = tmp_path / "killed"
    at = SFT_STEPS + 2 * RL_MINI_BATCHES + 1 if point == "update" else 2  # step 63's first / the 2nd file
    _killed_run(job_file, out, point, at)
    store = CheckpointStore(str(out / "checkpoints"))
    if point == "update":
        assert store.names() == ["ckpt-00000060.pt", "ckpt-00000062.pt"] and _steps_once(out)[-1] == 62
    else:
        assert store.names() == ["ckpt-00000060.pt"], store.names()  # the torn file is not a checkpoint
        assert (out / "checkpoints" / ".ckpt-00000062.pt.tmp").stat().st_size > 0
    res = run_job(job, out, use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    assert store.names() == ["ckpt-00000060.pt", "ckpt-00000062.pt", "ckpt-00000064.pt"]
    _assert_same_training_state(CheckpointStore(str(full / "checkpoints")).load("ckpt-00000064.pt"),
                                store.load("ckpt-00000064.pt"))
    assert _steps_once(out)[-1] == 64
    assert _untimed(_lines(out / "metrics.jsonl")) == _untimed(_lines(full / "metrics.jsonl"))
    assert _untimed(res.history) == _untimed(ref.history) and _evals(res.evals) == _evals(ref.evals)


@pytest.mark.parametrize("point", ["update", "checkpoint"])
def test_an_asynchronous_trainer_killed_mid_update_or_mid_checkpoint_finishes_each_step_once(tmp_path, point):
    """asyncLevel 1: the same kills. The batch ahead was sampled while the killed step trained;
    the resumed run samples it again from the checkpoint's weights, so its rewards may differ
    from an uninterrupted run's, but every step is trained and recorded once, nothing is stale,
    and the run ends with its last checkpoint."""
    doc = yaml.safe_load(LEARNING)
    doc["spec"]["algorithm"]["asyncLevel"] = 1
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    out = tmp_path / "killed"
    at = SFT_STEPS + 2 * RL_MINI_BATCHES + 1 if point == "update" else 2
    _killed_run(job_file, out, point, at)
    done = subprocess.run([sys.executable, str(KILL), "update", "0", str(job_file), str(out)],  # 0: never
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointStore(str(out / "checkpoints")).names()[-1] == "ckpt-00000064.pt"
    rl = [r for r in _lines(out / "metrics.jsonl") if r["type"] == "rl"]
    assert [r["step"] for r in rl] == [61, 62, 63, 64] and _steps_once(out)[-1] == 64
    assert all(r["rollouts_stale"] == 0 and r["rollouts_aborted"] == 0 for r in rl), rl
    assert all(r["staleness_max"] <= 1 for r in rl), rl
    events = _lines(out / "events.jsonl")
    assert [e for e in events if e["kind"] == "resume"] and events[-1]["kind"] == "done", events[-3:]
