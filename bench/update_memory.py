"""Peak memory and time of one RL update of SmolLM2-135M on a peers-like batch, before vs after
the trainer-side fixes of issue 17 (bench/README.md, "Side by side with TRL").

    python bench/update_memory.py [--model DIR] [--rows 8] [--len 300] [--paths old,new,bounded]
                                  [--micro-tokens 1024] [--threads 2]

Every path runs in its own process, so each peak is its own: load the float32 policy, create
AdamW's state (one step on zero gradients: the weights do not move, the 2 x 540 MB of moments
exist as in a running job), reset the process's peak RSS (``/proc/self/clear_refs``), then time
one RL update as ``stages`` runs it (pi_old, then ``rl_update``) on ``--rows`` synthetic
rollouts of about ``--len`` tokens (a 100-token prompt, the rest trained), in wall and CPU
seconds (on a shared machine the CPU time is the steadier figure). Paths:

* ``old``: pi_old by a separate forward (``recompute_old_logprobs``), HF forwards build a KV
  cache - the code as the TRL side-by-side measured it
* ``on-policy``: pi_old from the update's own forward, forwards still build the cache
* ``new``: the current defaults (on-policy, no KV cache in training forwards)
* ``bounded``: ``new`` with ``trainer.microBatchTokens`` = ``--micro-tokens``
* ``bf16``, ``bounded-bf16``: ``new`` and ``bounded`` with ``trainer.precision: bf16`` (autocast
  over the float32 weights; the loss and gradient norm then agree to bf16's resolution only)

A path may be named more than once (``--paths new,bf16,new,bf16``): each run is its own process.

The loss and gradient norm must agree between paths (the same weights, the same batch): the
changes are about memory and time, not about what is trained. Prints one JSON line per path,
then a table. Needs the model folder (``kuberl models prepare smollm2-135m-instruct DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/kuberl/models/hf/smollm2-135m-instruct"
PATHS = {
    "old": {"on_policy": False, "kv_cache": True, "bounded": False, "precision": "float32"},
    "on-policy": {"on_policy": True, "kv_cache": True, "bounded": False, "precision": "float32"},
    "new": {"on_policy": True, "kv_cache": False, "bounded": False, "precision": "float32"},
    "bounded": {"on_policy": True, "kv_cache": False, "bounded": True, "precision": "float32"},
    "bf16": {"on_policy": True, "kv_cache": False, "bounded": False, "precision": "bf16"},
    "bounded-bf16": {"on_policy": True, "kv_cache": False, "bounded": True, "precision": "bf16"},
}


def _mb(field: str) -> float:
    """A /proc/self/status field (VmRSS, VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0):
    """``rows`` rollouts of ``length`` +- 20 % tokens, a 100-token prompt and one 20-token tool
    response (loss mask 0) in the response; engine log-probs near what a 135M model gives."""
    import random

    from kuberl.trainer.grpo import StepBatch

    rng = random.Random(seed)
    b = StepBatch()
    for i in range(rows):
        n = max(130, round(length * rng.uniform(0.8, 1.2)))
        b.seqs.append([rng.randrange(vocab) for _ in range(n)])
        mask = [0] * 100 + [1] * (n - 100)
        mask[100 + (n - 100) // 2 : 120 + (n - 100) // 2] = [0] * 20
        b.masks.append(mask)
        b.old_logprobs.append([0.0] + [-rng.uniform(0.5, 12.0) * m for m in mask[1:]])
        b.behavior_logprobs.append(list(b.old_logprobs[-1]))
        b.advantages.append(1.0 if i % 2 else -1.0)
        b.engines.append("engine-0")
        b.fresh.append(True)
    return b


def child(path: str, model_dir: str, rows: int, length: int, threads: int, micro_tokens: int) -> dict:
    import torch
    from torch import nn

    from kuberl.trainer.grpo import recompute_old_logprobs, rl_update
    from kuberl.trainer.hf import load_hf_policy
    from kuberl.trainer.loss import LossConfig
    from kuberl.trainer.precision import compute_in

    torch.set_num_threads(threads)
    knobs = PATHS[path]
    bound = micro_tokens if knobs["bounded"] else None
    policy = load_hf_policy(model_dir)
    model: nn.Module = policy

    if knobs["kv_cache"]:

        class WithCache(nn.Module):
            """The policy as it was: every forward builds HF's KV cache."""

            def __init__(self, inner: nn.Module):
                super().__init__()
                self.inner = inner

            def forward(self, *args, use_cache: bool = True, **kw):
                logits, present = self.inner(*args, use_cache=True, **kw)
                return logits, present if use_cache else None

        model = WithCache(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0)
    for p in model.parameters():  # AdamW's state, without moving the weights
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = synthetic_batch(rows, length, policy.hf.get_input_embeddings().num_embeddings)
    rss0 = _mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    t0, c0 = time.perf_counter(), time.process_time()
    gap = None
    with compute_in(knobs["precision"], "cpu"):
        if not knobs["on_policy"]:
            gap = recompute_old_logprobs(model, batch, micro_batch_tokens=bound)
    t1, c1 = time.perf_counter(), time.process_time()
    with compute_in(knobs["precision"], "cpu"):
        st = rl_update(
            model, opt, batch, LossConfig(0.2, 0.28), grad_clip=1.0, on_policy=knobs["on_policy"],
            micro_batch_tokens=bound,
        )  # fmt: skip
    t2, c2 = time.perf_counter(), time.process_time()
    gap = st.pop("rollout_logprob_gap", gap)
    return {
        "path": path,
        **knobs,
        "micro_batch_tokens": bound,
        "rows": rows,
        "tokens": sum(len(s) for s in batch.seqs),
        "trained_tokens": st["tokens"],
        "rss_before_mb": round(rss0),
        "peak_rss_mb": round(_mb("VmHWM")),
        "peak_over_before_mb": round(_mb("VmHWM") - rss0),
        "pi_old_s": round(t1 - t0, 2),
        "update_s": round(t2 - t1, 2),
        "total_s": round(t2 - t0, 2),
        # CPU seconds of all the process's threads: less at the mercy of other processes' load
        "pi_old_cpu_s": round(c1 - c0, 2),
        "update_cpu_s": round(c2 - c1, 2),
        "total_cpu_s": round(c2 - c0, 2),
        "loss": st["loss"],
        "grad_norm": st["grad_norm"],
        "rollout_logprob_gap": gap,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=300)
    ap.add_argument("--paths", default="old,new,bounded", help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--micro-tokens", type=int, default=1024, help="trainer.microBatchTokens of path bounded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.rows, args.len, args.threads, args.micro_tokens)))
        return 0
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(
            f"no HF model folder at {args.model}: run `kuberl models prepare smollm2-135m-instruct "
            f"{args.model}` or pass --model"
        )
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown --paths {unknown}; choose from {list(PATHS)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}", flush=True)
    results = []
    for path in paths:
        cmd = [sys.executable, __file__, "--child", path, "--model", args.model, "--rows", str(args.rows),
               "--len", str(args.len), "--threads", str(args.threads), "--micro-tokens", str(args.micro_tokens)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"path {path} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(f"# done, load {os.getloadavg()}")
    cols = ("path", "precision", "peak_rss_mb", "peak_over_before_mb", "total_s", "pi_old_cpu_s", "total_cpu_s", "loss", "grad_norm")
    print(" ".join(f"{c:>19}" for c in cols))
    for r in results:
        print(" ".join(f"{r[c]:>19.6g}" if isinstance(r[c], float) else f"{r[c]:>19}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
