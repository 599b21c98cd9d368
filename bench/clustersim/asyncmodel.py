"""The arithmetic of synchronous colocated vs asynchronous split steps (pure; bench/async_sim.py).

Synchronous, colocated (rStar2-Agent, asyncLevel 0): every GPU generates, then every GPU
trains, then the weights are synced; nothing overlaps, so a step is the sum of the three.

Asynchronous (asyncLevel k >= 1): the trainer pods hold T GPUs (``trainer.replicas`` x the
accelerator count, operator/render/job_builder.py) and the RolloutFleet F = G - T engines (one GPU an
engine for a 14B model), separate hardware. The trainer's loop per step (trainer/rl_step.py
``rl_step``): push the weights (blocks the trainer: write, engines read and reload), wait for
the due batch, submit the next k batches, update. The fleet generates meanwhile; each push
pauses it for the engines' reload (a vLLM push with ``mode=wait`` lets running turns end, then
loads). In steady state each side does one batch a step, so

    step = max(update + push, generation + reload)

where ``generation`` is what the fleet needs per batch, from a simulated run of the fleet side
(``SimConfig.ahead``): at asyncLevel 1 a batch alone (batch n+1 is submitted only once batch n
is collected, so it never fills n's tail; batch 0 of any run is alone); at asyncLevel k >= 2
the steady interval between batch ends when batch i is submitted at batch i-k's end and
generates beside batches i-k+1..i-1 (``Scheduler.max_active`` = k batches, FIFO) - the fleet
running ahead across a step, as long as the trainer keeps up (else the step is the trainer's
anyway).
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


def timeline_step(
    generation_s: float,
    update_s: float,
    push_s: float,
    reload_s: float,
    level: int,
    snapshot_s: float | None = None,
    steps: int = 60,
) -> float:
    """Steady step time from the event timeline of ``steps`` steps (trainer/rl_step.py's loop).

    ``snapshot_s`` None: the push in line (the trainer pushes, then collects the due batch,
    submits batch n+k, updates): its steady step is :func:`pipelined_step`. A number: the push on
    a thread (``BackgroundPush``): the trainer copies the weights (``snapshot_s``), collects,
    updates; the push runs from the copy's end, and batch n+k is submitted once both the push
    and the collection are done; the next step waits for the push. The fleet runs batches in
    submission order, each taking ``generation_s`` plus the reload pause of one push.
    """
    if level < 1:
        raise ValueError(f"asyncLevel must be >= 1, got {level}")
    if min(generation_s, update_s, push_s, reload_s, snapshot_s or 0.0) < 0 or steps < 4:
        raise ValueError("phase times must be >= 0 and steps >= 4")
    per_batch = generation_s + reload_s
    done: list[float] = []
    for _ in range(level):  # the stage's first batches: submitted at once, one after another
        done.append((done[-1] if done else 0.0) + per_batch)
    start = [0.0]
    for n in range(steps):
        t = start[-1]
        if snapshot_s is None:
            collected = max(t + push_s, done[n])
            submit = collected
            nxt = collected + update_s
        else:
            pushed = t + snapshot_s + push_s
            collected = max(t + snapshot_s, done[n])
            submit = max(collected, pushed)
            nxt = max(collected + update_s, submit)
        done.append(max(submit, done[-1]) + per_batch)  # batch n + level
        start.append(nxt)
    warm = steps // 2
    return (start[-1] - start[warm]) / (steps - warm)


def bound_side(generation_s: float, update_s: float, push_s: float, reload_s: float) -> str:
    return "trainer" if update_s + push_s >= generation_s + reload_s else "fleet"


def fleet_generation(ends: list[float], level: int) -> float:
    """Generation seconds per batch at asyncLevel ``level`` from the batch collection times of
    a run with ``ahead=level`` (batch 0 submitted at time 0): level 1, batch 0 alone; level >= 2,
    the mean interval between collections after the first (batches 1..k start together at batch
    0's collection, the later ones beside their predecessors, as in steady state)."""
    if level < 1:
        raise ValueError(f"asyncLevel must be >= 1, got {level}")
    if level == 1:
        return ends[0]
    if len(ends) < 3:
        raise ValueError(f"a steady interval needs >= 3 batch ends, got {len(ends)}")
    steady = [b - a for a, b in zip(ends[1:-1], ends[2:], strict=True)]
    return sum(steady) / len(steady)


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
