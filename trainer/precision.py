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
from pathlib import Path
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


# CPU flags (``/proc/cpuinfo``) under which oneDNN runs bf16 matmuls natively; without them PyTorch
# falls back to its reference GEMM for some bf16 shapes, far slower than float32 (an AVX2-only CPU
# spent minutes on one update's backward that float32 does in seconds: bench/README.md).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where ``/proc/cpuinfo`` is not readable)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bf16_warning(precision: str, device: torch.device | str, flags: frozenset[str]) -> str | None:
    """Why ``trainer.precision: bf16`` will be slow here, or None: a CPU device whose flags lack
    native bf16 matmuls (unknown flags: no warning)."""
    if precision != "bf16" or torch.device(device).type != "cpu" or not flags or flags & BF16_CPU_FLAGS:
        return None
    return (
        "warning: trainer.precision is bf16 but this CPU has no AVX512-BF16 or AMX "
        "(/proc/cpuinfo lacks avx512_bf16 and amx_bf16): bf16 matmuls fall back to a slow "
        "reference path here; set trainer.precision: float32"
    )
