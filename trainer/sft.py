"""The non-reasoning SFT stage (paper section 4.1): next-token loss on assistant tokens only.

Prompt and tool-response tokens are context, not targets (their loss mask is 0), exactly as
in RL, so SFT teaches the tool-call format, copying the tool output into the answer, and
stopping with ``<|im_end|>`` - not to predict what the tool will print.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def pad_batch(
    seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, targets, target_mask), all [B, T-1] / [B, T].

    ``targets[:, t]`` is token t+1 and ``target_mask[:, t]`` its loss mask, so position t of the
    logits predicts it; padding has target_mask 0.
    """
    if not seqs:
        raise ValueError("empty batch")
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    lm = torch.zeros(len(seqs), width, dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        if len(s) != len(m):
            raise ValueError(f"sequence {i}: {len(s)} tokens but {len(m)} mask entries")
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        att[i, : len(s)] = 1
        lm[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    ids, att, lm = ids.to(device), att.to(device), lm.to(device)
    return ids[:, :-1], att[:, :-1], ids[:, 1:], lm[:, 1:]


def sft_loss(
    model: nn.Module,
    seqs: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    device="cpu",
    num_tokens: float | None = None,
):
    """Token-mean cross-entropy over assistant tokens; returns (loss, token accuracy).

    ``num_tokens``: the denominator when ``seqs`` is one rank's share of a larger batch (the
    whole batch's assistant tokens), so the ranks' losses add up to the batch's; the accuracy
    is then this share's correct tokens over the same denominator (they add up too).
    """
    inp, att, tgt, tm = pad_batch(seqs, masks, device)
    logits, _ = model(inp, attention_mask=att, use_cache=False)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="none")
    ce = ce.view_as(tm)
    n = tm.sum().clamp(min=1.0) if num_tokens is None else max(1.0, float(num_tokens))
    loss = (ce * tm).sum() / n
    with torch.no_grad():
        acc = float(((logits.argmax(-1) == tgt).float() * tm).sum() / n)
    return loss, acc
