"""A tiny Hugging Face causal LM (Qwen2 architecture, random weights) for the cluster-path tests.

It uses the quickstart's BPE tokenizer (which has the rStar2 template's special tokens), so
the same prompts, tool calls and sandbox run through it as through the builtin model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kuberl.trainer.data import tokenizer_corpus
from kuberl.trainer.tokenizer import train_bpe


def make_tiny_hf_model(directory: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """Write config.json + safetensors weights + tokenizer.json into ``directory``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(tokenizer_corpus(2000, seed), 1024)
    tok.save(d / "tokenizer.json")
    cfg = Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.eos_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(str(d), safe_serialization=True)
    return d
