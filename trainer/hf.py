"""Hugging Face causal LMs as kuberl policies (what a cluster run trains, e.g. Qwen3-14B-Base).

:class:`HFPolicy` gives any ``AutoModelForCausalLM`` the forward contract of the builtin
``GPT`` (``logits, present = model(input_ids, past=None, attention_mask=None)`` with left
padding and per-layer ``(k, v)`` caches), so one code path serves both: the SFT loss, the
GRPO-RoC update and ``LocalEngine`` (which lets a small HF model run end to end on a laptop,
and lets the tests exercise the cluster path without SGLang).

Positions come from the attention mask (``cumsum - 1``) exactly as in ``GPT``: a left-padded
row sees the same positions as the unpadded sequence, so a rollout's log-probs do not depend
on what it was batched with.

Model sources (``spec.model.base``): ``kuberl:NAME`` (a packaged model, ``trainer.pretrained``),
a local directory with ``config.json`` and weights, an
``s3://bucket/prefix`` holding such a directory (downloaded once into the cache folder), or a
Hub repo id (downloaded into ``HF_HOME``; the operator mounts a cache volume there). The
tokenizer is the model directory's ``tokenizer.json`` unless ``spec.model.tokenizer`` names
another; it must contain the rStar2 template's ``<|im_end|>`` (Qwen tokenizers do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class HFPolicyConfig:
    """What a rollout worker needs to rebuild the policy: where its files are."""

    path: str
    block_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"hf": self.path, "block_size": self.block_size}


def cache_argument(model: nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache under: ``cache`` from transformers 5.25 on
    (where ``past_key_values`` is a deprecated alias, removed in 5.40), ``past_key_values`` before."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class HFPolicy(nn.Module):
    """An ``AutoModelForCausalLM`` with the builtin GPT's forward contract (module docstring)."""

    def __init__(self, model: nn.Module, path: str):
        super().__init__()
        self.hf = model
        max_pos = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        self.config = HFPolicyConfig(str(path), int(max_pos))
        self._cache_arg = cache_argument(model)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        past: KV | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
        logits_from: int = 0,
    ):
        """``use_cache=False`` (training and scoring forwards) builds no KV cache and returns None
        for it: HF's cache holds a copy of every layer's keys and values.
        ``logits_from``: logits of positions from there on only (HF's ``logits_to_keep``): the
        output layer over a 49k vocabulary is a fifth of SmolLM2-135M's FLOPs, wasted on the
        prompt's positions, which train nothing."""
        from transformers import DynamicCache

        B, T = input_ids.shape
        t_past = past[0][0].shape[2] if past else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, t_past + T, dtype=torch.long, device=input_ids.device)
        if attention_mask.shape != (B, t_past + T):
            raise ValueError(f"attention_mask must be [{B}, {t_past + T}], got {list(attention_mask.shape)}")
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, t_past:]
        if not use_cache and not past:
            keep = {"logits_to_keep": T - logits_from} if logits_from > 0 else {}
            out = self.hf(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **keep
            )
            return out.logits, None
        if logits_from:
            raise ValueError("logits_from needs use_cache=False (the training and scoring forwards)")
        cache = DynamicCache()
        for i, (k, v) in enumerate(past or []):
            cache.update(k, v, i)
        out = self.hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
        )
        returned = getattr(out, self._cache_arg)  # the output field was renamed with the argument
        present = [(layer.keys, layer.values) for layer in returned.layers]
        return out.logits, present if use_cache else None


HF_SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def write_hf_folder(
    state_dict: dict[str, torch.Tensor],
    source_dir: str | Path,
    dest: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an :class:`HFPolicy` state dict as an HF model folder SGLang can load.

    Takes a (full, CPU) state dict rather than the module so the same writer serves an
    FSDP-sharded policy, whose rank 0 only holds the gathered tensors. The config and
    tokenizer files are copied from the folder the policy was loaded from; weights are
    written as sharded safetensors with an index (tied weights stored once), in ``dtype`` (the
    engines' serving dtype; default the model's own).
    """
    save_hf_folder(engine_tensors(state_dict, source_dir, dtype), source_dir, dest)


def save_hf_folder(weights: dict[str, torch.Tensor], source_dir: str | Path, dest: str | Path) -> None:
    """Write ``weights`` (checkpoint names, as :func:`engine_tensors` gives them) as sharded
    safetensors with an index, beside the config and tokenizer files of ``source_dir``."""
    import shutil

    from huggingface_hub import save_torch_state_dict

    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDECAR_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, out / name)
    save_torch_state_dict(weights, out, max_shard_size="5GB")


def engine_tensors(
    state_dict: dict[str, torch.Tensor], source_dir: str | Path, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The tensors an engine loads for an :class:`HFPolicy` state dict: checkpoint names, the
    serving ``dtype`` (default the model's own), tied output embeddings once."""
    dtype = dtype or serving_dtype(source_dir)
    weights = {
        k.removeprefix("hf."): v.to(dtype) if dtype is not None and v.is_floating_point() else v
        for k, v in state_dict.items()
    }
    drop_tied_output(weights, source_dir)
    return weights


def drop_tied_output(weights: dict[str, torch.Tensor], source_dir: str | Path) -> None:
    """Store tied output embeddings once, as the model's own folder does.

    A state dict gathered from FSDP shards holds ``lm_head.weight`` as a separate copy of the
    input embeddings; written out, an engine that reloads in place (vLLM) loads it into its
    lm_head and the tie is broken from then on (seen: restoring the original folder afterwards
    left the pushed lm_head in place).
    """
    import json

    try:
        cfg = json.loads((Path(source_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights:
        embed = next((k for k in weights if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            if not torch.equal(weights["lm_head.weight"], weights[embed]):
                raise ValueError("config ties the word embeddings but lm_head.weight differs from " + embed)
            del weights["lm_head.weight"]


def serving_dtype(source_dir: str | Path) -> torch.dtype | None:
    """The dtype the model ships in (config.json ``dtype``/``torch_dtype``): the trainer keeps
    float32 master weights, the engines get what they were started with (half the bytes)."""
    import json

    try:
        cfg = json.loads((Path(source_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def is_hf_source(base: str) -> bool:
    return not base.startswith("builtin:")


def _download_s3_prefix(uri: str, dest: Path) -> Path:
    import boto3

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    s3 = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3") or None)
    marker = dest / ".complete"
    if marker.is_file():
        return dest
    found = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) :]
            if not rel or rel.endswith("/"):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
            found += 1
    if not found:
        raise ValueError(f"model {uri!r}: no objects under that prefix")
    marker.touch()
    return dest


PRETRAINED_PREFIX = "kuberl:"
"""``kuberl:NAME``: a model ``kuberl models prepare`` knows, prepared on first use into the cache."""


def resolve_model_dir(source: str, cache_dir: str | Path) -> Path:
    """A local directory holding the model's files (downloaded first for s3:// and Hub ids,
    prepared first for ``kuberl:NAME``)."""
    if source.startswith(PRETRAINED_PREFIX):
        from kuberl.trainer.pretrained import default_dir, lookup, prepare

        name = source[len(PRETRAINED_PREFIX) :]
        lookup(name)  # unknown names fail here, naming the known ones
        return prepare(name, default_dir(name))
    p = Path(source)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model {source!r}: directory has no config.json")
        return p
    if source.startswith("s3://"):
        safe = source[len("s3://") :].strip("/").replace("/", "--")
        return _download_s3_prefix(source, Path(cache_dir) / "s3" / safe)
    if source.startswith(("/", "./", "../")) or source.startswith("file:"):
        raise ValueError(f"model {source!r}: no such directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, cache_dir=os.environ.get("HF_HOME") or None))
    except Exception as err:  # offline, unknown repo, auth: all end the run the same way
        raise ValueError(f"model {source!r}: could not fetch it from the Hugging Face Hub ({err})") from err


def load_hf_policy(path: str | Path, *, dtype: torch.dtype = torch.float32) -> HFPolicy:
    """Load ``AutoModelForCausalLM`` from a local directory (see :func:`resolve_model_dir`).

    float32 by default: these are the trainer's master weights (Adam's updates at lr 1e-6 are
    below bf16's resolution); on accelerators FSDP computes in bf16 (``shard_policy``).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return HFPolicy(model, str(path))


def meta_hf_policy(config: dict[str, Any], path: str, *, dtype: torch.dtype = torch.float32) -> HFPolicy:
    """The architecture of ``config`` (an HF ``config.to_dict()``) on the meta device: no memory
    and no download. FSDP ranks other than 0 start from this and receive their shards from
    rank 0 (``distributed.load_from_rank0``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return HFPolicy(model, path)


def policy_from_config(config: dict[str, Any]) -> nn.Module:
    """Rebuild a policy from ``model.config.to_dict()`` (builtin GPT or HF) in another process."""
    if "hf" in config:
        return load_hf_policy(config["hf"])
    from kuberl.trainer.model import GPT, GPTConfig

    return GPT(GPTConfig.from_dict(config))
