"""The scheduler simulation: virtual time, the engine's KV model, and the bench's claims at small scale."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # rollout_sim lives with the benchmarks

from rollout_sim import (  # noqa: E402
    EngineSpec,
    SimEngine,
    WorkloadSpec,
    lower_bound,
    make_workload,
    run_virtual,
    simulate,
)

from kuberl.rollout.engine import GenerateRequest  # noqa: E402

FAST = EngineSpec("fast", capacity=60_000, t0=0.02, b_sat=16, prefill_per_token=0.02 / 80, max_running=256)
SLOW = EngineSpec("slow", capacity=30_000, t0=0.04, b_sat=8, prefill_per_token=0.04 / 40, max_running=256)
WORK = WorkloadSpec(rollouts=160, max_response_tokens=2048, turn_tokens_median=200)


def test_virtual_time_advances_without_sleeping():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(500), asyncio.sleep(1000))
        return loop.time()

    assert run_virtual(main) == pytest.approx(1000.0)


def test_engine_decodes_at_the_modelled_speed_and_batches():
    spec = EngineSpec("e", capacity=10_000, t0=0.01, b_sat=4, prefill_per_token=0.0)

    async def main():
        engine = SimEngine(spec, oracle=lambda req: 100)
        loop = asyncio.get_running_loop()
        one = await engine.generate(GenerateRequest([0] * 10, 1000, rid="a/0"))
        t1 = loop.time()
        outs = await asyncio.gather(
            *(engine.generate(GenerateRequest([0] * 10, 50, rid=f"b{i}/0")) for i in range(8))
        )
        t2 = loop.time() - t1
        await engine.close()
        return one, t1, outs, t2

    one, t1, outs, t2 = run_virtual(main)
    assert len(one.output_ids) == 100 and one.finish_reason == "stop" and t1 == pytest.approx(1.0)
    # 8 sequences > b_sat=4: each step takes twice t0; max_new_tokens=50 cuts the output.
    assert all(len(o.output_ids) == 50 and o.finish_reason == "length" for o in outs)
    assert t2 == pytest.approx(50 * 0.02)


def test_engine_out_of_kv_retracts_and_recomputes():
    spec = EngineSpec("tiny", capacity=1_000, t0=0.01, b_sat=8, prefill_per_token=0.0, init_new_token_ratio=0.0,
                      min_new_token_ratio=0.0)  # fmt: skip

    async def main():
        engine = SimEngine(spec, oracle=lambda req: 200)
        outs = await asyncio.gather(
            *(engine.generate(GenerateRequest([0] * 50, 500, rid=f"r{i}/0")) for i in range(8))
        )
        await engine.close()
        return engine, outs

    engine, outs = run_virtual(main)
    stats = engine.stats
    assert all(len(o.output_ids) == 200 and o.finish_reason == "stop" for o in outs)
    assert stats.overflow_events > 0 and stats.evicted_requests > 0 and stats.recomputed_tokens > 0
    assert stats.peak_kv_tokens <= spec.capacity
    assert engine._ratio > 0.0, "a retraction raises new_token_ratio (admission gets cautious)"


def test_a_prefix_evicted_during_a_tool_call_is_prefilled_again():
    spec = EngineSpec("small", capacity=1_000, t0=0.01, b_sat=8, prefill_per_token=0.0)

    async def main():
        engine = SimEngine(spec, oracle=lambda req: 100)
        await engine.generate(GenerateRequest([0] * 300, 500, rid="a/t0"))  # a's turn 1: 400 cached
        assert engine._cached_tokens == 400 and engine.stats.recomputed_tokens == 0
        # While a waits on its tool, b needs the space: LRU eviction takes a's cached tokens.
        await engine.generate(GenerateRequest([0] * 600, 400, rid="b/t0"))
        lost = engine._lost["a"]
        await engine.generate(GenerateRequest([0] * 420, 500, rid="a/t1"))  # a's turn 2: +20 tool tokens
        await engine.close()
        return engine.stats, lost

    stats, lost = run_virtual(main)
    assert lost > 0 and stats.prefix_evictions == 1 and stats.recomputed_tokens == lost
    assert stats.overflow_events == 0
    assert stats.prefill_tokens == 300 + 600 + 20 + lost


def test_b_sat_scaling_keeps_the_prefill_to_decode_cost_ratio():
    fast = FAST.scaled(4)
    assert fast.b_sat == 64 and fast.peak_throughput == pytest.approx(4 * FAST.peak_throughput)
    assert fast.prefill_per_token * fast.peak_throughput == pytest.approx(
        FAST.prefill_per_token * FAST.peak_throughput
    )


def test_kv_aware_never_overflows_and_beats_static_on_a_heterogeneous_fleet():
    plans = make_workload(WORK, seed=1)
    engines = [FAST, SLOW]
    lb = lower_bound(plans, engines)
    kv = simulate(plans, engines, "kv-aware", max_response_tokens=WORK.max_response_tokens)
    static = simulate(plans, engines, "static", max_response_tokens=WORK.max_response_tokens, turn_sync=True)
    assert kv.overflow_events == 0 and kv.scheduler_overflow_events == 0
    assert kv.recomputed_tokens == 0 and kv.prefix_evictions == 0
    # Static launches everything at once and lets the engines' optimistic admission cope: rollouts
    # lose their cached context while they wait on tools and pay to prefill it again.
    assert static.recomputed_tokens > 0 and static.prefix_evictions > 0
    for e in kv.per_engine:
        assert e["peak_kv_tokens"] <= e["capacity"]
    assert sum(e["sessions"] for e in kv.per_engine) == len(plans)
    assert lb <= kv.makespan_s < static.makespan_s / 1.5
    # The fast engine, with twice the KV cache, takes the larger share of rollouts.
    assert kv.per_engine[0]["sessions"] > kv.per_engine[1]["sessions"]
    # Static allocation splits the batch evenly regardless of speed.
    assert [e["sessions"] for e in static.per_engine] == [80, 80]
    again = simulate(plans, engines, "kv-aware", max_response_tokens=WORK.max_response_tokens)
    assert again.makespan_s == kv.makespan_s, "the simulation must be deterministic"


def test_workload_respects_the_response_budget():
    for p in make_workload(WORK, seed=2):
        assert p.decode_tokens + sum(p.tool_tokens) <= WORK.max_response_tokens
        assert len(p.tool_latency) == len(p.tool_tokens) == len(p.turns) - 1
        assert 1 <= len(p.turns) <= WORK.max_turns


def test_bench_script_runs_and_prints_the_table(capsys):
    path = Path(__file__).resolve().parent.parent / "bench" / "scheduler.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--rollouts", "64", "--fleet", "heterogeneous"])
    out = capsys.readouterr().out
    for name in ("kv-aware", "least-requests", "round-robin", "static+turn-sync", "lower bound"):
        assert name in out
    assert "kv-aware vs static+turn-sync (verl)" in out and "vs plain static" in out
    bench.main(["--rollouts", "32", "--b-sat-sweep"])
    out = capsys.readouterr().out
    assert "static/kv" in out and [line.split()[0] for line in out.splitlines()[2:]] == ["1", "2", "4"]
