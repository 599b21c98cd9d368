"""An HF model loaded once, by rank 0, and sharded to the others (tests only; run under
torch.distributed.run with the model folder as argument).

Rank 1 builds the model on the meta device; after ``shard_policy`` and ``load_from_rank0``
every rank must hold exactly the weights and buffers (the non-persistent rotary ``inv_freq``
included) that ``from_pretrained`` reads, and the sharded forward must give the same logits.
Rank 0 prints the findings as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kuberl.trainer.distributed import DistContext, full_state_dict, load_from_rank0, shard_policy  # noqa: E402
from kuberl.trainer.hf import load_hf_policy, meta_hf_policy  # noqa: E402


def main() -> None:
    path = sys.argv[1]
    ctx = DistContext.from_env()
    ctx.init("cpu")
    ref = load_hf_policy(path)  # what every rank would have read before: the reference
    model = load_hf_policy(path) if ctx.is_main else None
    config = ctx.broadcast(model.hf.config.to_dict() if ctx.is_main else None)
    model = model if ctx.is_main else meta_hf_policy(config, path)
    meta_before = all(p.is_meta for p in model.parameters())
    full = dict(model.state_dict()) if ctx.is_main else None
    shard_policy(model, ctx)
    load_from_rank0(model, full, ctx, torch.device("cpu"))
    ids = torch.randint(0, ref.hf.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(ids)
        want, _ = ref(ids)
    ref_buffers = dict(ref.named_buffers())
    buffer_diff = max(
        (float((b - ref_buffers[n]).abs().max()) for n, b in model.named_buffers()), default=0.0
    )
    worst = ctx.all_reduce([buffer_diff, float((logits - want).abs().max())], op="max")
    metas = ctx.all_reduce([1.0 if meta_before else 0.0], op="sum")
    weights = full_state_dict(model, ctx)
    ctx.barrier()
    if ctx.is_main:
        expect = ref.state_dict()
        print(
            json.dumps(
                {
                    "ranks_built_on_meta": metas[0],
                    "buffers": sum(1 for _ in model.buffers()),
                    "buffer_diff": worst[0],
                    "logits_diff": worst[1],
                    "weights_diff": max(float((weights[k] - v).abs().max()) for k, v in expect.items()),
                    "same_keys": sorted(weights) == sorted(expect),
                }
            )
        )
    ctx.barrier()
    ctx.close()


if __name__ == "__main__":
    main()
    # Skip interpreter finalization: gloo's C++ threads torn down there can abort a rank
    # (std::terminate) after its results are out, which the test would read as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
