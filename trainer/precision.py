"""What the trainer's forwards and backwards compute in: ``trainer.precision``.

``float32``: everything in float32, as the weights are. ``bf16``: autocast to bfloat16 over the
float32 master weights (the usual mixed-precision recipe): matmuls and attention run in bf16,
reductions, softmaxes and the loss in float32 (the log-probs are taken from float32 logits,
``loss.token_logprobs``), and the weights, gradients and AdamW moments stay float32, so
checkpoints and pushed weights are unchanged in kind. CPUs with AVX512-BF16 or AMX and every
current accelerator run bf16 matmuls faster than float32; elsewhere the CPU emulates them
(bench/README.md has the update's speed under each).
FSDP on accelerators computes in bf16 whatever this says (``distributed.shard_policy``).
"""

from __future__ import annotations

import contextlib
from typing import get_args

import torch

from kuberl.api.job import Precision

PRECISIONS: tuple[str, ...] = get_args(Precision)


def compute_in(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context the trainer's forwards and backwards run in on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
