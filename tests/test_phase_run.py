"""bench/clustersim/phaserun.py: a run whose phases change, on a fixed and on an autoscaled fleet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from clustersim.asyncmodel import timeline_step  # noqa: E402
from clustersim.phaserun import (  # noqa: E402
    PhaseCosts,
    fit_generation,
    pipeline_ratios,
    play_autoscaled,
    play_fixed,
    play_per_phase,
    step_seconds,
)

from kuberl.api.rollout_fleet import FleetAutoscaling  # noqa: E402


def _rl(name: str, steps: int, work: float, update: float, tail: float = 20.0) -> PhaseCosts:
    """A phase whose batch takes ``tail + work / F`` seconds on F engines."""
    return PhaseCosts(
        name, steps, generation=lambda f: tail + work / f, update_s=update, push_s=10.0, reload_s=5.0,
        snapshot_s=3.0, batch_rollouts=1024, slots_per_engine=100,
    )  # fmt: skip


def test_the_generation_curve_goes_through_simulated_points_and_refuses_too_few():
    gen = fit_generation([(32, 281.0), (40, 244.0), (56, 201.0)])  # bench/README.md's 64-GPU figures
    assert gen(48) == pytest.approx(219.0, abs=2.0)  # the simulated 48 engines: 219 s
    exact = fit_generation([(2, 60.0), (4, 40.0)])  # 20 + 80 / F
    assert exact(8) == pytest.approx(30.0) and exact(1) == pytest.approx(100.0)
    with pytest.raises(ValueError, match=">= 2 simulated fleet sizes"):
        fit_generation([(4, 40.0)])
    with pytest.raises(ValueError, match=">= 1 engine"):
        exact(0)


def test_a_step_and_what_the_trainer_exports_after_it():
    ph = _rl("rl", 10, work=800.0, update=100.0)
    assert step_seconds(ph, 4, 2) == timeline_step(220.0, 100.0, 10.0, 5.0, 2, snapshot_s=3.0)
    step = step_seconds(ph, 4, 2)  # fleet-bound: the trainer waits, the engines never idle
    wait, idle = pipeline_ratios(ph, 4, step)
    assert wait == pytest.approx((step - 103.0) / step) and idle == pytest.approx(max(0.0, step - 225.0) / step)
    step = step_seconds(ph, 40, 2)  # trainer-bound: 40 engines idle most of the step
    wait, idle = pipeline_ratios(ph, 40, step)
    assert wait < 0.15 and idle == pytest.approx((step - 45.0) / step)


def test_a_fixed_fleet_holds_its_engines_through_sft_and_every_phase():
    phases = [PhaseCosts("sft", hours=2.0), _rl("light", 100, 400.0, 60.0), _rl("heavy", 100, 1600.0, 120.0)]
    r = play_fixed(phases, trainer_gpus=8, engines=6, level=2)
    rl_s = 100 * step_seconds(phases[1], 6, 2) + 100 * step_seconds(phases[2], 6, 2)
    assert r.hours == pytest.approx(2.0 + rl_s / 3600.0) and r.rl_steps == 200
    assert r.gpu_hours == pytest.approx(14 * r.hours)
    assert r.steps_per_hour == pytest.approx(200 / r.hours)


def test_the_autoscaled_fleet_parks_during_sft_grows_for_rl_and_follows_each_phase():
    # balanced near 4 engines (light) and 12 (heavy) of 16
    phases = [PhaseCosts("sft", hours=2.0), _rl("light", 100, 160.0, 60.0), _rl("heavy", 100, 1200.0, 120.0)]
    auto = FleetAutoscaling(minReplicas=1, maxReplicas=16)
    r = play_autoscaled(phases, 8, auto, 2, startup_s=120.0)
    sft, light, heavy = r.phases
    assert sft["engines_mean"] == pytest.approx(1.0)  # the minimum, from the start
    # the heavy phase needs more engines than the light one, and neither holds the maximum
    assert light["engines_mean"] < heavy["engines_mean"] < 16
    best = max((play_fixed(phases, 8, f, 2) for f in range(1, 17)), key=lambda x: x.steps_per_hour)
    assert r.steps_per_hour >= 0.9 * best.steps_per_hour and r.gpu_hours < best.gpu_hours
    # without the trainer's ratios, saturated KV caches and the batches ahead hold it at the maximum
    blind = play_autoscaled(phases, 8, auto, 2, startup_s=120.0, pipeline=False)
    assert blind.phases[2]["engines_mean"] > 15 and blind.gpu_hours > r.gpu_hours
    assert [h for h, _ in r.engines_over_time] == sorted(h for h, _ in r.engines_over_time)


def test_the_per_phase_floor_holds_each_phases_smallest_near_fastest_fleet_and_bounds_the_autoscaler():
    phases = [PhaseCosts("sft", hours=2.0), _rl("light", 100, 160.0, 60.0), _rl("heavy", 100, 1200.0, 120.0)]
    floor = play_per_phase(phases, 8, 16, 2)
    sft, light, heavy = (p["engines_mean"] for p in floor.phases)
    assert sft == 1.0 and light < heavy <= 16
    for ph, engines in ((phases[1], light), (phases[2], heavy)):
        fastest = min(step_seconds(ph, f, 2) for f in range(1, 17))
        assert step_seconds(ph, int(engines), 2) <= 1.01 * fastest  # near the fastest ...
        assert step_seconds(ph, int(engines) - 1, 2) > 1.01 * fastest  # ... and the smallest such
    rl_s = 100 * step_seconds(phases[1], int(light), 2) + 100 * step_seconds(phases[2], int(heavy), 2)
    assert floor.hours == pytest.approx(2.0 + rl_s / 3600.0)
    assert floor.gpu_hours == pytest.approx(2.0 * 9 + sum(
        100 * step_seconds(ph, int(e), 2) / 3600.0 * (8 + e) for ph, e in ((phases[1], light), (phases[2], heavy))))
    # the autoscaler measures a phase before it knows it and waits for engines: never under the floor
    scaled = play_autoscaled(phases, 8, FleetAutoscaling(minReplicas=1, maxReplicas=16), 2, startup_s=120.0)
    assert scaled.gpu_hours >= floor.gpu_hours
