"""bench/clustersim: the workload generator, the trainer model and the virtual-time loop on tiny configs.

No timings: everything runs on a virtual clock, so the numbers asserted are simulated seconds.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from clustersim.control import PoolController  # noqa: E402
from clustersim.pods import Service  # noqa: E402
from clustersim.step import SimConfig, StepRecord, simulate  # noqa: E402
from clustersim.workload import (  # noqa: E402
    STRESS_TOOL_MIX,
    ToolClass,
    TrainerModel,
    WorkloadSpec,
    decode_cost,
    encode_call,
    make_plans,
    sample_tool_costs,
    trained_tokens,
)
from rollout_sim import run_virtual  # noqa: E402

from kuberl.api.sandbox_pool import SandboxAutoscaling, SandboxLimits  # noqa: E402
from kuberl.operator.decide.autoscale import phase_floor  # noqa: E402
from kuberl.rollout.phases import PHASE_BURST_FACTOR, Phase, workers_for_first_phase, workers_for_phase  # noqa: E402
from kuberl.sandbox.config import ServiceConfig  # noqa: E402
from kuberl.sandbox.service.client import SandboxClient  # noqa: E402

TINY = WorkloadSpec(prompts=2, rollouts_per_prompt=4, max_turns=4, max_response_tokens=2048)


def test_plans_are_seeded_and_respect_the_stage_limits() -> None:
    spec = WorkloadSpec(prompts=40, rollouts_per_prompt=32)
    plans = make_plans(spec, seed=1)
    assert plans == make_plans(spec, seed=1)
    assert plans != make_plans(spec, seed=2)
    assert len(plans) == 40 * 32
    for p in plans:
        assert 1 <= len(p.turns) <= spec.max_turns
        assert len(p.tool_costs) == len(p.tool_tokens) == len(p.turns) - 1
        assert p.response_tokens <= spec.max_response_tokens
        assert all(0 < c <= spec.tool_timeout_s for c in p.tool_costs)
    # the defaults give the paper's ~45K calls for 16,384 rollouts (2.75 a rollout)
    calls = sum(len(p.tool_costs) for p in plans) / len(plans)
    assert 2.5 < calls < 3.1


def test_tool_mix_shares_and_deadline() -> None:
    rng = np.random.default_rng(0)
    mix = (ToolClass("fast", 0.75, 0.01, 0.0), ToolClass("stuck", 0.25, math.inf, 0.0))
    costs = sample_tool_costs(mix, 20_000, 7.0, rng)
    assert set(np.unique(costs)) == {0.01, 7.0}
    assert abs((costs == 7.0).mean() - 0.25) < 0.02
    stress = sample_tool_costs(STRESS_TOOL_MIX, 50_000, 10.0, rng)
    assert 0.15 < stress.mean() < 0.23  # about two thirds of the paper's 0.3 s
    assert np.quantile(stress, 0.99) < 1.0


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        WorkloadSpec(tool_mix=(ToolClass("a", 0.5, 0.01, 0.1),))
    with pytest.raises(ValueError, match="continue_prob"):
        WorkloadSpec(continue_prob=1.0)
    with pytest.raises(ValueError, match="not a simulated tool call"):
        decode_cost("print(1)")


def test_call_encoding_round_trips() -> None:
    for cost in (0.0076, 1e-9, 10.0, 0.1 + 0.2):
        assert decode_cost(encode_call(cost)) == cost


def test_trainer_model_scales_with_tokens_and_gpus() -> None:
    m = TrainerModel()
    assert m.update_seconds(2e6) == pytest.approx(2 * m.update_seconds(1e6))
    assert TrainerModel(gpus=32).update_seconds(1e6) == pytest.approx(2 * m.update_seconds(1e6))
    # 8 FLOPs/param/token: 14.8e9 * 8 * 1e6 / (64 * 1.307e15 * 0.35)
    assert m.update_seconds(1e6) == pytest.approx(14.8e9 * 8e6 / (64 * 1.307e15 * 0.35))
    assert m.sync_seconds() == pytest.approx(2 * 14.8e9 * 2 / 2e9 + 5)
    plans = make_plans(TINY, 0)
    total = sum(p.prompt + p.response_tokens for p in plans)
    assert trained_tokens(plans, TINY, 2) == pytest.approx(total / 2)


def _tiny_cfg(**kw) -> SimConfig:
    base = dict(workload=TINY, steps=2, engines=2, pool_replicas=1, workers_per_pod=2, sample_s=1.0)
    base.update(kw)
    return SimConfig(**base)


def test_event_loop_answers_every_call_deterministically() -> None:
    cfg = _tiny_cfg()
    a, b = simulate(cfg), simulate(cfg)
    expected = [sum(len(p.tool_costs) for p in make_plans(TINY, s)) for s in range(2)]
    assert [st.calls for st in a.steps] == expected
    assert [st.failed_calls for st in a.steps] == [0, 0]
    for x, y in zip(a.steps, b.steps, strict=True):
        assert np.array_equal(x.latency, y.latency) and x.end == y.end
    for st in a.steps:
        # a call takes at least its execution plus one round trip
        assert np.all(st.latency >= st.costs + cfg.rtt_s - 1e-9)
        assert st.start < st.rollouts_done < st.end
        assert st.end - st.rollouts_done == pytest.approx(st.update_s + st.sync_s)
        assert st.critical["generation"] > 0
    assert a.steps[1].start == pytest.approx(a.steps[0].end)
    assert a.attempts == sum(st.calls for st in a.steps)  # nothing was refused: no retries


def _burst(n: int, cost: float, over_s: float = 0.0) -> StepRecord:
    """``n`` calls of ``cost`` seconds, dispatched evenly over ``over_s`` seconds."""
    rec = StepRecord(start=0.0, rollouts_done=max(1.0, over_s), update_s=1.0, sync_s=0.0)
    rec.dispatch, rec.costs = np.linspace(0.0, over_s, n), np.full(n, cost)
    rec.critical = rec.mean_rollout = {"wait_for_engine": 0.0, "generation": 0.0, "tools": 0.0}
    return rec


def test_full_queues_answer_429_and_the_client_retries() -> None:
    res = simulate(_tiny_cfg(replay=[_burst(40, 0.05)], queue_limit=4, workers_per_pod=1))
    st = res.steps[0]
    assert st.calls == 40 and st.failed_calls == 0
    assert res.statuses["429"] > 0 and res.attempts == 40 + res.statuses["429"]
    # one worker runs the 40 calls back to back
    assert st.latency.max() >= 40 * 0.05


def test_autoscaler_follows_a_burst_but_queued_calls_stay_in_their_pod() -> None:
    auto = SandboxAutoscaling(minReplicas=1, maxReplicas=16, targetQueuePerWorker=1)
    cold = simulate(
        _tiny_cfg(replay=[_burst(600, 1.0, over_s=60.0)], pool_autoscaling=auto, workers_per_pod=4)
    )
    ups = [d[2] for d in cold.pool_decisions if d[4] == "scale-up"]
    assert ups[:3] == [2, 4, 8]  # the operator's policy: at most doubling per decision
    st = cold.steps[0]
    # the first pod queued the calls that came before any other pod was ready; they stay there
    first = st.latency[st.dispatch < 15.0]
    assert first.max() > 15.0
    # a pool pre-warmed to the size the autoscaler reached answers the same calls at once
    warm = auto.model_copy(update={"min_replicas": 16})
    pre = simulate(
        _tiny_cfg(
            replay=[_burst(600, 1.0, over_s=60.0)], pool_autoscaling=warm, pool_replicas=16, workers_per_pod=4
        )
    )
    assert pre.steps[0].latency.max() < 1.1
    assert pre.steps[0].latency.mean() < 0.2 * st.latency.mean()


def test_a_stopped_pod_answers_503_and_its_calls_move() -> None:
    async def go() -> tuple[int, dict[str, int]]:
        service = Service(np.random.default_rng(0))
        cfg = ServiceConfig(workers=1, pool="t", limits=SandboxLimits(timeout_seconds=10))
        pool = PoolController(service, cfg, replicas=2, autoscaling=None, startup_s=1.0)
        await pool.start()
        client = SandboxClient("http://sandbox")
        client._session = service  # type: ignore[assignment]
        calls = [asyncio.ensure_future(client.execute(encode_call(2.0))) for _ in range(6)]
        await asyncio.sleep(0.5)
        pool.replicas = 1
        await pool.reconcile()  # the newest pod goes: its calls are answered 503 and retried
        results = await asyncio.gather(*calls)
        await pool.stop()
        return sum(r.outcome == "stdout" for r in results), dict(service.statuses)

    ok, statuses = run_virtual(go)
    assert ok == 6
    assert statuses.get("503", 0) > 0


def test_fleet_autoscaler_with_the_trainers_backlog_keeps_the_fleet_mid_step() -> None:
    """Issue 18's fleet finding, on a tiny fleet: engines with room for 2 rollouts each report low
    KV usage while most rollouts wait in the scheduler. From the engines' gauges alone the
    autoscaler would shrink the fleet mid-step; with the trainer's backlog it never does."""
    from rollout_sim import EngineSpec

    from kuberl.api.rollout_fleet import FleetAutoscaling

    small = EngineSpec("engine", capacity=2 * (2048 + 600), t0=0.015, b_sat=128, prefill_per_token=1e-5)
    auto = FleetAutoscaling(
        minReplicas=1, maxReplicas=4, targetKVCacheUtilization=0.85, scaleDownStabilizationSeconds=30
    )
    wl = WorkloadSpec(prompts=4, rollouts_per_prompt=8, max_turns=4, max_response_tokens=2048)
    res = simulate(
        _tiny_cfg(workload=wl, steps=1, engines=4, engine=small, fleet_autoscaling=auto, fleet_dry_run=True,
                  autoscale_interval_s=2.0)
    )  # fmt: skip
    waited = {t for t, _, w in res.fleet_observed if w > 0}
    assert waited, "the scenario must make rollouts wait for KV room"
    blind = [d for d in res.fleet_blind_decisions if d[0] in waited]
    seen = [d for d in res.fleet_decisions if d[0] in waited]
    assert min(d[2] for d in blind) < 4  # before: it would have cut engines while rollouts waited
    assert all(d[2] == 4 for d in seen)  # after: held at max while anything waited


def test_a_queued_call_wakes_one_idle_worker_not_all() -> None:
    """Issue 18's simulation found every call woke every idle worker of its pod (a shared event:
    ~30 % of the simulation's time; ~1000 wake-ups a call at the paper's 1024 workers per node).
    Now one idle worker is woken per queued call: the waits the idle workers start (on the
    shared event or on their worker's exit) stay near one per call, not one per worker."""
    from clustersim.pods import ModelService, _ModelProcess

    waits = {"n": 0}
    real_wait = _ModelProcess.wait

    class CountingEvent(asyncio.Event):
        async def wait(self) -> bool:
            waits["n"] += 1
            return await super().wait()

    async def counting_wait(self: _ModelProcess) -> int:
        waits["n"] += 1
        return await real_wait(self)

    async def go() -> int:
        service = ModelService(ServiceConfig(workers=32, pool="t", limits=SandboxLimits(timeout_seconds=10)))
        service.nonempty = CountingEvent()
        await service.start()
        await asyncio.sleep(0.01)  # every worker parks
        before = waits["n"]
        for i in range(20):  # one call at a time, each answered before the next
            await service.submit(("exec", f"c{i}"), {"op": "exec", "code": encode_call(0.01), "timeout": 10})
            await asyncio.sleep(0.01)
        woken = waits["n"] - before
        await service.stop()
        return woken

    _ModelProcess.wait = counting_wait  # type: ignore[method-assign]
    try:
        woken = run_virtual(go)
    finally:
        _ModelProcess.wait = real_wait  # type: ignore[method-assign]
    assert woken <= 3 * 20, woken  # ~one worker per call; was ~32 per call


def test_an_announced_phase_has_its_pods_before_its_burst_and_gives_them_back_for_the_update() -> None:
    """The same cold burst as above, with the trainer announcing each phase: the first by the
    per-GPU rule before the run's first weight push, the next from the step before. The burst
    meets ready pods (the cold pool's first calls waited > 15 s), and the pool drops back to its
    minimum while the trainer updates."""
    auto = SandboxAutoscaling(minReplicas=1, maxReplicas=16, targetQueuePerWorker=1)
    burst = _burst(600, 1.0, over_s=60.0)
    burst.update_s, burst.sync_s = 30.0, 20.0
    res = simulate(
        _tiny_cfg(replay=[burst, burst], pool_autoscaling=auto, workers_per_pod=4, engines=8, announce=True)
    )
    first = phase_floor(workers_for_first_phase(8), 4)  # 2.1 cores per GPU: ceil(16.8 / 4) = 5 pods
    assert first == 5
    kinds = [(d[4], d[2]) for d in res.pool_decisions if d[4] in ("announced", "released")]
    second = phase_floor(workers_for_phase(Phase(600, res.steps[0].rollouts_done - res.steps[0].start, 1.0)), 4)
    assert second == math.ceil(PHASE_BURST_FACTOR * 600 * 1.0 / 60.0 / 4)  # 13 pods for 10 calls/s
    assert kinds[:3] == [("announced", first), ("released", 1), ("announced", second)], kinds
    assert res.steps[0].start >= burst.sync_s, "the first phase waited for the run's first weight push"
    step1, step2 = res.steps
    # the first burst met the per-GPU rule's pods (this burst's 1 s calls ask more of it than the
    # rule was sized for, so some queue: seconds, not the cold pool's 15 s and more)
    assert step1.latency.max() < 3.0
    # the calls met ready workers (random routing queues a few behind one call; cold: > 15 s)
    assert np.quantile(step2.latency, 0.99) < 1.1 and step2.latency.max() < 3.0 and step2.failed_calls == 0
    in_update = [s for s in res.timeline if res.steps[0].rollouts_done + 1 < s["t"] < res.steps[0].rollouts_done + 29]
    assert in_update and all(s["pods_ready"] == 1 for s in in_update), "the phase's pods went back"


def test_phase_sizing_rules() -> None:
    # 45K calls of 0.19 s over a 200 s phase: 43 cores of average demand, 5x for the bursts
    assert workers_for_phase(Phase(45_000, 200.0, 0.19)) == pytest.approx(5.0 * 45_000 * 0.19 / 200)
    assert phase_floor(workers_for_phase(Phase(45_000, 200.0, 0.19)), 32) == 7
    assert workers_for_phase(Phase(0, 200.0, 0.19)) == 0  # a phase without tool calls
    assert workers_for_phase(Phase(10, 0.0, 0.19)) == 0  # nothing measured yet
    assert phase_floor(workers_for_first_phase(64), 32) == 5 and phase_floor(workers_for_first_phase(1), 32) == 1
    assert phase_floor(0.0, 32) == 0
