"""The autoscaling decision logic: pure functions, fed synthetic metrics and clocks."""

from __future__ import annotations

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.api.sandbox_pool import SandboxAutoscaling
from kuberl.operator.decide.autoscale import (
    FleetLoad,
    PoolLoad,
    Recommendation,
    compact,
    decide,
    fleet_load,
    history_from_status,
    history_to_status,
    parse_gauges,
    pool_load,
    recommend_by_pipeline,
    recommend_fleet,
    recommend_pool,
)

POOL = SandboxAutoscaling(min_replicas=1, max_replicas=20, target_queue_per_worker=4)
FLEET = FleetAutoscaling(
    min_replicas=1, max_replicas=16, target_kv_cache_utilization=0.8, target_queued_requests=8
)


def _decide(current, rec, history=(), now=1000.0, lo=1, hi=20, window=300.0):
    return decide(current, rec, history, min_replicas=lo, max_replicas=hi, stabilization_s=window, now=now)


def test_pool_recommendation_follows_queue_per_worker() -> None:
    # 2 pods x 8 workers, 128 queued = 8/worker, target 4 -> double.
    assert recommend_pool(2, PoolLoad(128, 16, 2), 8, POOL) == 4
    # Within the 10% tolerance band: hold.
    assert recommend_pool(2, PoolLoad(68, 16, 2), 8, POOL) == 2
    # Empty queue, every worker busy: keep every pod that runs calls.
    assert recommend_pool(4, PoolLoad(0, 32, 4), 8, POOL) == 4
    # Idle: only what is busy.
    assert recommend_pool(4, PoolLoad(0, 9, 4), 8, POOL) == 2
    assert recommend_pool(4, PoolLoad(0, 0, 4), 8, POOL) == 0
    # From zero pods, queued work asks for pods.
    assert recommend_pool(0, PoolLoad(40, 0, 0), 8, POOL) == 2


def test_fleet_recommendation_kv_and_queue() -> None:
    assert recommend_fleet(4, FleetLoad((0.8,) * 4, (0,) * 4), FLEET) == 4  # on target
    assert recommend_fleet(4, FleetLoad((1.0,) * 4, (0,) * 4), FLEET) == 5  # ceil(4 * 1.0/0.8)
    assert recommend_fleet(4, FleetLoad((0.2,) * 4, (0,) * 4), FLEET) == 1
    # KV low but long queues: the queue signal wins (ceil(4 * 24/8) = 12).
    assert recommend_fleet(4, FleetLoad((0.3,) * 4, (24,) * 4), FLEET) == 12
    # A queue under target never forces a scale-down by itself.
    assert recommend_fleet(4, FleetLoad((0.8,) * 4, (4,) * 4), FLEET) == 4


def test_scale_up_is_immediate_but_at_most_doubling() -> None:
    d = _decide(2, 10)
    assert (d.desired, d.reason) == (4, "scale-up")
    assert _decide(4, 5).desired == 5
    assert _decide(0, 3, lo=0).desired == 1  # min +1 from zero


def test_scale_down_waits_for_the_stabilization_window() -> None:
    history: tuple[Recommendation, ...] = ()
    now = 0.0
    # Load was high at t=0 (8 pods), then drops to 2.
    d = _decide(8, 8, history, now=now)
    history = d.history
    for t in (60.0, 120.0, 290.0):
        d = _decide(8, 2, history, now=t)
        history = d.history
        assert d.desired == 8 and d.reason == "hold", t
    # The high sample ages out after 300 s; the highest remaining recommendation is 2.
    d = _decide(8, 2, history, now=301.0)
    assert (d.desired, d.reason) == (2, "scale-down")
    assert all(301.0 - r.time <= 300 for r in d.history)


def test_scale_down_uses_the_highest_recent_recommendation() -> None:
    hist = (Recommendation(900.0, 6), Recommendation(950.0, 3))
    assert _decide(8, 2, hist, now=1000.0).desired == 6


def test_bounds_and_missing_metrics() -> None:
    assert _decide(3, 50, hi=5).desired == 5
    assert _decide(3, 0, window=0, lo=2).desired == 2
    d = _decide(7, None, hi=5)
    assert (d.desired, d.reason) == (5, "bounds")
    d = _decide(3, None, (Recommendation(999.0, 3),))
    assert (d.desired, d.reason) == (3, "hold") and len(d.history) == 1  # not recorded


def test_zero_window_scales_down_at_once() -> None:
    assert _decide(6, 2, (Recommendation(999.0, 6),), window=0).desired == 2


SANDBOX_TEXT = """\
# HELP kuberl_sandbox_queue_depth Calls waiting for a worker.
# TYPE kuberl_sandbox_queue_depth gauge
kuberl_sandbox_queue_depth{pool="p"} 12.0
# HELP kuberl_sandbox_workers_busy Workers running a call.
# TYPE kuberl_sandbox_workers_busy gauge
kuberl_sandbox_workers_busy{pool="p"} 8.0
# TYPE kuberl_tool_calls_total counter
kuberl_tool_calls_total{pool="p",outcome="stdout"} 99.0
"""
SGLANG_TEXT = """\
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="policy"} 0.5
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="policy"} 3.0
"""


def test_metrics_parsing() -> None:
    assert parse_gauges(SANDBOX_TEXT, ["kuberl_sandbox_queue_depth"]) == {"kuberl_sandbox_queue_depth": 12.0}
    load = pool_load([SANDBOX_TEXT, SANDBOX_TEXT, "garbage_metric 1\n"])
    assert load == PoolLoad(24.0, 16.0, 2)
    assert pool_load(["other 1\n"]) is None
    fl = fleet_load([SGLANG_TEXT, SGLANG_TEXT.replace("0.5", "0.9")])
    assert fl is not None and abs(fl.mean_token_usage - 0.7) < 1e-9 and fl.queued_per_engine == 3.0
    assert fleet_load([]) is None


VLLM_TEXT = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 6.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 9.0
"""


def test_fleet_load_reads_vllm_gauges_too() -> None:
    fl = fleet_load([VLLM_TEXT, SGLANG_TEXT])  # a vLLM engine and an SGLang one: both counted
    assert fl is not None and fl.token_usage == (0.25, 0.5) and fl.queued == (6.0, 3.0)
    assert fleet_load(["vllm:num_requests_running 3\n"]) is None  # no usage nor queue gauge


def test_compact_history_keeps_every_possible_window_maximum() -> None:
    hist = [Recommendation(t, r) for t, r in [(0, 3), (10, 5), (20, 2), (30, 4), (40, 1)]]
    kept = compact(hist)
    assert kept == (Recommendation(10, 5), Recommendation(30, 4), Recommendation(40, 1))
    # For any later decision time and window, the maximum over the kept entries is the same.
    for now in range(40, 120, 5):
        for window in (0, 5, 15, 25, 35, 60):
            full = [r.replicas for r in hist if now - r.time <= window]
            small = [r.replicas for r in kept if now - r.time <= window]
            assert max(full, default=None) == max(small, default=None), (now, window)


def test_history_round_trips_through_status_and_survives_hand_edits() -> None:
    hist = (Recommendation(100.25, 6), Recommendation(160.5, 2))
    raw = history_to_status(hist)
    assert raw == [{"time": 100.25, "replicas": 6}, {"time": 160.5, "replicas": 2}]
    assert history_from_status(raw) == hist
    messy = [*raw, {"time": "x", "replicas": 1}, {"replicas": 3}, "junk"]
    assert history_from_status(messy) == hist
    assert history_from_status(None) == () and history_from_status({"a": 1}) == ()
    # A restarted operator that reads this back still holds 6 until the entry ages out.
    assert _decide(6, 1, history_from_status(raw), now=200.0, window=300).desired == 6


def test_an_asynchronous_pipeline_grows_the_fleet_when_the_trainer_starves_and_shrinks_it_when_engines_idle():
    on_target = (0.8,) * 4, (0,) * 4
    # the trainer waited 40 % of its step for rollouts: generation must fit 60 % -> ceil(4 / 0.6)
    assert recommend_fleet(4, FleetLoad(*on_target, rollout_wait=0.4, engine_idle=0.0), FLEET) == 7
    # waiting within target: no opinion, the KV rule holds the fleet
    assert recommend_fleet(4, FleetLoad(*on_target, rollout_wait=0.1, engine_idle=0.1), FLEET) == 4
    # engines idle 65 % of the step (waiting for weights): keep 70 % busy -> ceil(4 * 0.35 / 0.7) = 2
    low_kv = (0.5,) * 4, (0,) * 4  # KV alone would say ceil(4 * 0.5/0.8) = 3
    assert recommend_fleet(4, FleetLoad(*low_kv, rollout_wait=0.05, engine_idle=0.65), FLEET) == 2
    # the asynchronous trainers fill every engine's KV cache by design: full engines are no reason
    # to hold a fleet whose engines idle (before, KV at 0.95 held it, and grew it by 19 %)
    full = (0.95,) * 4, (3,) * 4
    assert recommend_fleet(4, FleetLoad(*full, rollout_wait=0.05, engine_idle=0.65), FLEET) == 2
    assert recommend_fleet(4, FleetLoad(*full, rollout_wait=0.05, engine_idle=0.1), FLEET) == 4  # holds
    # ... but a synchronous trainer's rollouts waiting for KV room still ask for more
    busy = FleetLoad(*low_kv, waiting=8, inflight=8, rollout_wait=0.05, engine_idle=0.65)
    assert recommend_fleet(4, busy, FLEET) == 8
    # a starving trainer outvotes idle engines (another job's); the doubling cap is decide()'s
    assert recommend_fleet(4, FleetLoad(*on_target, rollout_wait=0.7, engine_idle=0.9), FLEET) == 8
    assert recommend_by_pipeline(1, None, 0.99) == 1, "never below one engine"
    assert recommend_by_pipeline(4, None, None) is None


def test_the_pipeline_counts_the_engines_that_served_the_measured_step_not_those_still_starting():
    # 6 replicas, 2 of them still starting: the 40 % wait was measured on 4 engines, which ask
    # for ceil(4 / 0.6) = 7, not ceil(6 / 0.6) = 10 (the same wait counted on engines that did
    # not serve it grew the fleet twice for one shortage)
    assert recommend_by_pipeline(6, 0.4, 0.0, served=4) == 7
    assert recommend_by_pipeline(6, 0.4, 0.0) == 10
    # a shortage that the starting replicas cover already: hold, never shrink while starved
    assert recommend_by_pipeline(6, 0.2, 0.0, served=4) == 6
    # idle engines shrink from those that served: ceil(4 * 0.4 / 0.7) = 3 of the 6 replicas
    assert recommend_by_pipeline(6, 0.0, 0.6, served=4) == 3
    # served unknown (0 or missing: a trainer before the gauge) counts today's replicas
    assert recommend_by_pipeline(6, 0.4, 0.0, served=0) == recommend_by_pipeline(6, 0.4, 0.0) == 10
    on_target = (0.8,) * 6, (0,) * 6
    assert recommend_fleet(6, FleetLoad(*on_target, rollout_wait=0.4, engine_idle=0.0, engines_served=4), FLEET) == 7


def test_fleet_load_reads_the_asynchronous_trainers_pipeline():
    engine = 'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_waiting{engine="0"} 0\n'
    sync = 'kuberl_rollout_requests_inflight 4\n'
    starved = 'kuberl_train_rollout_wait_ratio{job="a"} 0.3\nkuberl_train_engine_idle_ratio{job="a"} 0.1\n'
    idle = 'kuberl_train_rollout_wait_ratio{job="b"} 0.0\nkuberl_train_engine_idle_ratio{job="b"} 0.6\n'
    load = fleet_load([engine], [sync, starved, idle])
    assert load.rollout_wait == 0.3 and load.engine_idle == 0.1  # the most starved, the least idle
    assert load.engines_served is None
    load = fleet_load([engine], [starved + 'kuberl_train_engines_in_service{job="a"} 3\n',
                                 idle + 'kuberl_train_engines_in_service{job="b"} 4\n'])
    assert load.engines_served == 4  # every trainer rolls out on the whole fleet: the most any saw
    load = fleet_load([engine], [sync])
    assert load.rollout_wait is None and load.engine_idle is None  # synchronous runs do not vote
    # an asynchronous trainer's batches ahead wait in its scheduler by design: not the fleet's backlog
    ahead = starved + 'kuberl_rollout_requests_waiting 500\nkuberl_rollout_requests_inflight 64\n'
    load = fleet_load([engine], [ahead, "kuberl_rollout_requests_waiting 6\n" + sync])
    assert (load.waiting, load.inflight) == (6, 4)
