"""A nanoGPT-style causal LM with a KV cache and left-padding support.

It is the ``builtin:tiny-gpt`` policy of the quickstart and the model LocalEngine serves.
The forward signature is the contract with ``kuberl.rollout.local_engine``:

    logits, present = model(input_ids, past=None, attention_mask=None, use_cache=True)

* ``input_ids``: LongTensor [B, T] (new tokens only when ``past`` is given)
* ``past``: per-layer (k, v) tensors [B, H, T_past, D] from the previous call, or None
* ``attention_mask``: [B, T_past + T] with 1 for real tokens and 0 for left padding; None = all real
* ``use_cache``: False for training and scoring forwards, which never decode on: the cache is
  then None (this model's k, v are views it keeps for the backward anyway; an HF model would
  copy them into a cache, ``kuberl.trainer.hf``)
* returns logits [B, T, V] and the updated per-layer (k, v) cache.
Positions are derived from the mask (cumsum), so left-padded rows see the same positions as
unpadded ones and batched decoding matches one-at-a-time decoding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        """Accepts snake_case or camelCase keys (model.config in the manifest is camelCase)."""
        names = {f.name for f in fields(cls)}
        out = {}
        for k, v in d.items():
            snake = "".join("_" + c.lower() if c.isupper() else c for c in k)
            if snake not in names:
                raise ValueError(f"unknown model.config key {k!r}; known: {sorted(names)}")
            out[snake] = v
        return cls(**out)

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x, past, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C)), (k, v)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x, past, mask):
        a, present = self.attn(self.ln1(x), past, mask)
        x = x + a
        return x + self.mlp(self.ln2(x)), present


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

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
        """Logits [B, T - logits_from, V] of positions ``logits_from`` on (the training forwards
        need none before the first trained token) and the KV cache (None without ``use_cache``)."""
        B, T = input_ids.shape
        t_past = past[0][0].shape[2] if past else 0
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, t_past + T, dtype=torch.long, device=device)
        if attention_mask.shape != (B, t_past + T):
            raise ValueError(f"attention_mask must be [{B}, {t_past + T}], got {list(attention_mask.shape)}")
        valid = attention_mask.bool()
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, t_past:]
        if int(positions.max()) >= self.config.block_size:
            raise ValueError(f"sequence longer than block_size={self.config.block_size}")
        # query i (absolute t_past+i) may see key j iff j <= t_past+i and key j is a real token.
        q_idx = torch.arange(t_past, t_past + T, device=device)[:, None]
        k_idx = torch.arange(t_past + T, device=device)[None, :]
        mask = (k_idx <= q_idx)[None, None] & valid[:, None, None, :]
        # A fully padded query row would give NaN; let it see itself (its output is ignored).
        mask = mask | (~mask.any(-1, keepdim=True) & (k_idx == q_idx)[None, None])
        x = self.wte(input_ids) + self.wpe(positions)
        present: KV = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, past[i] if past else None, mask)
            present.append(kv)
        return self.lm_head(self.ln_f(x[:, logits_from:])), present if use_cache else None
