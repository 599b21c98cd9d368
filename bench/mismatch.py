"""Benchmark: training-inference mismatch on a real model and a real server.

For the same sampled sequences, the log-probs the vLLM server reported while sampling against
the trainer's recomputation (trainer/mismatch.py): mean and max |difference|, p99, and the
fraction of tokens whose ratio exp(trainer - engine) leaves [1 - 0.2, 1 + 0.28] (GRPO-RoC's clip).
Rows:

* server bf16 vs trainer fp32 (kuberl's default: float32 master weights, the server in bf16),
  and vs a trainer that computes in bf16;
* server fp32 vs trainer fp32 (what a float32 server buys);
* after an update: the trainer's float32 masters moved by one Adam-sized step (lr 1e-5,
  sign-like steps), pushed to the bf16 server (rounded to bf16 on the way) - the gap between
  masters and their served copy, which no dtype setting on the server removes.

    python bench/mismatch.py [--model DIR] [--sequences 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch

from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.template import render_prompt
from kuberl.rollout.vllm_engine import VLLMEngine
from kuberl.rollout.vllm_server import VLLMServerConfig, running_vllm
from kuberl.trainer.data import arith_problems
from kuberl.trainer.hf import load_hf_policy, write_hf_folder
from kuberl.trainer.mismatch import MismatchStats, mismatch_stats, trainer_token_logprobs
from kuberl.trainer.tokenizer import BPETokenizer

DEFAULT_MODEL = Path.home() / ".cache" / "kuberl" / "models" / "hf" / "smollm2-135m-instruct"


async def _sample(url: str, prompts: list[list[int]], max_tokens: int, eos: int):
    engine = VLLMEngine(url)
    try:
        reqs = [
            GenerateRequest(p, max_tokens, temperature=1.0, stop_token_ids=(eos,), seed=i)
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()


async def _push(url: str, folder: str) -> None:
    engine = VLLMEngine(url)
    try:
        await engine.update_weights_from_disk(folder, version=1)
    finally:
        await engine.close()


def _stats(model, prompts, outs) -> MismatchStats:
    trainer = [trainer_token_logprobs(model, p, o.output_ids) for p, o in zip(prompts, outs, strict=True)]
    return mismatch_stats([o.output_logprobs for o in outs], trainer)


def _row(label: str, s: MismatchStats) -> str:
    return (
        f"{label:<44} {s.tokens:>6} {s.mean_abs:>9.4f} {s.p99_abs:>8.3f} {s.max_abs:>8.3f} "
        f"{s.mean_signed:>+9.4f} {100 * s.outside_clip:>8.2f}%"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="prepared HF folder (kuberl models prepare)")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="trainer torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    tok = BPETokenizer.from_file(model_dir / "tokenizer.json")
    problems = arith_problems(args.sequences, seed=7)
    prompts = [tok.encode(render_prompt(f"Compute {p.question} step by step.", "compact")) for p in problems]
    print(f"model {model_dir.name}, {args.sequences} sequences of <= {args.max_tokens} sampled tokens (T=1)")
    print(f"{'':<44} {'tokens':>6} {'mean|d|':>9} {'p99|d|':>8} {'max|d|':>8} {'mean d':>9} {'outside':>9}")
    trainer32 = load_hf_policy(model_dir).eval()
    trainer16 = load_hf_policy(model_dir, dtype=torch.bfloat16).eval()
    for server_dtype in ("bfloat16", "float32"):
        cfg = VLLMServerConfig(model=str(model_dir), dtype=server_dtype, kv_cache_gib=0.5)
        t0 = time.perf_counter()
        with running_vllm(cfg) as url:
            start = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = asyncio.run(_sample(url, prompts, args.max_tokens, tok.eos_id))
            gen = time.perf_counter() - t0
            n = sum(len(o.output_ids) for o in outs)
            print(f"# server {server_dtype}: started in {start:.0f} s, sampled {n} tokens in {gen:.1f} s")
            print(_row(f"server {server_dtype} vs trainer fp32", _stats(trainer32, prompts, outs)))
            if server_dtype == "bfloat16":
                print(_row("server bfloat16 vs trainer bf16 compute", _stats(trainer16, prompts, outs)))
                # One update of the float32 masters (Adam's first steps move each weight by ~lr),
                # pushed to the bf16 server: the served copy is the masters rounded to bf16.
                updated = load_hf_policy(model_dir).eval()
                rng = random.Random(0)
                gen_t = torch.Generator().manual_seed(rng.randrange(1 << 30))
                with torch.no_grad():
                    for p in updated.parameters():
                        p.add_(1e-5 * torch.sign(torch.randn(p.shape, generator=gen_t)))
                with tempfile.TemporaryDirectory() as tmp:
                    folder = str(Path(tmp) / "v00000001")
                    write_hf_folder(updated.state_dict(), model_dir, folder)
                    asyncio.run(_push(url, folder))
                    outs2 = asyncio.run(_sample(url, prompts, args.max_tokens, tok.eos_id))
                print(_row("after 1 update: server bf16 vs fp32 masters", _stats(updated, prompts, outs2)))
                print(_row("after 1 update: server vs masters before it", _stats(trainer32, prompts, outs2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
