"""The tiny GPT's KV cache and left padding must not change what the model computes."""

import pytest
import torch

from kuberl.trainer.model import GPTConfig

pytestmark = pytest.mark.tiny_gpt(size=64)  # the model fixture


def test_incremental_decoding_matches_full_forward(model):
    ids = torch.randint(0, 64, (1, 12))
    full, _ = model(ids)
    logits, past = model(ids[:, :5])
    steps = [logits]
    for t in range(5, 12):
        step, past = model(ids[:, t : t + 1], past=past)
        steps.append(step)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_left_padding_matches_unpadded_rows(model):
    a, b = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], dim=1)])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    logits, past = model(batch, attention_mask=mask)
    assert torch.allclose(logits[0], model(a)[0][0], atol=1e-5)
    assert torch.allclose(logits[1, 4:], model(b)[0][0], atol=1e-5)
    nxt = torch.randint(0, 64, (2, 1))
    step, _ = model(nxt, past=past, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    assert torch.allclose(step[1], model(torch.cat([b, nxt[1:]], 1))[0][0, -1:], atol=1e-5)


def test_bad_mask_and_length_are_clear_errors(model):
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown model.config key"):
        GPTConfig.from_dict({"nLayers": 2})
    assert GPTConfig.from_dict({"nLayer": 3, "nEmbd": 64}).n_layer == 3
