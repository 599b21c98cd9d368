"""The arithmetic of synchronous colocated vs asynchronous split steps (pure; bench/async_sim.py).

Synchronous, colocated (rStar2-Agent, asyncLevel 0): every GPU generates, then every GPU
trains, then the weights are synced; nothing overlaps, so a step is the sum of the three.

Asynchronous (asyncLevel k >= 1): the trainer pods hold T GPUs (``trainer.replicas`` x the
accelerator count, operator/job_builder.py) and the RolloutFleet F = G - T engines (one GPU an
engine for a 14B model), separate hardware. The trainer's loop per step (trainer/rl_stage.py
``_rl_step``): push the weights (blocks the trainer: write, engines read and reload), wait for
the due batch, submit the next k batches, update. The fleet generates meanwhile; each push
pauses it for the engines' reload (a vLLM push with ``mode=wait`` lets running turns end, then
loads). In steady state each side does one batch a step, so

    step = max(update + push, generation + reload)

where ``generation`` is what the fleet needs per batch: at asyncLevel 1 an isolated batch's
whole rollout phase (batch n+1 is submitted only once batch n is in hand, so it never fills
n's tail); at asyncLevel >= 2 the interval between batches of a stream in which each batch
fills the tail of the one before (``Scheduler.max_active`` = one batch, FIFO): batch n+2 is
submitted when batch n is collected, exactly when the first place for it frees, so the fleet
never idles in the tail while the trainer keeps up. More than 2 adds nothing to the fleet
side under that cap; it only buffers trainer jitter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    memory_gb: float = 192.0  # MI300X HBM3


@dataclass(frozen=True)
class TrainingMemory:
    """A training state sharded over the trainer's GPUs (FSDP2, docs/cluster.md: bf16 compute).

    ``state_bytes_per_param``: float32 parameters (4), float32 gradients (4) and AdamW's two
    float32 moments (8), all sharded; ``reserve_gb`` per GPU: activations of a micro-batch with
    checkpointing, the gathered bf16 layers and allocator slack (an assumption, not measured).
    """

    params: float = 14.8e9
    state_bytes_per_param: float = 16.0
    reserve_gb: float = 40.0

    def per_gpu_gb(self, gpus: int) -> float:
        if gpus < 1:
            raise ValueError(f"trainer GPUs must be >= 1, got {gpus}")
        return self.params * self.state_bytes_per_param / gpus / 1e9 + self.reserve_gb


def split_refusal(total: int, fleet: int, mem: TrainingMemory, gpu: GpuSpec) -> str | None:
    """Why ``fleet`` engine GPUs + ``total - fleet`` trainer GPUs cannot run, or None if they can."""
    trainer = total - fleet
    if fleet < 1:
        return f"no GPU left for the fleet ({fleet} engines of {total} GPUs)"
    if trainer < 1:
        return f"no GPU left for the trainer ({fleet} engines of {total} GPUs)"
    need = mem.per_gpu_gb(trainer)
    if need > gpu.memory_gb:
        return (
            f"training state needs {need:.0f} GB per GPU on {trainer} GPUs "
            f"(> {gpu.memory_gb:.0f} GB): give the trainer more GPUs"
        )
    return None


def sync_step(rollout_s: float, update_s: float, sync_s: float) -> float:
    """Colocated synchronous step: generation, then update, then weight sync, back to back."""
    return rollout_s + update_s + sync_s


def pipelined_step(generation_s: float, update_s: float, push_s: float, reload_s: float) -> float:
    """Asynchronous step in steady state: the slower of the trainer (update, then the push it
    waits for) and the fleet (one batch's generation plus the reload pause of one push)."""
    if min(generation_s, update_s, push_s, reload_s) < 0:
        raise ValueError("phase times must be >= 0")
    return max(update_s + push_s, generation_s + reload_s)


def bound_side(generation_s: float, update_s: float, push_s: float, reload_s: float) -> str:
    return "trainer" if update_s + push_s >= generation_s + reload_s else "fleet"


def steps_per_hour(step_s: float) -> float:
    return 3600.0 / step_s


def ideal_ratio(rollout_s: float, update_s: float, sync_s: float) -> float:
    """Best speed-up over the colocated synchronous step if both phases scaled linearly with
    their GPUs, overlapped perfectly and the sync cost nothing: with F/T = rollout/update,
    max(rollout * G/F, update * G/T) = rollout + update, so (rollout + update + sync) / (rollout
    + update). Colocation already keeps every GPU busy in both phases; a split can still beat
    this when the fleet's rollout phase scales better than linearly (its tail of long
    multi-turn rollouts costs fewer idle GPUs on a smaller fleet)."""
    return sync_step(rollout_s, update_s, sync_s) / (rollout_s + update_s)


def max_staleness(level: int) -> int:
    """Rollouts trained at step n were sampled by versions n-k..n-1 (docs/cluster.md): at most k."""
    if level < 0:
        raise ValueError(f"asyncLevel must be >= 0, got {level}")
    return level
