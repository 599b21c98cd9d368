"""Asynchronous RL (algorithm.asyncLevel): bounded staleness, versions on every rollout, and the
truncated importance-sampling correction."""

from __future__ import annotations

import copy
import dataclasses

import builders
import pytest
import torch
from trainer_fakes import FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.rollout.loop import Trajectory
from kuberl.rollout.scored import Scored
from kuberl.trainer.grpo import prepare_batch, rl_update
from kuberl.trainer.local import run_job
from kuberl.trainer.loss import LossConfig, policy_loss, tis_weights
from tests.test_trainer_pipeline import TINY


def _traj(versions: list[int | None], reward_tokens: int = 3) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3] * reward_tokens,
        loss_mask=[1] * reward_tokens,
        logprobs=[-0.5] * reward_tokens,
        turns=len(versions),
        tool_calls=0,
        tool_errors=0,
        format_errors=0,
        answer="1",
        truncated=False,
        finish_reason="answer",
        versions=versions,
    )


def test_rollouts_older_than_the_bound_or_from_unknown_versions_are_dropped_and_counted():
    group = [
        Scored(_traj([5]), 1.0),
        Scored(_traj([4]), 0.0),
        Scored(_traj([4, 5]), 1.0),  # spans a push: as old as its oldest turn
        Scored(_traj([3]), 1.0),  # two versions old with asyncLevel 1: stale
        Scored(_traj([6]), 0.0),  # newer than the policy being trained: an engine out of step
        Scored(_traj([None]), 0.0),  # an engine that reports no version is not judged
    ]
    sb = prepare_batch([group], 4, roc=False, seed=0, version=5, max_staleness=1)
    st = sb.stats
    assert st["rollouts_stale"] == 2 and st["rollouts"] == 6 and st["rollouts_aborted"] == 0
    assert st["staleness_0"] == 1 and st["staleness_1"] == 2 and st["staleness_2"] == 1
    assert st["staleness_max"] == 2
    assert len(sb.seqs) == 4  # the four fresh enough rollouts form the group
    # the behaviour log-probs are kept beside pi_old, which recompute_old_logprobs overwrites
    assert sb.behavior_logprobs == sb.old_logprobs
    # synchronous (bound 0): only the current version passes
    sync = prepare_batch([group], 2, roc=False, seed=0, version=5, max_staleness=0)
    assert sync.stats["rollouts_stale"] == 4


def test_tis_weights_truncate_and_leave_the_loss_alone_when_off():
    torch.manual_seed(0)
    lp = torch.randn(2, 5, requires_grad=True)
    old = lp.detach() + 0.1 * torch.randn(2, 5)
    beh = old + torch.tensor([[0.0, -2.0, 2.0, 0.0, 0.5]] * 2)  # mu: one token far less likely
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 5)
    w = tis_weights(old, beh, cap=2.0)
    assert torch.allclose(w[0], torch.exp(old - beh)[0].clamp(max=2.0))
    assert float(w.max()) == 2.0 and float(w[0, 2]) == pytest.approx(float(torch.exp(torch.tensor(-2.0))))
    base, _ = policy_loss(lp, old, adv, mask, LossConfig())
    ones, st1 = policy_loss(lp, old, adv, mask, LossConfig(), is_weights=torch.ones(2, 5), is_cap=2.0)
    assert torch.equal(base, ones) and st1["tis_mean"] == 1.0 and st1["tis_capped"] == 0.0
    weighted, st = policy_loss(lp, old, adv, mask, LossConfig(), is_weights=w, is_cap=2.0)
    assert not torch.allclose(base, weighted)
    assert st["tis_capped"] == pytest.approx(2 / 10)  # token 1 of both rows hits the cap
    with pytest.raises(ValueError, match="is_weights must be"):
        policy_loss(lp, old, adv, mask, LossConfig(), is_weights=torch.ones(1, 5))


def test_rl_update_without_a_cap_is_the_update_without_the_correction():
    """asyncLevel 0 keeps today's loss bit for bit: no cap, no weights, whatever mu says."""
    from kuberl.trainer.grpo import StepBatch

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, ids, attention_mask=None, use_cache=True):
            return self.out(self.emb(ids)), None

    model = Tiny()
    sb = StepBatch(
        seqs=[[1, 2, 3, 4], [1, 5, 6]],
        masks=[[0, 1, 1, 1], [0, 1, 1]],
        old_logprobs=[[0.0, -2.0, -2.1, -2.2], [0.0, -1.9, -2.0]],
        advantages=[1.0, -1.0],
        behavior_logprobs=[[0.0, -5.0, -0.1, -2.2], [0.0, -1.9, -9.0]],
    )
    m1, m2, m3 = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    stats = []
    for m, cap in ((m1, None), (m2, None), (m3, 2.0)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        stats.append(rl_update(m, opt, sb, LossConfig(), grad_clip=1.0, tis_cap=cap))
    assert all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True)
    )
    assert not all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m3.state_dict().values(), strict=True)
    )
    assert "tis_mean" not in stats[0] and 0 < stats[2]["tis_capped"] < 1


# the pipeline's tiny job, run below at an asyncLevel, with a checkpoint folder per level
ALGORITHM, CHECKPOINT = TINY["spec"]["algorithm"], TINY["spec"]["checkpoint"]
SFT, RL = TINY["spec"]["stages"]


@pytest.mark.parametrize(
    ("level", "order"),
    [
        (1, ["S0", "C0", "S1", "C1", "S2", "C2", "S3", "C3"]),
        (2, ["S0", "C0", "S1", "S2", "C1", "S3", "C2", "C3"]),
    ],
)
def test_the_batches_ahead_are_submitted_once_the_due_batch_is_in_hand(tmp_path, monkeypatch, level, order):
    """A batch submitted before the wait for the due one fills that batch's tail and ends with it,
    leaving the engines idle through the update; submitted after it, a batch generates during
    every update (k batches in flight then), and none beyond the stage's last step."""
    from kuberl.rollout.worker import RolloutWorker

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    calls: list[str] = []
    tickets: dict[int, int] = {}
    submit, collect, whole = RolloutWorker.submit_rollouts, RolloutWorker.collect_rollouts, RolloutWorker.rollouts
    evaluating = []

    def submitting(self, *args, **kwargs):
        ticket = submit(self, *args, **kwargs)
        if not evaluating:
            tickets[ticket] = len(tickets)
            calls.append(f"S{tickets[ticket]}")
        return ticket

    def collecting(self, ticket):
        if not evaluating:
            calls.append(f"C{tickets[ticket]}")
        return collect(self, ticket)

    def evaluation(self, *args, **kwargs):  # evaluations submit and collect in one call
        evaluating.append(1)
        try:
            return whole(self, *args, **kwargs)
        finally:
            evaluating.pop()

    monkeypatch.setattr(RolloutWorker, "submit_rollouts", submitting)
    monkeypatch.setattr(RolloutWorker, "collect_rollouts", collecting)
    monkeypatch.setattr(RolloutWorker, "rollouts", evaluation)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": level},
        stages=[SFT, {**RL, "steps": 4}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / f"ck{level}")},
    )
    run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    assert calls == order


@pytest.mark.parametrize("pads_rows", [True, False])
def test_on_engines_that_pad_rows_a_batch_ahead_starts_when_the_one_before_ends(tmp_path, monkeypatch, pads_rows):
    """asyncLevel 2 on the local engine (one padded KV cache): the second batch ahead waits for
    the first to end instead of filling its tail; on engines with paged caches it fills it."""
    import threading

    from kuberl.rollout.local_engine import LocalEngine
    from kuberl.rollout.worker import RolloutWorker

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    monkeypatch.setattr(LocalEngine, "pads_rows", pads_rows)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    count = [0]
    timed = RolloutWorker._timed_rollouts

    async def timing(self, *args, **kwargs):
        with lock:
            n = count[0]
            count[0] += 1
            events.append(("start", n))
        try:
            return await timed(self, *args, **kwargs)
        finally:
            with lock:
                events.append(("end", n))

    monkeypatch.setattr(RolloutWorker, "_timed_rollouts", timing)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": 2},
        stages=[SFT, {**RL, "steps": 4}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / "ck2")},
    )
    run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    overlapping = [
        n for n in range(count[0] - 1) if events.index(("start", n + 1)) < events.index(("end", n))
    ]
    if pads_rows:
        assert overlapping == [], events
    else:
        assert overlapping, events  # batches ahead fill the tail of the one before


@pytest.mark.parametrize("level", [1, 2])
def test_a_folder_push_runs_beside_the_update_and_the_batches_ahead_wait_for_it(tmp_path, monkeypatch, level):
    """Weights that engines load from a folder (``prepare``: copy now, push later) go out on a
    thread while the trainer updates; the batches ahead are submitted only once that version is
    on the engines, so the staleness bound holds; the stage's first batch waits for its push."""
    import threading
    import time as time_mod

    from kuberl.rollout.worker import RolloutWorker
    from kuberl.trainer import rl_step
    from kuberl.trainer.weight_sync import LocalWeights

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    events: list[str] = []
    lock = threading.Lock()
    steps = {"update": 0, "push": 0, "submit": 0}

    def log(kind: str, suffix: str = "") -> int:
        with lock:
            n = steps[kind]
            steps[kind] += 1
            events.append(f"{kind}{n}{suffix}")
            return n

    class FolderLikeWeights(LocalWeights):  # a slow push, as writing a folder and reloading is
        def prepare(self, model, version):
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

            def push():
                n = log("push", "-start")
                time_mod.sleep(0.4)
                self.client.set_weights(sd, version)
                with lock:
                    events.append(f"push{n}-end")

            return push

    update = rl_step.rl_update

    def updating(*args, **kwargs):
        log("update")
        return update(*args, **kwargs)

    submit, score = RolloutWorker.submit_rollouts, RolloutWorker.score_on_engines

    def submitting(self, *args, **kwargs):
        log("submit")
        return submit(self, *args, **kwargs)

    def scoring(self, *args, **kwargs):  # the spot check asks the engines what they serve
        with lock:
            events.append("score")
        return score(self, *args, **kwargs)

    monkeypatch.setattr("kuberl.trainer.stages.LocalWeights", FolderLikeWeights)
    monkeypatch.setattr(RolloutWorker, "score_on_engines", scoring)
    monkeypatch.setattr(rl_step, "rl_update", updating)
    monkeypatch.setattr(RolloutWorker, "submit_rollouts", submitting)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": level},
        stages=[SFT, {**RL, "steps": 4}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / f"ck{level}")},
    )
    res = run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    # the first RL step pushes in line (its batch needs the version at once); steps 1-3 beside the update
    assert steps["push"] == 3, events
    for n in range(3):
        start, end = events.index(f"push{n}-start"), events.index(f"push{n}-end")
        assert f"update{n + 1}" in events[start:end], events  # the trainer did not wait for the push
        later = [e for e in events[end:] if e.startswith("submit")]
        before = [e for e in events[:start] if e.startswith("submit")]
        # every submission either before the push began or after it ended: none during it
        assert len(later) + len(before) == steps["submit"], events
        assert "score" not in events[start:end], events  # the spot check waits for the version
    rl = [h for h in res.history if h.type == "rl"]
    ages = [h.staleness_max for h in rl]
    assert all(age <= min(i, level) for i, age in enumerate(ages)), ages
    assert all(h.rollouts_stale == 0 and h.rollouts == 8 for h in rl), rl
    assert all(h.push_wait_seconds >= 0 for h in rl)
    assert events.count("score") >= 3, events  # the spot check ran on the pushed steps
    gaps = [g for h in rl for g in h.engine_logprob_gap.values()]
    assert gaps and max(gaps) < 1e-3, rl  # the engines were asked once they had the version


@pytest.mark.parametrize("level", [1, 2])
def test_an_asynchronous_run_trains_on_rollouts_at_most_k_versions_old(tmp_path, monkeypatch, level):
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": level},
        stages=[SFT, {**RL, "steps": 4}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / f"ck{level}")},
    )
    res = run_job(
        job,
        tmp_path / f"out{level}",
        use_ray=False,
        executor_factory=FakeSandbox,
        quiet=True,
    )
    rl = [h for h in res.history if h.type == "rl"]
    assert len(rl) == 4
    # step i (0-based) trains on rollouts submitted while version (first RL step) + max(0, i - k)
    # was served: at most min(i, k) old (a batch whose first turns start after a later push is
    # younger). Step 1's batch was submitted once step 0 had its batch, before the next push: 1 old.
    ages = [h.staleness_max for h in rl]
    assert all(age <= min(i, level) for i, age in enumerate(ages)), ages
    assert ages[0] == 0 and ages[1] == 1, ages
    assert all(h.rollouts_stale == 0 for h in rl)
    assert all(h.tis_mean is not None for h in rl if (h.tokens or 0) > 0)
    assert all(h.rollouts == 8 for h in rl)


def test_async_level_is_bounded_and_named_in_errors():
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"]["asyncLevel"] = 5
    with pytest.raises(ValueError, match="asyncLevel"):
        AgenticRLJob.model_validate(doc)
    doc["spec"]["algorithm"]["asyncLevel"] = -1
    with pytest.raises(ValueError, match="asyncLevel"):
        AgenticRLJob.model_validate(doc)
    doc["spec"]["algorithm"]["asyncLevel"] = 2
    job = AgenticRLJob.model_validate(doc)
    assert job.spec.algorithm.effective_tis_cap == 2.0
    doc["spec"]["algorithm"]["tisCap"] = 0
    assert AgenticRLJob.model_validate(doc).spec.algorithm.effective_tis_cap is None
    doc["spec"]["algorithm"] = {**doc["spec"]["algorithm"], "asyncLevel": 0, "tisCap": None}
    assert AgenticRLJob.model_validate(doc).spec.algorithm.effective_tis_cap is None


class _WrongWeightsEngine:
    """A LocalEngine that reports every pushed version but keeps serving weights of its own:
    what a replica that missed a push (restarted, failed reload) looks like to the trainer."""

    def __new__(cls, model, tokenizer):
        from kuberl.rollout.local_engine import LocalEngine

        engine = LocalEngine(model, max_total_tokens=1 << 20, max_batch=64, seed=0, name="wrong-0")
        with torch.no_grad():
            for p in engine.model.parameters():
                p.add_(0.5 * torch.randn_like(p))

        def set_weights(state_dict, version=None):
            engine.weight_version = version  # claims the version, keeps its weights

        engine.set_weights = set_weights
        return engine


@pytest.mark.parametrize("level", [0, 2])
def test_spot_check_flags_an_engine_serving_other_weights(tmp_path, monkeypatch, level):
    """asyncLevel 0: fresh sampling log-probs vs the trainer; 2: the engines score the trained
    rows with what they serve, every step, whatever version sampled them."""
    import json

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": level},
        stages=[SFT, {**RL, "steps": 3}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / f"ck{level}")},
    )
    bad = run_job(
        job,
        tmp_path / "bad",
        use_ray=False,
        executor_factory=FakeSandbox,
        engine_factory=_WrongWeightsEngine,
        quiet=True,
    )
    steps = [h for h in bad.history if h.type == "rl"]
    rl = [h for h in steps if h.engine_logprob_gap]
    assert rl and all(h.engine_logprob_gap["wrong-0"] > 0.15 for h in rl), rl
    if level:
        assert len(rl) == len(steps)  # every step checked, though none of its rollouts is fresh
    events = [json.loads(x) for x in (tmp_path / "bad" / "events.jsonl").read_text().splitlines()]
    flagged = [e for e in events if e["kind"] == "engine"]
    assert len(flagged) == 1 and "wrong-0" in flagged[0]["text"] and "other weights" in flagged[0]["text"]
    if level == 0:
        return
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": 1},
        stages=[SFT, {**RL, "steps": 3}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / "ck1")},
    )
    good = run_job(job, tmp_path / "good", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    steps = [h for h in good.history if h.type == "rl"]
    gaps = [g for h in steps for g in h.engine_logprob_gap.values()]
    assert len(gaps) == len(steps) and max(gaps) < 1e-3  # the same float32 weights on both sides
    events = (tmp_path / "good" / "events.jsonl").read_text()
    assert '"kind": "engine"' not in events


_PIN_PROBE = r"""
import os, sys, threading
from kuberl.rollout.worker import pin_to_cpus
release = threading.Event()
early = threading.Thread(target=release.wait)  # started before pinning, like Ray's own threads
early.start()
pin_to_cpus(sys.argv[1])
late = threading.Thread(target=release.wait)  # started after: inherits
late.start()
masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
release.set()
print(len(masks), sorted({tuple(sorted(m)) for m in masks.values()}))
"""


def test_pinning_the_engine_side_moves_every_thread_of_its_process():
    """A Ray actor's main, gRPC and GC threads run Python too: left on the trainer's core, the
    engine side of bench/async_rl.py would not be the one core it stands for."""
    import os
    import subprocess
    import sys

    core = min(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", _PIN_PROBE, str(core)], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) >= 3  # main + both threads were looked at
    assert out[1].strip() == str([(core,)])


def test_a_malformed_core_list_is_named():
    from kuberl.rollout.worker import parse_cpus

    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="KUBERL_ROLLOUT_CPUS='zero'"):
        parse_cpus("zero")


def test_probe_gaps_compare_engine_scores_with_pi_old_on_trained_tokens_only():
    from kuberl.trainer.grpo import StepBatch
    from kuberl.trainer.spot_check import probe_gaps, probe_requests, probe_rows

    sb = StepBatch(
        seqs=[[1, 2, 3, 4, 5], [1, 2, 6, 7], [1, 9]],
        masks=[[0, 0, 1, 0, 1], [0, 0, 1, 1], [0, 0]],  # row 2 trains nothing; row 0 has a tool token
        old_logprobs=[[0.0, -9.0, -1.0, -9.0, -2.0], [0.0, -9.0, -0.5, -0.25], [0.0, 0.0]],
    )
    assert probe_rows(sb, 8) == [0, 1] and probe_rows(sb, 1) == [0] and probe_rows(sb, 0) == []
    seqs, starts = probe_requests(sb, [0, 1])
    assert seqs == [[1, 2, 3, 4, 5], [1, 2, 6, 7]] and starts == [2, 2]
    answers = [
        {"engine": "a", "logprobs": [-1.5, -100.0, -2.0], "version": 7},  # the tool token is ignored
        {"engine": "b", "logprobs": [-0.5, -0.25], "version": 6},
    ]
    res = probe_gaps(sb, [0, 1], starts, answers, version=7)
    assert res.gaps == {"a": 0.25, "b": 0.0} and res.versions == {"b": 6} and not res.errors
    res = probe_gaps(sb, [0, 1], starts, [answers[0], {"engine": "b", "error": "HTTP 500"}], version=7)
    assert res.gaps == {"a": 0.25} and res.errors == {"b": "HTTP 500"}


def test_an_asynchronous_step_exports_which_side_of_the_pipeline_waited(tmp_path, monkeypatch):
    """The fleet autoscaler's signals: the trainer's wait for rollouts and the engines' idle time,
    as fractions of the step; a synchronous run (which waits by design) exports neither."""
    from prometheus_client import REGISTRY

    from kuberl.trainer.metrics import MetricsSink
    from kuberl.trainer.step_record import StepRecord

    base = StepRecord(type="rl", stage="rl", step=3, step_seconds=10.0, rollout_seconds=2.5,
                      engine_busy_seconds=6.0, engines_in_service=3.0)  # fmt: skip
    monkeypatch.setenv("KUBERL_ROLLOUT_FLEET", "gen")  # the operator's env: the fleet it rolls out on
    MetricsSink("pipe-async", tmp_path / "a").step(dataclasses.replace(base, async_level=1))
    on = {"job": "pipe-async", "fleet": "gen"}
    assert REGISTRY.get_sample_value("kuberl_train_rollout_wait_ratio", on) == 0.25
    assert REGISTRY.get_sample_value("kuberl_train_engine_idle_ratio", on) == pytest.approx(0.4)
    assert REGISTRY.get_sample_value("kuberl_train_engines_in_service", on) == 3  # the ratios' denominator
    MetricsSink("pipe-sync", tmp_path / "s").step(dataclasses.replace(base, async_level=0))
    assert REGISTRY.get_sample_value("kuberl_train_rollout_wait_ratio", {"job": "pipe-sync", "fleet": "gen"}) is None
    assert REGISTRY.get_sample_value("kuberl_train_engines_in_service", {"job": "pipe-sync", "fleet": "gen"}) is None
