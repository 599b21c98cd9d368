"""Which generation path makes TRL fastest here: ``bench/peers.py``'s TRL side generates with
transformers (its vLLM paths do not run on this CPU), and GRPOTrainer offers a few ways to do it.

Each variant generates the same fixed work: 16 rows (4 prompts x G 4, the example's step) of
exactly 160 new tokens (``min_new_tokens``: no row stops early), sampled at T = 1, in this
process with ``--threads`` torch threads, after one warm-up call; tokens/s over ``--repeats``.

- ``generate``: TRL's default path (``model.generate``, DynamicCache, float32 weights);
- ``generate-static``: ``cache_implementation="static"`` (a GRPOConfig field);
- ``generate-bf16-autocast``: the default path under bf16 autocast (no TRL switch does this:
  its ``bf16=True`` autocasts the loss forward only; a reference for what bf16 would give);
- ``continuous-batching``: ``use_transformers_continuous_batching=True`` (``generate_batch``),
  float32 weights (``bf16=False``);
- ``continuous-batching-bf16``: the same as TRL runs it with ``bf16=True``: it casts the model
  to bf16 for generation and does not cast it back, so the update would then train bf16 weights.

    python bench/peers_trl_gen.py MODEL_DIR [--threads 2] [--repeats 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("generate", "generate-static", "generate-bf16-autocast", "continuous-batching", "continuous-batching-bf16")


def generate(model, cfg, prompts: list[list[int]], variant: str) -> int:
    """One call of the variant's generation path over ``prompts``; the tokens it generated."""
    import torch

    with torch.no_grad():
        if variant.startswith("continuous-batching"):
            out = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)
            return sum(len(o.generated_tokens) for o in out.values())
        width = max(map(len, prompts))
        ids = torch.tensor([[cfg.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        bf16 = variant == "generate-bf16-autocast"
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return int(gen[:, width:].numel())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from kuberl.rollout import template
    from kuberl.trainer import data as data_mod

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    probs = data_mod.load_problems("builtin:arith", 4, 1000)
    prompts = [tok.encode(template.render_prompt(p.question, "compact")) for p in probs for _ in range(4)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()}, "
          f"torch {torch.__version__}, {args.threads} threads, 16 rows x {args.tokens} new tokens", flush=True)  # fmt: skip
    for variant in args.variants:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        cfg = GenerationConfig(
            max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=True, temperature=1.0, top_p=1.0,
            top_k=0, pad_token_id=tok.pad_token_id or tok.eos_token_id, eos_token_id=tok.eos_token_id,
            cache_implementation="static" if variant == "generate-static" else None, disable_compile=True,
        )  # fmt: skip
        if variant == "continuous-batching-bf16":
            model.to(torch.bfloat16)

        try:
            generate(model, cfg, prompts, variant)  # warm-up
            rates = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                n = generate(model, cfg, prompts, variant)
                rates.append(n / (time.perf_counter() - t))
            print(json.dumps({"variant": variant, "tokens": n, "tok_per_s": [round(r, 1) for r in rates]}), flush=True)
        except Exception as e:  # a path that does not run here is a result too
            print(json.dumps({"variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    print(f"# done, load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
