"""Rollout phases announced ahead, for the SandboxPool's autoscaler.

A synchronous RL step's tool calls come in one burst: tens of thousands within a rollout phase
of a few minutes, none during the update. A pool that scales on its own queue meets the burst
with the pods it had (new ones start after it began, and the calls already queued stay where
they are). The trainer knows what is coming, so it says
so before each phase: ``kuberl_rollout_phase_workers{job}``, the sandbox workers the phase asks
for, set when the weight push before the phase starts (the push takes longer than a pod's
start-up) and back to 0 once the phase's rollouts are in. The operator keeps the pool at least
that large meanwhile (``operator.decide.autoscale``), and lets it shrink for the update.

How many workers (pure functions, shared with bench/cluster_sim.py):

* a phase measured before, :func:`workers_for_phase`: its average demand (tool calls x mean
  call seconds / phase seconds) times :data:`PHASE_BURST_FACTOR`, since calls come in bursts
  and a p99 of 1 s needs room for them;
* the first phase, which nothing has measured, :func:`workers_for_first_phase`: the per-GPU
  sizing rule of docs/cluster.md for heavy numeric tool code.

With batches ahead (asyncLevel > 0) phases overlap: the gauge follows the measured demand and
never drops to 0 between steps.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Gauge

from kuberl.util.envvars import env_number

PHASE_BURST_FACTOR = 5.0
"""Workers over a phase's average demand: calls come in bursts, and the pool must hold a mean
call latency of 0.3 s and a p99 of 1 s through them (bench/cluster_sim.py sizes it)."""
FIRST_PHASE_CORES_PER_GPU = 2.1
"""docs/cluster.md's sizing rule for heavy numeric tool code (light code needs ~1.1)."""

PHASE_WORKERS = Gauge(
    "kuberl_rollout_phase_workers",
    "Sandbox workers the trainer's next or current rollout phase asks for (0 between phases), "
    "by the SandboxPool its calls go to",
    ["job", "pool"],
)


@dataclass(frozen=True)
class Phase:
    """What one rollout phase asked of the sandbox."""

    tool_calls: float  # calls made
    seconds: float  # how long the phase lasted
    call_seconds: float  # how long a call took, on average (execution and round trip)


def workers_for_phase(phase: Phase, burst: float = PHASE_BURST_FACTOR) -> float:
    """Workers a phase like ``phase`` asks for (0 for one without calls or not measured)."""
    if phase.tool_calls <= 0 or phase.seconds <= 0 or phase.call_seconds <= 0:
        return 0.0
    return burst * phase.tool_calls * phase.call_seconds / phase.seconds


def workers_for_first_phase(gpus: int, cores_per_gpu: float = FIRST_PHASE_CORES_PER_GPU) -> float:
    """Workers for a job's first phase, one per core of the sizing rule (at least one)."""
    return max(1.0, cores_per_gpu * gpus)


def rollout_gpus(env: dict[str, str] | None = None) -> int:
    """The accelerators of the fleet a trainer rolls out on (``KUBERL_ROLLOUT_GPUS``, which the
    operator sets from the RolloutFleet's spec), for the first phase's sizing; 1 where unset."""
    return max(1, int(env_number("KUBERL_ROLLOUT_GPUS", 1.0, dict(os.environ if env is None else env))))


def measure(trajectories: Iterable[object], seconds: float) -> Phase:
    """A phase's figures from its rollouts (``tool_calls``, ``tool_seconds`` each)."""
    calls = waited = 0.0
    for t in trajectories:
        calls += getattr(t, "tool_calls", 0)
        waited += getattr(t, "tool_seconds", 0.0)
    # a rollout's tool_seconds is its turns' waits; a turn's calls run together, so this is at
    # least each call's own time on average
    return Phase(calls, seconds, waited / calls if calls else 0.0)


class PhaseAnnouncer:
    """The trainer's side: announce before a phase, report it done after (rank 0)."""

    def __init__(self, job: str, gpus: int, *, overlapping: bool, pool: str = ""):
        self.job = job
        self.pool = pool  # the SandboxPool's name on a cluster (KEDA's query selects by it)
        self.gpus = max(1, gpus)
        self.overlapping = overlapping  # asyncLevel > 0: phases overlap, never announce 0
        self.last: Phase | None = None
        self._started: float | None = None

    def announce(self) -> float:
        """The next phase is about to start: set the workers it asks for."""
        workers = workers_for_first_phase(self.gpus) if self.last is None else workers_for_phase(self.last)
        PHASE_WORKERS.labels(self.job, self.pool).set(math.ceil(workers))
        return workers

    def started(self) -> None:
        self._started = time.monotonic()

    def done(self, trajectories: Iterable[object]) -> Phase:
        """The phase's rollouts are in: remember what it asked, and release the pool."""
        seconds = time.monotonic() - self._started if self._started is not None else 0.0
        self.last = measure(trajectories, seconds)
        self._started = time.monotonic() if self.overlapping else None
        if not self.overlapping:
            PHASE_WORKERS.labels(self.job, self.pool).set(0)
        return self.last
