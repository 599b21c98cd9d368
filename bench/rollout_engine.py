"""Benchmark: LocalEngine decode throughput on the quickstart's rollout shape.

One RL step of the quickstart generates ~256 rollouts of up to 64 tokens with the ~1M-parameter
builtin GPT; this measures tokens/s of LocalEngine's continuous batching for that shape, with the
in-place KV decode path and with the model's own forward (which concatenates the cache on every
step), and with one request at a time for reference. Requests are seeded as the trainer seeds
them (per-request sampling, independent of the batch); the last line times that sampling step
alone against one shared-generator ``torch.multinomial`` over the batch (the batch-dependent
baseline it replaced).

    python bench/rollout_engine.py [--requests 256] [--new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit

import torch

from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.local_engine import LocalEngine, sample_tokens, seeded_uniform
from kuberl.trainer.model import GPT, GPTConfig


async def _run(engine: LocalEngine, reqs: list[GenerateRequest], concurrent: bool) -> tuple[float, int]:
    start = time.perf_counter()
    if concurrent:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    else:
        outs = [await engine.generate(r) for r in reqs]
    return time.perf_counter() - start, sum(len(o.output_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    g = torch.Generator().manual_seed(1)
    reqs = [
        GenerateRequest(
            torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=g).tolist(),
            max_new_tokens=int(torch.randint(args.new_tokens // 2, args.new_tokens + 1, (1,), generator=g)),
            seed=i,
        )
        for i in range(args.requests)
    ]
    print(f"model {model.num_params() / 1e6:.2f}M params, {args.requests} requests, threads={args.threads}")
    cases = [("batched, in-place KV", True, True), ("batched, model forward", False, True)]
    cases.append(("one at a time (first 16)", True, False))
    rates = {}
    for name, fast, concurrent in cases:
        best = None
        for _ in range(args.repeats):
            engine = LocalEngine(model, max_batch=args.requests, seed=0)
            engine.fast_decode = fast and engine.fast_decode
            batch = reqs if concurrent else reqs[:16]
            dt, n = asyncio.run(_run(engine, batch, concurrent))
            best = n / dt if best is None else max(best, n / dt)
        rates[name] = best
        print(f"{name:<28}{best:>10.0f} tok/s")
    fast, plain, one = rates.values()
    print(f"ratio: in-place KV vs model forward {fast / plain:.2f}x, vs one at a time {fast / one:.1f}x")
    per_request, shared = _sampling_ms(args.requests, model.config.vocab_size)
    print(
        f"sampling step, batch {args.requests}: per-request seeded {per_request:.2f} ms, "
        f"shared multinomial {shared:.2f} ms, ratio {per_request / shared:.2f}x"
    )
    return 0


def _sampling_ms(batch: int, vocab: int) -> tuple[float, float]:
    """Milliseconds per sampling step: LocalEngine's per-request draw vs one shared multinomial."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(2)) * 3
    temps, top_p = torch.ones(batch), torch.ones(batch)
    gen = torch.Generator().manual_seed(0)

    def per_request():
        u = torch.tensor([seeded_uniform(k, 7) for k in range(batch)], dtype=torch.float64)
        return sample_tokens(logits, temps, top_p, uniforms=u)

    def shared():
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        return torch.multinomial(probs, 1, generator=gen), torch.log_softmax(logits, dim=-1)

    n = 50
    return tuple(min(timeit.repeat(f, number=n, repeat=5)) / n * 1e3 for f in (per_request, shared))


if __name__ == "__main__":
    raise SystemExit(main())
