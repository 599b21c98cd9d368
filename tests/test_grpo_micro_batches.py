"""Micro-batches bounded by tokens (trainer.microBatchTokens): the update's memory grows with the
tokens of one forward, its gradient must not depend on the split."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from kuberl.api.job import AgenticRLJob
from kuberl.trainer.grpo import StepBatch, micro_batches, recompute_old_logprobs, rl_update
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.model import GPT, GPTConfig
from tests.test_trainer_pipeline import TINY


class _MaxOver:
    """A DistContext stand-in whose other rank needs ``other`` micro-batches."""

    def __init__(self, other: float):
        self.other = other

    def all_reduce(self, values, op="sum"):
        assert op == "max"
        return [max(v, self.other) for v in values]


def test_without_a_token_bound_rows_are_taken_in_order_as_before():
    assert micro_batches(range(5), [9] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([3, 1], [9] * 4, 64) == [[3, 1]]


def test_a_token_bound_balances_tokens_over_as_few_micro_batches_as_it_allows():
    lengths = [300, 250, 310, 40, 280, 120, 290, 200]  # 1,790 tokens
    parts = micro_batches(range(8), lengths, 64, max_tokens=600)
    assert len(parts) == 3  # ceil(1790 / 600)
    assert sorted(i for p in parts for i in p) == list(range(8))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths) and all(p == sorted(p) for p in parts)
    assert len(micro_batches(range(8), lengths, 2, max_tokens=10_000)) == 4  # the row bound still holds
    assert len(micro_batches(range(3), [500] * 3, 64, max_tokens=1)) == 3  # never below one row
    # FSDP: the rank needing the most micro-batches sets everyone's count, no share left empty
    parts = micro_batches(range(8), lengths, 64, max_tokens=600, dist=_MaxOver(5))
    assert len(parts) == 5 and all(parts)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        micro_batches(range(2), [1, 1], 64, max_tokens=0)


def _batch(vocab: int, seed: int) -> StepBatch:
    rng = random.Random(seed)
    b = StepBatch()
    for i in range(7):
        n, prompt = rng.randint(8, 40), rng.randint(2, 5)
        b.seqs.append([rng.randrange(vocab) for _ in range(n)])
        b.masks.append([0] * prompt + [rng.choice([1, 1, 1, 0]) for _ in range(n - prompt)])
        b.old_logprobs.append([0.0] + [-rng.uniform(0.5, 5.0) for _ in range(n - 1)])
        b.behavior_logprobs.append(list(b.old_logprobs[-1]))
        b.advantages.append([1.0, -1.0, 0.5][i % 3])
    return b


@pytest.mark.parametrize("on_policy", [False, True])
def test_the_update_does_not_depend_on_the_token_bound(on_policy):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16))
    batch = _batch(40, 1)
    results = []
    for bound in (None, 60, 25):
        m, b = copy.deepcopy(model), copy.deepcopy(batch)
        if not on_policy:
            recompute_old_logprobs(m, b, micro_batch_tokens=bound)
        st = rl_update(
            m, torch.optim.SGD(m.parameters(), lr=0.5), b, LossConfig(), grad_clip=1e9,
            on_policy=on_policy, micro_batch_tokens=bound,
        )  # fmt: skip
        results.append((st, [p.detach().clone() for p in m.parameters()], b.old_logprobs))
    (want, w_want, old_want), *others = results
    for st, w, old in others:
        for k, v in want.items():
            assert st[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        assert all(torch.allclose(a, c, atol=1e-6) for a, c in zip(w, w_want, strict=True))
        assert all(x == pytest.approx(y, abs=1e-5) for x, y in zip(old, old_want, strict=True))
    assert any(not torch.equal(a, c) for a, c in zip(w_want, model.parameters(), strict=True))  # it trained


def test_the_manifest_names_the_bound():
    doc = copy.deepcopy(TINY)
    doc["spec"]["trainer"]["microBatchTokens"] = 2048
    assert AgenticRLJob.model_validate(doc).spec.trainer.micro_batch_tokens == 2048
    doc["spec"]["trainer"]["microBatchTokens"] = 0
    with pytest.raises(ValueError, match="microBatchTokens"):
        AgenticRLJob.model_validate(doc)
