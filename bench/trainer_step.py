"""Trainer throughput: the GRPO-RoC update (forward + backward + AdamW) and LocalEngine
sampling of the quickstart model, on CPU or CUDA, in tokens/s.

    python bench/trainer_step.py [--device cuda] [--batch 128] [--len 64] [--steps 5]

No sandbox is involved: the update runs on synthetic rollouts of the given shape, and the
engine samples ``--batch`` single-turn continuations of ``--len`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.local_engine import LocalEngine
from kuberl.trainer.grpo import StepBatch, rl_update
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.policy import TINY_DEFAULTS


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=128, help="kept rollouts per RL step")
    ap.add_argument("--len", type=int, default=64, help="tokens per rollout (prompt 16 + response)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=609, **TINY_DEFAULTS)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, 609, (args.batch, args.len), generator=g).tolist()
    masks = [[0] * 16 + [1] * (args.len - 16) for _ in seqs]
    batch = StepBatch(
        seqs, masks, [[-1.0] * args.len for _ in seqs], [(-1.0) ** i for i in range(args.batch)]
    )
    rl_update(model, opt, batch, LossConfig(), grad_clip=1.0, device=args.device)  # warm-up
    _sync(args.device)
    t = time.perf_counter()
    for _ in range(args.steps):
        rl_update(model, opt, batch, LossConfig(), grad_clip=1.0, device=args.device)
    _sync(args.device)
    upd = (time.perf_counter() - t) / args.steps

    async def sample() -> tuple[float, int]:
        eng = LocalEngine(model, max_batch=args.batch, device=args.device, seed=0)
        reqs = [GenerateRequest(input_ids=s[:16], max_new_tokens=args.len - 16) for s in seqs]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(eng.generate(r) for r in reqs))
        _sync(args.device)
        dt = time.perf_counter() - t0
        await eng.close()
        return dt, sum(len(o.output_ids) for o in outs)

    gen_s, gen_tokens = asyncio.run(sample())
    tokens = args.batch * args.len
    print(
        json.dumps(
            {
                "device": args.device,
                "params_m": round(model.num_params() / 1e6, 3),
                "batch": args.batch,
                "len": args.len,
                "update_step_s": round(upd, 4),
                "update_tokens_per_s": round(tokens / upd),
                "sample_s": round(gen_s, 3),
                "sample_tokens_per_s": round(gen_tokens / gen_s),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
