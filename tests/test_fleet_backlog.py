"""Issue 18, "use what it finds": the fleet autoscaler reads the trainers' backlog.

bench/cluster_sim.py found that during a synchronous RL step the engines report 5-28 % KV usage
and no queue while ~10K rollouts wait in the trainer's KV-aware scheduler (it reserves
prompt + maxResponseTokens per rollout), so the autoscaler, seeing the engines only, would have
shrunk a 64-engine fleet to 4-22 engines mid-step. The trainers now export
``kuberl_rollout_requests_waiting`` and the operator scrapes the trainers of each fleet.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.operator.decide.autoscale import FleetLoad, decide, fleet_load, recommend_fleet
from kuberl.rollout.scheduler import Scheduler
from tests.test_operator_e2e import API, NS, Cluster, cluster_and_operator, eventually, metrics_server
from tests.test_operator_hardening import fleet

pytestmark = pytest.mark.timeout(90)
WAITING = "kuberl_rollout_requests_waiting"
AUTO = FleetAutoscaling.model_validate({"minReplicas": 1, "maxReplicas": 64, "targetKVCacheUtilization": 0.85})


def _engine(usage: float) -> str:
    return f"sglang:token_usage {usage}\nsglang:num_queue_reqs 0\n"


def _trainer(waiting: float, inflight: float) -> str:
    return (
        f"kuberl_rollout_requests_waiting {waiting}\n"
        f'kuberl_rollout_requests_inflight{{engine="e0"}} {inflight / 2}\n'
        f'kuberl_rollout_requests_inflight{{engine="e1"}} {inflight / 2}\n'
    )


def test_waiting_rollouts_hold_and_grow_the_fleet() -> None:
    engines = [_engine(0.15)] * 64  # what the simulated step's engines reported
    blind = fleet_load(engines)
    assert recommend_fleet(64, blind, AUTO) == 12  # ceil(64 * 0.15 / 0.85): the old shrink
    seen = fleet_load(engines, [_trainer(10_000, 6_144)])
    assert (seen.waiting, seen.inflight) == (10_000, 6_144)
    # ceil(64 * (6144 + 10000) / 6144) = 169: at least as many engines as today, clamped by max
    assert recommend_fleet(64, seen, AUTO) == 169
    assert decide(64, 169, (), min_replicas=1, max_replicas=64, stabilization_s=300, now=0).desired == 64
    # no backlog: the engines' KV usage decides again (scale-down still stabilized by decide)
    assert recommend_fleet(64, fleet_load(engines, [_trainer(0, 6_144)]), AUTO) == 12
    # waiting rollouts but none in flight (engines just joined): grow, never shrink
    assert recommend_fleet(4, FleetLoad((0.0,) * 4, (0.0,) * 4, waiting=50), AUTO) == 8


class _Tiny:
    """An engine with room for one rollout (KV-aware scheduling reserves it whole)."""

    name = "tiny"
    shared = False
    capacity_version = 0

    async def max_total_tokens(self) -> int:
        return 100


async def test_the_scheduler_exports_its_backlog() -> None:
    sched = Scheduler([_Tiny()], policy="kv-aware")
    hold = asyncio.Event()

    async def rollout() -> None:
        async with sched.session(prompt_tokens=10, max_response_tokens=80):
            await hold.wait()

    tasks = [asyncio.create_task(rollout()) for _ in range(4)]
    await asyncio.sleep(0.05)
    assert sched.waiting == 3 and REGISTRY.get_sample_value(WAITING) == 3
    hold.set()
    await asyncio.gather(*tasks)
    assert REGISTRY.get_sample_value(WAITING) == 0


async def _add_pod(k: Cluster, name: str, labels: dict[str, str], port: int, port_name: str, env: list) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i", "env": env,
                                 "ports": [{"name": port_name, "containerPort": port}]}]},
    }  # fmt: skip
    await k.create(f"/api/v1/namespaces/{NS}/pods", pod)
    ready = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    await k.patch(f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": ready})


async def test_operator_scrapes_the_fleets_trainers_and_does_not_shrink_it_mid_step() -> None:
    """Engines at 15 % KV usage, a trainer of this fleet with rollouts waiting: the fleet keeps its
    engines (before: scaled down to 1); a trainer of another fleet does not count."""
    load = {"waiting": 500.0}
    trainer_labels = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/component": "trainer"}
    async with (
        metrics_server(lambda: _engine(0.15)) as engine_port,
        metrics_server(lambda: _trainer(load["waiting"], 40)) as trainer_port,
        metrics_server(lambda: _trainer(9_999, 1)) as other_port,
        cluster_and_operator(autoscale_interval=0.2) as k,
    ):
        auto = {"minReplicas": 1, "maxReplicas": 4, "scaleDownStabilizationSeconds": 0}
        await k.create(f"{API}/rolloutfleets", fleet("gen", replicas=2, autoscaling=auto))
        path = f"/apis/apps/v1/namespaces/{NS}/deployments/gen"
        dep = await eventually(lambda: k.get(path), what="engines")
        await _add_pod(k, "gen-0", dep["spec"]["selector"]["matchLabels"], engine_port, "http", [])
        await _add_pod(k, "train-0", trainer_labels, trainer_port, "metrics",
                       [{"name": "KUBERL_ROLLOUT_FLEET", "value": "gen"}])  # fmt: skip
        await _add_pod(k, "other-0", trainer_labels, other_port, "metrics",
                       [{"name": "KUBERL_ROLLOUT_FLEET", "value": "elsewhere"}])  # fmt: skip

        async def status_with(waiting: float) -> Any:
            st = (await k.get(f"{API}/rolloutfleets/gen")).get("status") or {}
            return st if st.get("rolloutsWaiting") == waiting else None

        st = await eventually(lambda: status_with(500.0), what="the trainer's backlog in the fleet's status")
        assert st["kvCacheUtilization"] == pytest.approx(0.15)
        await asyncio.sleep(1.0)  # several decisions with the backlog
        assert (await k.get(f"{API}/rolloutfleets/gen"))["spec"]["replicas"] == 4  # grew, never shrank
        load["waiting"] = 0.0  # the step's rollouts all admitted: KV usage decides again

        async def shrunk() -> bool:
            return (await k.get(f"{API}/rolloutfleets/gen"))["spec"]["replicas"] == 1

        await eventually(shrunk, what="scale-down once nothing waits")


# -- a SandboxPool held for the rollout phases its trainers announce -----------------------------


def _announcing(workers: float) -> str:
    return f'kuberl_rollout_phase_workers{{job="j"}} {workers}\n'


async def test_a_pool_is_held_for_the_phase_its_trainers_announce_then_released() -> None:
    """An idle pool (nothing queued or busy) with a trainer announcing a phase of 20 workers:
    the pool grows to the 5 pods of 4 workers that holds them, at once, before any call
    arrives; once the trainer says the phase is over the pool goes back to its minimum without
    waiting out the stabilization window. A trainer of another pool does not count."""
    from tests.test_operator_e2e import pool
    from tests.test_operator_hardening import sandbox_load

    phase = {"workers": 20.0}
    trainer_labels = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/component": "trainer"}
    async with (
        metrics_server(lambda: sandbox_load("tools", 0, 0)) as pod_port,
        metrics_server(lambda: _announcing(phase["workers"])) as trainer_port,
        metrics_server(lambda: _announcing(999)) as other_port,
        cluster_and_operator(autoscale_interval=0.2) as k,
    ):
        auto = {"minReplicas": 1, "maxReplicas": 8, "targetQueuePerWorker": 4, "scaleDownStabilizationSeconds": 600}
        await k.create(f"{API}/sandboxpools", pool(replicas=1, workersPerPod=4, autoscaling=auto))
        path = f"/apis/apps/v1/namespaces/{NS}/deployments/tools"
        dep = await eventually(lambda: k.get(path), what="the pool's Deployment")
        await _add_pod(k, "tools-0", dep["spec"]["selector"]["matchLabels"], pod_port, "http", [])
        await _add_pod(k, "train-0", trainer_labels, trainer_port, "metrics",
                       [{"name": "KUBERL_SANDBOX_POOL", "value": "tools"}])  # fmt: skip
        await _add_pod(k, "other-0", trainer_labels, other_port, "metrics",
                       [{"name": "KUBERL_SANDBOX_POOL", "value": "elsewhere"}])  # fmt: skip

        async def replicas(n: int) -> bool:
            return (await k.get(f"{API}/sandboxpools/tools"))["spec"]["replicas"] == n

        await eventually(lambda: replicas(5), what="the announced phase's 5 pods")
        st = (await k.get(f"{API}/sandboxpools/tools"))["status"]
        assert st["announcedWorkers"] == 20.0
        await asyncio.sleep(1.0)
        assert await replicas(5), "held while the phase is announced, though nothing is queued"
        phase["workers"] = 0.0  # the phase's rollouts are in
        await eventually(lambda: replicas(1), what="released to the minimum, before the 600 s window")
