"""Data-parallel training across trainer processes (torchrun ranks), sharded with FSDP2.

On a cluster the operator starts ``torchrun`` in every trainer pod (``NNODES`` pods x
``NPROC_PER_NODE`` accelerators; rank 0's pod is the rendezvous behind the headless Service),
so each process sees ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``. Parameters, gradients and
optimizer state are sharded with ``fully_shard`` (FSDP2): a 14B policy with AdamW needs
~16 bytes per parameter, more than one accelerator holds.

Who does what (one global view of the fleet is what keeps the KV-aware scheduler honest):
rank 0 runs the rollouts, RoC and advantages, then hands every rank an equal share of the
kept rollouts (:func:`split_evenly`); every rank runs forward/backward on its share; the
gradient is the full batch's token-mean gradient because each rank normalizes by the global
token count and scales its loss by the world size, which FSDP's gradient averaging divides
out again (:attr:`DistContext.loss_scale`; gloo has no pre-scaled sum). Collectives need
every rank to run the same number of micro-batches, so a rank with fewer rollouts runs
zero-weight passes (:func:`micro_batch_plan`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistContext:
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if world <= 1 or "RANK" not in env:
            return cls()
        rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", "0") or 0)
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} outside WORLD_SIZE={world}")
        return cls(rank, world, local)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        """Multiply a rank's share of a global-token-mean loss by this (FSDP averages gradients)."""
        return float(self.world_size)

    def device(self, kind: str) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}") if kind == "cuda" else torch.device(kind)

    def init(self, device_kind: str) -> None:
        """Join the process group (env:// rendezvous at MASTER_ADDR:MASTER_PORT)."""
        if not self.enabled or dist.is_initialized():
            return
        if device_kind == "cuda":
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")

    def close(self) -> None:
        """Leave the group. After a successful run call :meth:`leave_together` first: a rank that tears
        gloo down while a peer is still sending aborts the peer (``terminate called without an
        active exception``). After an error do not: the peers may never reach a barrier, and
        tearing down is what makes their pending collectives fail instead of hang."""
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives (no-ops for a single process) ----------------------------------------------

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def leave_together(self, timeout_s: float = 300.0) -> None:
        """Before :meth:`close` after a successful run: wait until every rank is done with its
        collectives. A gloo barrier alone is not enough: a rank returns from it while its last
        message to a peer can still be in flight, and a peer that tears gloo down meanwhile
        aborts it. So after the barrier each rank marks itself done in the rendezvous store (its
        own TCP connection, apart from gloo's) and waits for every rank's mark."""
        if not self.enabled:
            return
        from datetime import timedelta

        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"kuberl/left/{self.rank}", "1")
        store.wait([f"kuberl/left/{r}" for r in range(self.world_size)], timedelta(seconds=timeout_s))

    def broadcast(self, obj: T) -> T:
        """``obj`` from rank 0 to every rank (pickled)."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def scatter(self, parts: Sequence[T] | None) -> T:
        """Rank 0 passes one part per rank; every rank gets its own."""
        if not self.enabled:
            assert parts is not None and len(parts) == 1
            return parts[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, list(parts) if self.is_main and parts is not None else None, src=0)
        return out[0]

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return t.cpu().tolist()


def split_evenly(items: Sequence[T], parts: int, weights: Sequence[int] | None = None) -> list[list[T]]:
    """``items`` in ``parts`` groups of near-equal total weight (default 1 each), order kept within.

    Greedy longest-first onto the lightest group: rollouts vary a lot in length and the step
    waits for the slowest rank, so balancing tokens matters more than balancing counts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    w = list(weights) if weights is not None else [1] * len(items)
    if len(w) != len(items):
        raise ValueError(f"{len(items)} items but {len(w)} weights")
    loads = [0] * parts
    member: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(items)), key=lambda i: (-w[i], i)):
        g = min(range(parts), key=lambda g: (loads[g], len(member[g]), g))
        member[g].append(i)
        loads[g] += w[i]
    return [[items[i] for i in sorted(m)] for m in member]


def micro_batch_plan(local_items: int, micro_batch: int, ctx: DistContext) -> int:
    """How many micro-batches every rank runs: the most any rank needs (at least one)."""
    mine = max(1, -(-local_items // micro_batch))
    return int(ctx.all_reduce([mine], op="max")[0])


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one (builtin GPT or an HF decoder)."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    inner = getattr(model, "hf", model)
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = inner
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    return []


def shard_policy(model: nn.Module, ctx: DistContext, device_type: str = "cpu") -> nn.Module:
    """FSDP2-shard ``model`` in place (each block, then the root); no-op for one process.

    On accelerators the forward/backward runs in bf16 on float32 master weights, gradients
    reduced in float32 (the usual mixed-precision recipe); on CPU (tests) all float32.
    """
    if not ctx.enabled:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if device_type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def load_from_rank0(
    model: nn.Module, full: dict[str, torch.Tensor] | None, ctx: DistContext, device: torch.device
) -> None:
    """Materialize a sharded ``model`` on ``device`` with rank 0's weights: the other ranks built
    it on the meta device and never hold the whole model (a 14B model is 56 GB in float32).

    Call after :func:`shard_policy`, on every rank: rank 0 passes its unsharded state dict on
    the CPU (taken before sharding, so the accelerator never holds a full copy beside the
    shards), the others ``None``. Buffers are broadcast too: non-persistent ones (rotary
    ``inv_freq``) are in no state dict and would stay uninitialised memory.
    """
    if not ctx.enabled:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = [b.detach().clone() for b in model.buffers()] if ctx.is_main else []
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full if ctx.is_main and full is not None else {}, options=options)
    for i, buf in enumerate(model.buffers()):
        if ctx.is_main:
            buf.copy_(buffers[i])
        dist.broadcast(buf, src=0)


def full_state_dict(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU at rank 0 (other ranks get {}); all ranks must call it."""
    if not ctx.enabled:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if ctx.is_main else {}
