"""bench/async_sim.py: the arithmetic of synchronous vs asynchronous steps, split feasibility and
the fleet side of asynchronous RL in the simulation, on tiny configurations (virtual time: simulated seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import async_sim  # noqa: E402
from clustersim.asyncmodel import (  # noqa: E402
    GpuSpec,
    TrainingMemory,
    bound_side,
    fleet_generation,
    ideal_ratio,
    max_staleness,
    pipelined_step,
    split_refusal,
    steps_per_hour,
    sync_step,
    timeline_step,
)
from clustersim.step import SimConfig, simulate  # noqa: E402
from clustersim.workload import WorkloadSpec, make_plans  # noqa: E402


def test_sync_step_is_the_sum_of_its_phases() -> None:
    assert sync_step(190.0, 90.0, 35.0) == 315.0
    assert steps_per_hour(360.0) == 10.0


def test_pipelined_step_is_the_slower_side() -> None:
    # fleet-bound: generation + one reload pause; the update and its push hide behind it
    assert pipelined_step(100.0, 30.0, 35.0, 5.0) == 105.0
    assert bound_side(100.0, 30.0, 35.0, 5.0) == "fleet"
    # trainer-bound: the push does not overlap the trainer's own update
    assert pipelined_step(50.0, 80.0, 35.0, 5.0) == 115.0
    assert bound_side(50.0, 80.0, 35.0, 5.0) == "trainer"
    # never worse than the colocated sum of the same phase times, never better than the longest
    g, u, p, r = 120.0, 60.0, 35.0, 5.0
    assert max(g, u) < pipelined_step(g, u, p, r) < sync_step(g, u, p)
    with pytest.raises(ValueError, match=">= 0"):
        pipelined_step(-1.0, 1.0, 1.0, 1.0)


def test_the_timeline_of_an_in_line_push_is_the_closed_form_and_a_background_push_never_slower() -> None:
    """The step loop played out event by event: with the push in line its steady step is
    :func:`pipelined_step`; with the push on a thread (``BackgroundPush``) never longer, and
    trainer-bound it is the weights' copy plus the update."""
    for g in (20.0, 50.0, 100.0, 150.0, 250.0):
        for u in (10.0, 30.0, 80.0, 186.0):
            for k in (1, 2, 3):
                inline = timeline_step(g, u, 35.0, 5.0, k)
                assert inline == pytest.approx(pipelined_step(g, u, 35.0, 5.0)), (g, u, k)
                bg = timeline_step(g, u, 35.0, 5.0, k, snapshot_s=3.0)
                assert max(g + 5.0, 3.0 + u) - 1e-9 <= bg <= inline + 1e-9, (g, u, k, bg, inline)
    assert timeline_step(150.0, 186.0, 35.0, 5.0, 2, snapshot_s=3.0) == pytest.approx(189.0)
    # level 1, fleet short: the batch ahead waits for the push, so push + generation can bind
    assert timeline_step(50.0, 80.0, 35.0, 5.0, 1, snapshot_s=3.0) > timeline_step(
        50.0, 80.0, 35.0, 5.0, 2, snapshot_s=3.0
    )
    with pytest.raises(ValueError, match="asyncLevel"):
        timeline_step(1.0, 1.0, 1.0, 1.0, 0)


def test_ideal_ratio_is_the_sync_share_removed() -> None:
    # rollout 100, update 50, sync 30: best split F/T = 2, step 150 instead of 180
    assert ideal_ratio(100.0, 50.0, 30.0) == pytest.approx(1.2)
    assert max_staleness(2) == 2
    with pytest.raises(ValueError, match="asyncLevel"):
        max_staleness(-1)


def test_split_feasibility_checks_the_trainers_memory() -> None:
    mem, gpu = TrainingMemory(params=14.8e9), GpuSpec(memory_gb=192.0)
    # 16 bytes a parameter sharded over T, plus 40 GB a GPU
    assert mem.per_gpu_gb(4) == pytest.approx(14.8e9 * 16 / 4 / 1e9 + 40.0)
    assert split_refusal(64, 56, mem, gpu) is None  # 8 trainer GPUs: 70 GB each
    assert split_refusal(8, 6, mem, gpu) is None  # 2 GPUs: 158 GB
    why = split_refusal(8, 7, mem, gpu)
    assert why is not None and "277 GB per GPU on 1 GPUs" in why
    assert "no GPU left for the trainer" in (split_refusal(8, 8, mem, gpu) or "")
    assert "no GPU left for the fleet" in (split_refusal(8, 0, mem, gpu) or "")
    with pytest.raises(ValueError, match="trainer GPUs"):
        mem.per_gpu_gb(0)


def test_split_parsing() -> None:
    assert async_sim.default_splits(64) == "32/32,40/24,48/16,56/8"
    assert async_sim.parse_splits("48/16, 56/8", 64) == [(48, 16), (56, 8)]
    with pytest.raises(ValueError, match="!= --gpus 64"):
        async_sim.parse_splits("48/8", 64)
    with pytest.raises(ValueError, match="ENGINES/TRAINER"):
        async_sim.parse_splits("48", 64)


SPEC = WorkloadSpec(prompts=4, rollouts_per_prompt=8, max_turns=4, max_response_tokens=2048)


def _cfg(**kw) -> SimConfig:
    base = {"workload": SPEC, "engines": 2, "pool_replicas": 1, "workers_per_pod": 4}
    return SimConfig(**(base | kw))


def test_fleet_run_submits_as_the_trainer_and_runs_k_batches_at_once() -> None:
    plans = [make_plans(SPEC, s) for s in range(4)]
    alone = simulate(_cfg(steps=1, plans=plans[:1]))
    res = simulate(_cfg(steps=4, plans=plans, ahead=2))
    st = res.steps
    ends = [r.end - st[0].start for r in st]  # collected in order
    assert ends == sorted(ends) and all(r.end >= r.rollouts_done for r in st)
    # asyncLevel 2's submissions: batch 0 at once, batches 1 and 2 once it is collected, batch 3
    # once batch 1 is
    assert [r.start for r in st] == [st[0].start, st[0].end, st[0].end, st[1].end]
    # batch 0 runs alone: asyncLevel 1's generation time is a synchronous rollout phase
    assert ends[0] == pytest.approx(alone.steps[0].rollout_s, rel=1e-9)
    # the later batches generate beside their predecessor: they end sooner after it than a
    # batch takes alone (asyncLevel 2's generation time)
    assert fleet_generation(ends, 2) < 0.9 * ends[0]
    # two batches' rollouts on the engines at once, never more (Scheduler.max_active)
    assert SPEC.rollouts < max(s["rollouts_active"] for s in res.timeline) <= 2 * SPEC.rollouts
    assert sum(r.calls for r in st) == sum(len(p.tool_costs) for b in plans for p in b)
    # asyncLevel 1: every batch alone, back to back
    seq = simulate(_cfg(steps=2, plans=plans[:2], ahead=1)).steps
    assert seq[1].start == seq[0].rollouts_done


def test_fleet_generation_per_level() -> None:
    ends = [100.0, 190.0, 250.0, 320.0]
    assert fleet_generation(ends, 1) == 100.0  # batch 0, alone
    assert fleet_generation(ends, 2) == pytest.approx(65.0)  # (60 + 70) / 2: the first interval skipped
    with pytest.raises(ValueError, match=">= 3 batch ends"):
        fleet_generation(ends[:2], 2)
    with pytest.raises(ValueError, match="asyncLevel"):
        fleet_generation(ends, 0)


def test_main_prints_refusals_and_the_best_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "4", "--prompts", "2", "--splits", "2/2,3/1", "--batches", "3", "--sync-steps", "1"]
    assert async_sim.main(argv) == 0
    out = capsys.readouterr().out
    assert "3/1    refused: training state needs" in out
    assert "asyncLevel 1: best split 2 engines / 2 trainer GPUs" in out
    assert "staleness <= 2" in out
