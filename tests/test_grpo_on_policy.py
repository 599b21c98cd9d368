"""The on-policy update (one epoch, one mini-batch, at any asyncLevel) takes pi_old from its own
forward instead of a separate recomputation: the same loss, gradients and metrics, one policy
forward less per RL step (bench/README.md, "Side by side with TRL" and "Asynchronous RL")."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from trainer_fakes import FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.trainer.grpo import StepBatch, recompute_old_logprobs, rl_update
from kuberl.trainer.local import run_job
from kuberl.trainer.loss import LossConfig, token_logprobs
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.sft import pad_batch
from tests.test_trainer_pipeline import TINY


def _batch(model: GPT, seed: int) -> StepBatch:
    """Rows of mixed length and loss masks; the "engine" log-probs are the model's own moved by
    up to +-0.6 nats, so pi_old from them would put many ratios outside the clip bounds."""
    rng = random.Random(seed)
    b = StepBatch()
    for i in range(6):
        n, prompt = rng.randint(8, 24), rng.randint(2, 5)
        b.seqs.append([rng.randrange(model.config.vocab_size) for _ in range(n)])
        b.masks.append([0] * prompt + [rng.choice([1, 1, 1, 0]) for _ in range(n - prompt)])
        b.advantages.append([1.0, -1.0, 0.5][i % 3])
    inp, att, tgt, _ = pad_batch(b.seqs, b.masks)
    with torch.no_grad():
        lp, _ = token_logprobs(model(inp, attention_mask=att)[0], tgt, with_entropy=False)
    for row, s in enumerate(b.seqs):
        engine = [float(x) + rng.uniform(-0.6, 0.6) for x in lp[row, : len(s) - 1]]
        b.old_logprobs.append([0.0, *engine])
        b.behavior_logprobs.append([0.0, *engine])
    return b


def _update(model: GPT, batch: StepBatch, cfg: LossConfig, on_policy: bool, **kw):
    m = copy.deepcopy(model)
    b = copy.deepcopy(batch)
    gap = None if on_policy else recompute_old_logprobs(m, b, micro_batch=kw.get("micro_batch", 64))
    st = rl_update(m, torch.optim.SGD(m.parameters(), lr=0.0), b, cfg, grad_clip=1e9, on_policy=on_policy, **kw)
    if on_policy:
        gap = st.pop("rollout_logprob_gap")
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    return st, gap, grads, b


@pytest.mark.parametrize(
    ("cfg", "tis_cap", "micro"),
    [
        (LossConfig(), None, 64),
        (LossConfig(), None, 2),
        (LossConfig(negative_ratio_cap=3.0, entropy_coef=0.01), 2.0, 1),
        (LossConfig(aggregation="seq-mean-token-mean"), None, 4),
    ],
)
def test_on_policy_update_has_the_recompute_paths_loss_gradients_and_metrics(cfg, tis_cap, micro):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16))
    batch = _batch(model, 3)
    want, want_gap, want_grads, want_b = _update(model, batch, cfg, False, tis_cap=tis_cap, micro_batch=micro)
    got, got_gap, got_grads, got_b = _update(model, batch, cfg, True, tis_cap=tis_cap, micro_batch=micro)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert got["ratio_max"] == pytest.approx(1.0) and got["clip_low"] == got["clip_high"] == 0.0
    assert got_gap == pytest.approx(want_gap, rel=1e-5) and 0.1 < got_gap < 0.6  # engine moved by +-0.6
    for k, g in want_grads.items():
        assert torch.allclose(got_grads[k], g, rtol=1e-4, atol=1e-7), k
    assert any(float(g.abs().max()) > 1e-4 for g in want_grads.values())  # a gradient to compare
    # the batch is left as the recomputation leaves it: pi_old per token and the per-row gaps
    for a, b in zip(got_b.old_logprobs, want_b.old_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    for (ga, ca), (gb, cb) in zip(got_b.gaps, want_b.gaps, strict=True):
        assert ca == cb and ga == pytest.approx(gb, rel=1e-5, abs=1e-6)


def test_a_wrong_pi_old_changes_the_loss_and_gradients():
    """What the test above guards against: the engine's numbers as pi_old clip and move the loss."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16))
    batch = _batch(model, 3)
    right, _, right_grads, _ = _update(model, batch, LossConfig(), True)
    m = copy.deepcopy(model)
    wrong = rl_update(m, torch.optim.SGD(m.parameters(), lr=0.0), copy.deepcopy(batch), LossConfig(), grad_clip=1e9)
    assert wrong["clip_low"] + wrong["clip_high"] > 0 and wrong["loss"] != pytest.approx(right["loss"], rel=1e-3)
    assert not all(torch.allclose(p.grad, right_grads[k], rtol=1e-4, atol=1e-7) for k, p in m.named_parameters())


def test_on_policy_refuses_several_optimizer_steps():
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=1, n_head=2, n_embd=16))
    batch = _batch(model, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for kw in ({"ppo_epochs": 2}, {"mini_batches": 2}):
        with pytest.raises(ValueError, match="one optimizer step"):
            rl_update(model, opt, batch, LossConfig(), grad_clip=1.0, on_policy=True, **kw)


# -- in a run: forwards per RL step, and the same metrics on both paths ------------------------

RUNS = {
    "on-policy": {},
    "ppoEpochs 2": {"ppoEpochs": 2},
    "miniBatches 2": {"miniBatches": 2},
    "asyncLevel 1": {"asyncLevel": 1},
    "asyncLevel 1, miniBatches 2": {"asyncLevel": 1, "miniBatches": 2},
}


def _counted_run(tmp_path, algo: dict) -> tuple[list[dict], list[dict]]:
    """An RL stage of 3 steps; per step the trainer model's forwards by role: ``update`` (inside
    rl_update), ``pi_old`` (recompute_old_logprobs on the trained batch), ``probe`` (the spot
    check's rescoring of rollouts of engines without a fresh trained row)."""
    from kuberl.trainer import rl_step as stages

    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"].update(algo, filterZeroAdvantage=False)  # rows to train every step
    doc["spec"]["stages"][0]["steps"] = 1
    doc["spec"]["stages"][1]["steps"] = 3
    doc["spec"]["checkpoint"]["uri"] = str(tmp_path / "ck")
    job = AgenticRLJob.model_validate(doc)
    forwards = [0]
    hooked: set[int] = set()
    recomputed: list[tuple[int, int]] = []  # (id of the batch, forwards) since the last update
    steps: list[dict] = []

    def count(model) -> None:
        if id(model) not in hooked:
            hooked.add(id(model))
            model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    real_recompute, real_update = stages.recompute_old_logprobs, stages.rl_update

    def recompute(model, batch, **kw):
        count(model)
        before = forwards[0]
        out = real_recompute(model, batch, **kw)
        recomputed.append((id(batch), forwards[0] - before))
        return out

    def update(model, optimizer, batch, cfg, **kw):
        count(model)
        before = forwards[0]
        out = real_update(model, optimizer, batch, cfg, **kw)
        pi_old = sum(n for b, n in recomputed if b == id(batch))
        probe = sum(n for b, n in recomputed if b != id(batch))
        steps.append({"update": forwards[0] - before, "pi_old": pi_old, "probe": probe, "rows": len(batch.seqs)})
        recomputed.clear()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
        mp.setattr(stages, "recompute_old_logprobs", recompute)
        mp.setattr(stages, "rl_update", update)
        res = run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    return steps, [h.to_json() for h in res.history if h.type == "rl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: _counted_run(tmp_path_factory.mktemp(name.replace(" ", "")), a) for name, a in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_on_policy_step_skips_the_pi_old_forward_and_no_other_does(runs, name):
    steps, _ = runs[name]
    a = RUNS[name]
    assert len(steps) == 3 and all(s["rows"] > 0 for s in steps), steps
    epochs, minis = a.get("ppoEpochs", 1), a.get("miniBatches", 1)
    for s in steps:
        assert s["update"] == epochs * minis  # one micro-batch per mini-batch at this size
        # one optimizer step per batch, stale rollouts or not: pi_old is the update's forward
        assert s["pi_old"] == (0 if epochs * minis == 1 else 1), (name, steps)
        # the spot check (on: rollout.spotCheckRollouts 8) reads the one engine's gap from the
        # trained rows when they are fresh, and has no fresh rollout to rescore when they are not
        assert s["probe"] == 0, (name, steps)


def test_both_paths_report_the_same_metrics(runs):
    _, on = runs["on-policy"]
    _, off = runs["miniBatches 2"]
    assert [set(h) for h in on] == [set(h) for h in off]
    for h in on + off:
        # the engine is the trainer's own float32 policy: the gap is float noise, and checked
        assert 0 < h["rollout_logprob_gap"] < 1e-3
        assert set(h["engine_logprob_gap"]) == {"local-0"} and h["engine_logprob_gap"]["local-0"] < 1e-3
        for k in ("clip_low", "clip_high", "ratio_max", "approx_kl", "grad_norm", "loss"):
            assert k in h, k
    assert all(h["ratio_max"] == pytest.approx(1.0) for h in on)
    # asynchronous, pi_old from the update's forward: the engines are asked to score after the
    # update, still serving the weights pi_old was taken at (gap: float noise, not a step's change)
    _, stale = runs["asyncLevel 1"]
    for h in stale:
        assert {"engine_logprob_gap", "rollout_logprob_gap", "tis_mean", "staleness_mean"} <= set(h), h
    assert all(h["engine_logprob_gap"]["local-0"] < 1e-3 for h in stale), stale
    assert all(h["ratio_max"] == pytest.approx(1.0) for h in stale)
    # step 1: the same weights and rollouts on both paths, so the same measured gap
    assert on[0]["rollout_logprob_gap"] == pytest.approx(off[0]["rollout_logprob_gap"], rel=1e-3)


def test_the_spot_check_rescores_only_engines_the_trained_rows_do_not_measure():
    from kuberl.rollout.loop import Trajectory
    from kuberl.rollout.scored import Scored
    from kuberl.trainer.grpo import engine_gaps, spot_rows, trained_engines

    def traj(engine: str, version: int, mask: int = 1) -> Trajectory:
        return Trajectory(
            prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[mask, mask], logprobs=[-1.0, -1.0],
            turns=1, tool_calls=0, tool_errors=0, format_errors=0, answer="1", truncated=False,
            finish_reason="answer", engine=engine, versions=[version],
        )  # fmt: skip

    batch = StepBatch(
        seqs=[[1, 2, 3]] * 4, masks=[[0, 1, 1], [0, 1, 1], [0, 0, 0], [0, 1, 1]],
        old_logprobs=[[0.0, -1.0, -1.0]] * 4, advantages=[1.0, -1.0, 0.0, 1.0],
        engines=["a", "b", "c", None], fresh=[True, False, True, True],
    )  # fmt: skip
    assert trained_engines(batch) == {"a"}  # b: stale, c: nothing trained, None: unnamed
    groups = [[Scored(traj(e, 5), 0.0) for e in ("a", "b", "c", "a", "b")]]
    probe = spot_rows(groups, 5, 8, skip=trained_engines(batch))
    assert probe.engines == ["b", "c", "b"]
    assert spot_rows(groups, 5, 8).engines == ["a", "b", "c", "a", "b"]
    batch.gaps = [(0.2, 2), (0.0, 2), (0.0, 0), (0.0, 2)]
    assert engine_gaps(batch) == {"a": pytest.approx(0.1)}
