"""RoC selection, group advantages and the clipped policy loss against hand-computed values."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kuberl.trainer.advantage import filter_groups, group_advantages
from kuberl.trainer.loss import LossConfig, aggregate, policy_loss, token_logprobs
from kuberl.trainer.roc import RocCandidate, p_err, p_format, p_total, quotas, select


def cand(reward, calls=1, errors=0, tags=1, turns=2, fmt=0):
    return RocCandidate(reward, calls, errors, tags, turns, fmt)


# -- RoC -------------------------------------------------------------------------------------


def test_penalties_match_eqs_4_5():
    assert p_err(cand(1, calls=0, errors=0)) == 0.5
    assert p_err(cand(1, calls=4, errors=1)) == 0.25
    assert p_format(cand(1, tags=0)) == 1.0
    assert p_format(cand(1, tags=1)) == 0.0
    assert p_format(cand(1, tags=3, turns=4)) == 0.5
    assert p_format(cand(1, tags=9, turns=2)) == 1.0
    # eq. 5 as published ignores tool-call format errors (p_err already counts malformed calls)...
    assert p_format(cand(1, tags=1, turns=4, fmt=1)) == 0.0
    assert p_total(cand(1, calls=2, errors=1, tags=2, turns=2, fmt=2)) == 1.0
    # ...the opt-in extension adds format_errors / turns, capped at 1
    assert p_format(cand(1, tags=1, turns=4, fmt=1), count_format_errors=True) == 0.25
    assert p_format(cand(1, tags=2, turns=2, fmt=3), count_format_errors=True) == 1.0
    assert p_total(cand(1, calls=2, errors=1, tags=1, turns=2, fmt=1), count_format_errors=True) == 1.0
    with pytest.raises(ValueError):
        cand(1, calls=1, errors=2)


def test_quotas_keep_half_of_each_side_for_2g():
    assert quotas(10, 6, 8) == (5, 3)
    assert quotas(7, 9, 8) == (4, 4)  # floor(9/2) negatives, the rest positives
    assert quotas(16, 0, 8) == (8, 0)  # all correct
    assert quotas(0, 16, 8) == (0, 8)  # all wrong
    assert quotas(1, 15, 8) == (1, 7)  # positives short: negatives fill the batch
    assert quotas(3, 2, 8) == (3, 2)  # fewer than G: keep everything


@pytest.mark.parametrize("n_pos", range(0, 17))
def test_select_returns_exactly_g_with_paper_proportions(n_pos):
    cands = [cand(1)] * n_pos + [cand(0)] * (16 - n_pos)
    kept = select(cands, 8, seed=3)
    assert len(kept) == 8 and len(set(kept)) == 8
    n_neg_kept = sum(cands[i].reward == 0 for i in kept)
    assert n_neg_kept == (16 - n_pos) // 2  # floor(|neg|/2); positives ceil(|pos|/2)


def test_select_prefers_clean_positives_and_is_deterministic():
    clean = [cand(1, calls=2, errors=0)] * 4
    noisy = [cand(1, calls=2, errors=2, tags=3)] * 4
    cands = noisy + clean + [cand(0)] * 8
    kept = select(cands, 8, seed=0)
    assert kept == select(cands, 8, seed=0)
    assert set(range(4, 8)) <= set(kept)  # the four clean positives (weight 100 vs ~0.5)
    assert not set(range(4)) & set(kept)
    assert sum(cands[i].reward == 0 for i in kept) == 4


def test_select_weights_are_inverse_to_p_total():
    # one positive with p_total 0.5 (no tool call), one with 1.0 (half errors + an extra answer tag)
    cands = [cand(1, calls=0), cand(1, calls=2, errors=1, tags=2, turns=2), cand(0), cand(0)]
    # quotas(2, 2, 2) -> 1 positive, 1 negative; weights 1/(0.5+eps) vs 1/(1.0+eps)
    picks = Counter(next(i for i in select(cands, 2, seed=s) if i < 2) for s in range(3000))
    w0, w1 = 1 / (0.5 + 1e-2), 1 / (1.0 + 1e-2)
    assert picks[0] / 3000 == pytest.approx(w0 / (w0 + w1), abs=0.03)


def test_format_errors_weigh_only_with_the_opt_in_extension():
    # two positives with p_err 0.5 and a clean answer; the second also wrote an unclosed <tool_call>
    cands = [cand(1, calls=2, errors=1, tags=1, turns=2), cand(1, calls=2, errors=1, tags=1, turns=2, fmt=1)]
    cands += [cand(0), cand(0)]

    def share_of_first(**kw) -> float:
        picks = Counter(next(i for i in select(cands, 2, seed=s, **kw) if i < 2) for s in range(3000))
        return picks[0] / 3000

    assert share_of_first() == pytest.approx(0.5, abs=0.03)  # eq. 5: equal weights
    w0, w1 = 1 / (0.5 + 1e-2), 1 / (1.0 + 1e-2)  # extension: p_format 0 vs 1/2
    assert share_of_first(count_format_errors=True) == pytest.approx(w0 / (w0 + w1), abs=0.03)


def test_ties_and_negatives_are_uniform():
    cands = [cand(0)] * 4 + [cand(1)] * 4
    counts = Counter(i for s in range(2000) for i in select(cands, 4, seed=s))
    for i in range(8):
        assert counts[i] / 2000 == pytest.approx(0.5, abs=0.05)


def test_plain_grpo_takes_the_first_g():
    cands = [cand(1, errors=1)] * 5 + [cand(1)] * 5
    assert select(cands, 4, seed=1, roc=False) == [0, 1, 2, 3]
    assert select(cands[:3], 4, seed=1) == [0, 1, 2]
    with pytest.raises(ValueError):
        select(cands, 0, seed=1)


# -- advantages ------------------------------------------------------------------------------


def test_group_advantages_and_filter():
    adv = group_advantages([1, 0, 0, 1])
    assert adv == pytest.approx([1, -1, -1, 1])
    adv = group_advantages([1, 0, 0, 0])
    std = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert group_advantages([1, 1, 1]) == [0, 0, 0]
    keep, dropped = filter_groups([[0, 0], [1, -1], [0.0, 0.0]])
    assert keep == [1] and dropped == 2


# -- loss ------------------------------------------------------------------------------------


def test_loss_hand_computed_clip_higher_and_token_mean():
    old = torch.zeros(2, 3)
    ratios = torch.tensor([[1.5, 1.1, 2.0], [0.5, 0.9, 1.0]])
    new = ratios.log().requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, st = policy_loss(new, old, adv, mask)
    # row 0 (A=+1): min(r, clip(r, .8, 1.28)) -> 1.28, 1.1 ; row 1 (A=-1): min(-r, -clip(r)) -> -0.8, -0.9, -1.0
    expected = -(1.28 + 1.1 - 0.8 - 0.9 - 1.0) / 5
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert st["clip_high"] == pytest.approx(1 / 5) and st["clip_low"] == pytest.approx(1 / 5)
    loss.backward()
    # clipped tokens get no gradient; unclipped tokens d(-A r)/dlogr = -A r / N
    g = new.grad
    assert float(g[0, 0]) == 0 and float(g[1, 0]) == 0 and float(g[0, 2]) == 0
    assert float(g[0, 1]) == pytest.approx(-1.1 / 5)
    assert float(g[1, 1]) == pytest.approx(0.9 / 5)


def test_negative_ratio_cap_intellect2():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(10.0), math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss_nocap, _ = policy_loss(new, old, torch.tensor([-1.0]), mask)
    assert float(loss_nocap.detach()) == pytest.approx((10 + 2) / 2)
    loss, st = policy_loss(new, old, torch.tensor([-1.0]), mask, LossConfig(negative_ratio_cap=4.0))
    assert float(loss.detach()) == pytest.approx((4 + 2) / 2)
    assert st["cap_frac"] == 0.5
    loss.backward()
    assert float(new.grad[0, 0]) == 0.0  # capped: no gradient from the exploding ratio
    with pytest.raises(ValueError):
        LossConfig(negative_ratio_cap=1.1)


def test_aggregations_and_kl_entropy():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(v, m, "token-mean", num_tokens=8)) == pytest.approx(10 / 8)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    lp = torch.zeros(1, 1)
    ref = torch.tensor([[math.log(0.5)]])
    loss, _ = policy_loss(
        lp, lp, torch.tensor([0.0]), torch.ones(1, 1), LossConfig(kl_coef=2.0), ref_logprobs=ref
    )
    assert float(loss.detach()) == pytest.approx(2.0 * (0.5 - math.log(0.5) - 1))
    ent = torch.tensor([[0.7]])
    loss, _ = policy_loss(
        lp, lp, torch.tensor([0.0]), torch.ones(1, 1), LossConfig(entropy_coef=0.1), entropy=ent
    )
    assert float(loss.detach()) == pytest.approx(-0.07)
    with pytest.raises(ValueError):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError):
        policy_loss(lp, lp, torch.tensor([0.0]), torch.ones(1, 1), LossConfig(kl_coef=1.0))


# -- the update's statistics -----------------------------------------------------------------


def test_rl_update_stats_over_micro_batches_match_the_full_batch():
    """Fractions/means are token-weighted over micro-batches; ratio_max is the batch's maximum."""
    import random

    from kuberl.trainer.grpo import StepBatch, rl_update
    from kuberl.trainer.loss import token_logprobs
    from kuberl.trainer.model import GPT, GPTConfig
    from kuberl.trainer.sft import pad_batch

    torch.manual_seed(0)
    rng = random.Random(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=64, n_layer=1, n_head=2, n_embd=16))
    batch = StepBatch()
    for i in range(6):
        n, prompt = rng.randint(8, 30), rng.randint(2, 5)
        batch.seqs.append([rng.randrange(50) for _ in range(n)])
        batch.masks.append([0] * prompt + [rng.choice([1, 1, 1, 0]) for _ in range(n - prompt)])
        batch.old_logprobs.append([-rng.random() * 6 if m else 0.0 for m in batch.masks[-1]])
        batch.advantages.append([1.0, -1.0, 0.5][i % 3])
    # the reference: ratios of the untouched model over the whole batch at once
    inp, att, tgt, tm = pad_batch(batch.seqs, batch.masks)
    old = torch.zeros_like(tm)
    for r, o in enumerate(batch.old_logprobs):
        old[r, : len(o) - 1] = torch.tensor(o[1:])
    with torch.no_grad():
        lp, _ = token_logprobs(model(inp, attention_mask=att)[0], tgt)
    kept = tm > 0
    ratio = (lp - old).exp()[kept]
    adv = torch.tensor(batch.advantages)[:, None].expand_as(lp)[kept]
    cfg = LossConfig()
    want = {
        "ratio_max": float(ratio.max()),
        "ratio_mean": float(ratio.mean()),
        "clip_high": float(((adv > 0) & (ratio > 1 + cfg.clip_high)).float().mean()),
        "clip_low": float(((adv < 0) & (ratio < 1 - cfg.clip_low)).float().mean()),
    }
    assert 0 < want["clip_high"] < 1 and 0 < want["clip_low"] < 1  # the batch exercises both sides
    for micro in (1, 2, 64):
        m = GPT(model.config)
        m.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        got = rl_update(m, opt, batch, cfg, grad_clip=1e9, micro_batch=micro)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5), (micro, k)
        assert got["tokens"] == int(kept.sum())


def test_recompute_old_logprobs_uses_the_trainer_policy_and_reports_the_gap():
    from kuberl.trainer.grpo import StepBatch, recompute_old_logprobs, rl_update
    from kuberl.trainer.loss import token_logprobs
    from kuberl.trainer.model import GPT, GPTConfig
    from kuberl.trainer.sft import pad_batch

    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=1, n_head=2, n_embd=16))
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    masks = [[0, 0, 1, 1, 0, 1], [0, 1, 1, 1]]
    with torch.no_grad():
        inp, att, tgt, tm = pad_batch(seqs, masks)
        lp, _ = token_logprobs(model(inp, attention_mask=att)[0], tgt)
    engine = [[0.0] + [float(x) + 0.1 for x in lp[0, :5]], [0.0] + [float(x) - 0.3 for x in lp[1, :3]]]
    batch = StepBatch(seqs, masks, [list(e) for e in engine], [1.0, -1.0])
    gap = recompute_old_logprobs(model, batch, micro_batch=1)
    assert gap == pytest.approx((3 * 0.1 + 3 * 0.3) / 6, rel=1e-4)  # over the 6 trained tokens
    # the trainer's numbers on trained tokens, 0 elsewhere (they would depend on the layout)
    trained = tm > 0
    assert batch.old_logprobs[0][1:] == pytest.approx(torch.where(trained, lp, 0.0)[0, :5].tolist(), abs=1e-6)
    assert batch.old_logprobs[1][1:] == pytest.approx(torch.where(trained, lp, 0.0)[1, :3].tolist(), abs=1e-6)
    model.train()
    recompute_old_logprobs(model, batch)
    assert model.training
    # on-policy: the first (only) mini-batch sees ratio 1 everywhere, nothing is clipped
    st = rl_update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, LossConfig(), grad_clip=1.0)
    assert st["ratio_max"] == pytest.approx(1.0, abs=1e-5) and st["clip_low"] == st["clip_high"] == 0


def test_token_logprobs_without_entropy_are_the_same_logprobs_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 11, requires_grad=True)
    tgt = torch.randint(0, 11, (2, 5))
    full, ent = token_logprobs(x, tgt)
    (g_full,) = torch.autograd.grad(full.sum(), x)
    lean, none = token_logprobs(x, tgt, with_entropy=False)
    (g_lean,) = torch.autograd.grad(lean.sum(), x)
    assert none is None and ent is not None and ent.shape == (2, 5)
    assert torch.allclose(full, lean, atol=1e-6) and torch.allclose(g_full, g_lean, atol=1e-6)
