"""The trainer's side of announced rollout phases (rollout/phases.py): what it announces before
each phase, and when it says a phase is over."""

from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from kuberl.rollout.phases import (
    PHASE_BURST_FACTOR,
    Phase,
    PhaseAnnouncer,
    measure,
    rollout_gpus,
    workers_for_first_phase,
    workers_for_phase,
)


@dataclass
class _Traj:
    tool_calls: int
    tool_seconds: float


def _announced(job: str, pool: str = "") -> float | None:
    return REGISTRY.get_sample_value("kuberl_rollout_phase_workers", {"job": job, "pool": pool})


def test_a_synchronous_trainer_announces_each_phase_and_releases_it(monkeypatch):
    clock = iter([100.0, 160.0])
    monkeypatch.setattr("kuberl.rollout.phases.time.monotonic", lambda: next(clock))
    ann = PhaseAnnouncer("phases-sync", gpus=64, overlapping=False)
    assert ann.announce() == pytest.approx(2.1 * 64) and _announced("phases-sync") == 135  # the rule
    ann.started()
    phase = ann.done([_Traj(3, 0.6), _Traj(1, 0.2), _Traj(0, 0.0)])  # 60 s, 4 calls of 0.2 s
    assert phase == Phase(4, 60.0, 0.2)
    assert _announced("phases-sync") == 0, "released for the update"
    assert ann.announce() == pytest.approx(PHASE_BURST_FACTOR * 4 * 0.2 / 60.0)
    assert _announced("phases-sync") == 1  # whole workers


def test_an_asynchronous_trainer_never_releases_between_overlapping_phases(monkeypatch):
    clock = iter([0.0, 30.0, 30.0])
    monkeypatch.setattr("kuberl.rollout.phases.time.monotonic", lambda: next(clock))
    ann = PhaseAnnouncer("phases-async", gpus=8, overlapping=True, pool="tools")
    ann.announce()
    ann.started()
    ann.done([_Traj(300, 60.0)])
    assert _announced("phases-async", "tools") == 17, "still the first phase's workers: ceil(2.1 * 8)"
    assert ann.announce() == pytest.approx(PHASE_BURST_FACTOR * 300 * 0.2 / 30.0)


def test_sizing_and_figures():
    assert workers_for_phase(Phase(0, 10.0, 0.2)) == 0 and workers_for_phase(Phase(5, 0.0, 0.2)) == 0
    assert workers_for_first_phase(0) == 1.0
    assert measure([], 5.0) == Phase(0, 5.0, 0.0)
    assert rollout_gpus({}) == 1 and rollout_gpus({"KUBERL_ROLLOUT_GPUS": "64"}) == 64
    with pytest.raises(ValueError, match="KUBERL_ROLLOUT_GPUS must be a number"):
        rollout_gpus({"KUBERL_ROLLOUT_GPUS": "many"})
