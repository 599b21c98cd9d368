"""The training forwards run the output layer only from the first trained column
(grpo.policy_logprobs): same log-probs on every trained token, same update, less work."""

from __future__ import annotations

import copy

import pytest
import torch

from kuberl.trainer.grpo import StepBatch, policy_logprobs, recompute_old_logprobs, rl_update
from kuberl.trainer.loss import LossConfig, token_logprobs
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.sft import pad_batch


class _FullLogits(torch.nn.Module):
    """The same model computing every column's logits and slicing them afterwards: the reference."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask=None, use_cache=True, logits_from: int = 0):
        logits, past = self.model(ids, attention_mask=attention_mask, use_cache=use_cache)
        return logits[:, logits_from:], past


def _group(prompt: int = 9) -> tuple[list[list[int]], list[list[int]]]:
    """A GRPO group: one prompt, responses of several lengths, a masked tool output in one."""
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, 40, (prompt,), generator=g).tolist()
    seqs, masks = [], []
    for n in (6, 11, 3, 8):
        resp = torch.randint(0, 40, (n,), generator=g).tolist()
        seqs.append(head + resp)
        mask = [0] * prompt + [1] * n
        if n > 6:
            mask[prompt + 2 : prompt + 5] = [0, 0, 0]  # a tool's output inside the response
        masks.append(mask)
    return seqs, masks


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16))


def test_log_probs_of_every_trained_token_match_the_full_forward_and_the_head_skips_the_prompt():
    model = _model()
    seqs, masks = _group(prompt=9)
    inp, att, tgt, tm = pad_batch(seqs, masks)
    rows: list[int] = []
    model.lm_head.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[1]))
    lp, ent = policy_logprobs(model, inp, att, tgt, tm, with_entropy=True)
    logits, _ = model(inp, attention_mask=att, use_cache=False)
    want, want_ent = token_logprobs(logits, tgt)
    kept = tm > 0
    assert lp.shape == want.shape and ent is not None and ent.shape == want.shape
    assert torch.allclose(lp[kept], want[kept], atol=1e-6) and torch.allclose(ent[kept], want_ent[kept], atol=1e-5)
    # target column 8 is the first response token, predicted at position 8: the 8 before it are skipped
    assert rows[0] == inp.shape[1] - 8 and not lp[:, :8].any()


def test_a_micro_batch_training_nothing_still_runs_one_column():
    model = _model()
    seqs, masks = _group()
    inp, att, tgt, tm = pad_batch(seqs, [[0] * len(m) for m in masks])
    lp, _ = policy_logprobs(model, inp, att, tgt, tm)
    assert lp.shape == tgt.shape and not lp[:, :-1].any()


@pytest.mark.parametrize("on_policy", [False, True])
def test_the_update_is_the_full_forwards_update(on_policy: bool):
    seqs, masks = _group()
    batch = StepBatch()
    for s, m in zip(seqs, masks, strict=True):
        batch.seqs.append(s)
        batch.masks.append(m)
        batch.old_logprobs.append([0.0] + [-1.5] * (len(s) - 1))
        batch.behavior_logprobs.append(list(batch.old_logprobs[-1]))
    batch.advantages = [1.0, -1.0, 0.5, -0.5]
    out = []
    for wrap in (lambda m: m, _FullLogits):
        model = _model()
        b = copy.deepcopy(batch)
        policy = wrap(model)
        if not on_policy:
            recompute_old_logprobs(policy, b)
        st = rl_update(
            policy, torch.optim.SGD(model.parameters(), lr=0.5), b, LossConfig(), grad_clip=1e9,
            on_policy=on_policy, tis_cap=2.0,
        )  # fmt: skip
        out.append((st, [p.detach().clone() for p in model.parameters()], b))
    (st, w, b), (st_full, w_full, b_full) = out
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(w, w_full, strict=True))
    assert st["loss"] == pytest.approx(st_full["loss"], abs=1e-6)
    assert st["grad_norm"] == pytest.approx(st_full["grad_norm"], rel=1e-5)
    for old, old_full, m in zip(b.old_logprobs, b_full.old_logprobs, b.masks, strict=True):
        trained = [i for i, x in enumerate(m) if x]
        assert [old[i] for i in trained] == pytest.approx([old_full[i] for i in trained], abs=1e-6)
