"""What kuberl knows of a model without loading it: its size from its name (``Qwen3-14B``), and
the attention shape its KV cache follows, from a table of the architectures kuberl's examples and
docs name or from ``config.json`` when the model is a local directory.

Pure lookups: the capacity warnings (``advisories``, ``kvcache``) weigh these against the
accelerators a manifest asks for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCELERATOR_MEMORY_GB = {"mi300x": 192, "h100": 80}
"""Memory of one accelerator of each GPU profile."""
ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
"""Bytes per weight (and per KV-cache element) as an engine serves them (auto: the checkpoint's
own, bf16 for current models)."""
_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([BM])(?![a-z])", re.IGNORECASE)


def _local_config(uri: str) -> dict[str, Any] | None:
    """The ``config.json`` of a model kept in a local directory (None: not local, or unreadable)."""
    if uri.startswith(("s3://", "builtin:", "hf://")):
        return None
    path = Path(uri) / "config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _config_parameters(cfg: dict[str, Any]) -> float | None:
    """Parameters a decoder's config.json implies: attention (q, k, v, o), a gated MLP per layer
    (per expert for a mixture of experts) and the embeddings (twice if the head is untied)."""
    try:
        hidden, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        experts = int(cfg.get("num_experts") or 1)
        mlp = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts > 1 else int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(layers * (attention + 3 * hidden * mlp * experts) + embeddings)


def model_parameters(name: str) -> float | None:
    """Parameters of a model: from its config.json when it is a local directory, else as its
    name counts them (``Qwen3-14B``: 14e9, ``SmolLM2-135M``: 135e6; ``Qwen3-235B-A22B``: 235e9,
    every expert); None where neither says."""
    cfg = _local_config(name)
    if cfg is not None:
        return _config_parameters(cfg)
    m = _SIZE.search(name.rstrip("/").rsplit("/", 1)[-1])
    if m is None:
        return None
    return float(m[1]) * (1e9 if m[2].upper() == "B" else 1e6)


@dataclass(frozen=True)
class Attention:
    """The shape of a model's KV cache: per layer, ``kv_heads`` keys and values of ``head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


ARCHITECTURES: dict[tuple[str, str], Attention] = {
    # (family, size as the name writes it) -> attention shape, from each model's config.json
    ("smollm2", "135m"): Attention(30, 3, 64),
    ("smollm2", "360m"): Attention(32, 5, 64),
    ("smollm2", "1.7b"): Attention(24, 32, 64),
    ("qwen2.5", "0.5b"): Attention(24, 2, 64),
    ("qwen2.5", "1.5b"): Attention(28, 2, 128),
    ("qwen2.5", "3b"): Attention(36, 2, 128),
    ("qwen2.5", "7b"): Attention(28, 4, 128),
    ("qwen2.5", "14b"): Attention(48, 8, 128),
    ("qwen2.5", "32b"): Attention(64, 8, 128),
    ("qwen2.5", "72b"): Attention(80, 8, 128),
    ("qwen3", "0.6b"): Attention(28, 8, 128),
    ("qwen3", "1.7b"): Attention(28, 8, 128),
    ("qwen3", "4b"): Attention(36, 8, 128),
    ("qwen3", "8b"): Attention(36, 8, 128),
    ("qwen3", "14b"): Attention(40, 8, 128),
    ("qwen3", "32b"): Attention(64, 8, 128),
    ("qwen3", "30b"): Attention(48, 4, 128),  # Qwen3-30B-A3B
    ("qwen3", "235b"): Attention(94, 4, 128),  # Qwen3-235B-A22B
    ("llama-3.1", "8b"): Attention(32, 8, 128),
    ("llama-3.1", "70b"): Attention(80, 8, 128),
}
_FAMILY = re.compile(r"^(smollm2|qwen2\.5|qwen3|llama-3\.1)(?![.\d])")


def _config_attention(cfg: dict[str, Any]) -> Attention | None:
    """The attention shape a Hugging Face ``config.json`` gives (None: incomplete)."""
    try:
        heads = int(cfg["num_attention_heads"])
        return Attention(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        )
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def model_attention(uri: str) -> Attention | None:
    """The attention shape of ``uri``: a local directory's config.json, else the table by the
    name's family and size (``Qwen/Qwen2.5-7B-Instruct``: qwen2.5 7b), else None."""
    cfg = _local_config(uri)
    if cfg is not None:
        return _config_attention(cfg)
    name = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    family, size = _FAMILY.match(name), _SIZE.search(name)
    if family is None or size is None:
        return None
    return ARCHITECTURES.get((family[1], size[0].lower()))
