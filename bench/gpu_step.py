"""The RL update and the local engine's generation of a 1.5B Llama on one GPU: tokens/s and MFU.

    python bench/gpu_step.py [--size qwen2.5-1.5b|tiny] [--rows 64] [--len 1024] [--steps 3]

The model is ``LlamaForCausalLM`` built from a ``LlamaConfig`` of Qwen2.5-1.5B's shape (hidden
1536, 28 layers, 12 query and 2 key/value heads, MLP 8960, vocabulary 151936, tied embeddings),
initialised at random: nothing is downloaded. It runs as a kuberl policy (``HFPolicy``) through
the code a cluster trainer runs:

- the update is ``rl_update`` (the GRPO-RoC loss, one optimizer step per batch, pi_old from the
  update's own forward as at asyncLevel 0) on ``--rows`` synthetic rollouts of ``--len`` tokens
  (a quarter prompt), under ``trainer.precision: bf16`` (autocast over float32 master weights,
  AdamW in float32), micro-batches of ``--micro-tokens`` tokens;
- generation is ``LocalEngine`` serving a bf16 copy: ``--gen-rows`` concurrent requests of
  ``--gen-tokens`` new tokens each (no stop token, so every row runs to its budget).

MFU is the model FLOPs (6 N per trained token for the weights, N counting the tied output
layer once, plus 6 L d T for causal attention over a row of T tokens) per second over the
chip's dense bf16 peak (``--peak-tflops``, else looked up by the device's name). ``--size tiny``
is a two-layer model of the same kind that runs on a CPU in seconds (what the tests run).

On the device machine, which reaches no package registry, kuberl's pure-Python dependencies
that its image lacks travel as wheels (bench/README.md, "The RL update on one GPU", has the
commands); it prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass

import torch

# Dense bf16 peak in TFLOP/s by a substring of torch.cuda.get_device_name (vendors' datasheets).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("A100", 312.0),
)

SIZES: dict[str, dict[str, int]] = {
    # Qwen2.5-1.5B's config.json, in Llama's terms (Qwen2 differs only by biases on q/k/v)
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
}


@dataclass(frozen=True)
class GpuStep:
    device: str
    device_name: str
    size: str
    params_b: float
    rows: int
    len: int
    update_step_s: float
    update_tokens_per_s: float
    update_tflops: float
    update_mfu: float | None
    peak_memory_gib: float | None
    gen_rows: int
    gen_tokens: int
    gen_s: float
    gen_tokens_per_s: float


def peak_tflops(device_name: str, override: float | None) -> float | None:
    """The chip's dense bf16 peak: ``override``, else by name, else None (no MFU reported)."""
    if override is not None:
        return override
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def update_flops(params: int, layers: int, hidden: int, rows: int, length: int) -> float:
    """Model FLOPs of one forward and backward over ``rows`` rows of ``length`` tokens."""
    tokens = rows * length
    return 6.0 * params * tokens + 6.0 * layers * hidden * length * tokens


def build_policy(size: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kuberl.trainer.hf import HFPolicy

    cfg = LlamaConfig(**SIZES[size], tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return HFPolicy(model, f"random:{size}"), cfg


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args: argparse.Namespace) -> GpuStep:
    from kuberl.rollout.engine import GenerateRequest
    from kuberl.rollout.local_engine import LocalEngine
    from kuberl.trainer.grpo import StepBatch, rl_update
    from kuberl.trainer.loss import LossConfig
    from kuberl.trainer.precision import compute_in

    device = args.device
    policy, cfg = build_policy(args.size, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompt = args.len // 4
    seqs = torch.randint(0, cfg.vocab_size, (args.rows, args.len), generator=g).tolist()
    masks = [[0] * prompt + [1] * (args.len - prompt) for _ in seqs]
    logprobs = [[-1.0] * args.len for _ in seqs]
    batch = StepBatch(
        seqs, masks, logprobs, [(-1.0) ** i for i in range(args.rows)], behavior_logprobs=logprobs
    )

    def update() -> None:
        with compute_in("bf16", device):
            rl_update(
                policy, opt, batch, LossConfig(), grad_clip=1.0, device=device,
                micro_batch=args.rows, micro_batch_tokens=args.micro_tokens, on_policy=True,
            )  # fmt: skip

    update()  # warm-up: kernels chosen, optimizer state allocated
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        update()
    _sync(device)
    step_s = (time.perf_counter() - t) / args.steps
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    params = policy.num_params()
    flops = update_flops(params, cfg.num_hidden_layers, cfg.hidden_size, args.rows, args.len)
    tflops = flops / step_s / 1e12
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    peak = peak_tflops(name, args.peak_tflops) if device.startswith("cuda") else args.peak_tflops
    opt.state.clear()  # AdamW's moments: the engine's copy needs the memory
    serving = policy.to(torch.bfloat16) if device.startswith("cuda") else policy

    async def generate() -> tuple[float, int]:
        engine = LocalEngine(serving, max_batch=args.gen_rows, device=device, seed=0)
        reqs = [
            GenerateRequest(input_ids=s[:prompt], max_new_tokens=args.gen_tokens)
            for s in seqs[: args.gen_rows]
        ]
        await engine.generate(GenerateRequest(input_ids=seqs[0][:prompt], max_new_tokens=4))  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        _sync(device)
        dt = time.perf_counter() - t0
        await engine.close()
        return dt, sum(len(o.output_ids) for o in outs)

    gen_s, gen_tokens = asyncio.run(generate())
    return GpuStep(
        device=device,
        device_name=name,
        size=args.size,
        params_b=round(params / 1e9, 4),
        rows=args.rows,
        len=args.len,
        update_step_s=round(step_s, 6),
        update_tokens_per_s=round(args.rows * args.len / step_s, 1),
        update_tflops=round(tflops, 3),
        update_mfu=round(tflops / peak, 4) if peak else None,
        peak_memory_gib=round(peak_mem, 2) if peak_mem is not None else None,
        gen_rows=args.gen_rows,
        gen_tokens=gen_tokens,
        gen_s=round(gen_s, 6),
        gen_tokens_per_s=round(gen_tokens / gen_s, 1),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="qwen2.5-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=64, help="rollouts in the update's batch")
    ap.add_argument("--len", type=int, default=1024, help="tokens per rollout (a quarter prompt)")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="tokens per forward/backward")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    ap.add_argument("--gen-rows", type=int, default=64, help="concurrent generation requests")
    ap.add_argument("--gen-tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak")
    args = ap.parse_args(argv)
    for name in ("rows", "len", "micro_tokens", "steps", "gen_rows", "gen_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.len < 4:
        ap.error(f"--len must be >= 4 (a quarter of it is the prompt), got {args.len}")
    print(json.dumps(asdict(measure(args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
