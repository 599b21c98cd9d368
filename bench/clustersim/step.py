"""Run RL steps end to end in virtual time and record where the time goes.

A step: every rollout of the batch goes through the real KV-aware ``Scheduler`` onto a
simulated engine, generates turn by turn (``SimEngine``), and between turns sends its tool
call through the real ``SandboxClient`` (retries, backoff) to the pool's pods (the real
``SandboxService`` queue and handlers). When the last rollout is done the trainer updates
and pushes the weights (modelled durations), then the next step starts. The operator's
autoscaler runs throughout, across steps.

``SimConfig.ahead`` = k >= 1: the fleet side of asynchronous RL at asyncLevel k
(bench/async_sim.py), with a trainer that keeps up. As the trainer submits them
(rollout/orchestrator.py ``Orchestrator.acquire``): batch 0 at once, batches 1..k when batch 0 ends (is
collected), then batch i when batch i-k ends; ``Scheduler.max_active`` is k batches' rollouts,
as the rollout worker sets it for engines that do not pad rows, and admission is FIFO, so a
batch submitted ahead starts at once beside the ones before it, which take their places first.
No update or sync runs; each record's ``start`` is its batch's submission, ``rollouts_done``
its last rollout's end and ``end`` its collection (batches are collected in order, and batch i is
submitted when batch i-k is collected).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

import numpy as np
from rollout_sim import EngineSpec, SimEngine, run_virtual

from kuberl.api.rollout_fleet import FleetAutoscaling
from kuberl.api.sandbox_pool import SandboxAutoscaling, SandboxLimits
from kuberl.operator.decide import autoscale
from kuberl.rollout import phases
from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.scheduler import Scheduler
from kuberl.sandbox.config import ServiceConfig
from kuberl.sandbox.service.client import SandboxClient, SandboxError

from .control import FleetController, PoolController, autoscaler_loop
from .pods import Service
from .workload import RolloutPlan, TrainerModel, WorkloadSpec, encode_call, make_plans, trained_tokens

# One MI300X serving a 14B model (SGLang, bf16, memFractionStatic 0.85): ~135 GB of KV cache at
# 160 KiB per token (40 layers x 8 KV heads x 128 x 2 x 2 bytes) is ~820K tokens; decode is
# memory-bound at ~15 ms a step up to 128 sequences. Same engine model as bench/scheduler.py.
MI300X_14B = EngineSpec(
    "engine", capacity=820_000, t0=0.015, b_sat=128, prefill_per_token=0.015 / (128 * 5), max_running=1024
)


@dataclass
class SimConfig:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    steps: int = 2
    seed: int = 0
    engines: int = 64
    engine: EngineSpec = MI300X_14B
    fleet_autoscaling: FleetAutoscaling | None = None
    fleet_dry_run: bool = False
    engine_startup_s: float = 120.0
    pool_replicas: int = 8
    workers_per_pod: int = 32  # one worker per core (examples/rstar2-mi300x.yaml: 32 cpu, 32 workers)
    pool_autoscaling: SandboxAutoscaling | None = None
    pod_startup_s: float = 15.0
    queue_limit: int = 4096
    batch_size: int = 4
    trainer: TrainerModel = field(default_factory=TrainerModel)
    autoscale_interval_s: float = 15.0
    sample_s: float = 2.0
    rtt_s: float = 0.001
    plans: list[list[RolloutPlan]] | None = None  # precomputed per step (same workload across runs)
    # Replay instead of rollouts: each step's tool calls (dispatch offsets and costs) and its
    # durations, recorded by a closed-loop run. Tool latency is ~1/100 of a turn, so the calls'
    # arrival times barely depend on the pool; a replay prices other pools without the engines.
    replay: list[StepRecord] | None = None
    ahead: int = 0  # 0: synchronous steps; k >= 1: the fleet side at asyncLevel k (above)
    # The trainer announces each rollout phase before it starts (synchronous steps): the first
    # before its first weight push (the run waits for that push, sync_s), sized by the rule
    # per GPU; every later one when its weight push starts, from the step before (calls, their
    # mean time, the phase's length). The pool has the phase's pods (rollout.phases)
    # from then until the phase's calls are done, and returns to its minimum for the update.
    announce: bool = False


@dataclass
class StepRecord:
    start: float
    rollouts_done: float = 0.0
    end: float = 0.0
    update_s: float = 0.0
    sync_s: float = 0.0
    calls: int = 0
    failed_calls: int = 0
    latency: np.ndarray = field(default_factory=lambda: np.empty(0))
    dispatch: np.ndarray = field(default_factory=lambda: np.empty(0))  # seconds after the step's start
    costs: np.ndarray = field(default_factory=lambda: np.empty(0))  # each call's modelled duration
    critical: dict[str, float] = field(default_factory=dict)  # the last rollout's own time split
    mean_rollout: dict[str, float] = field(default_factory=dict)

    @property
    def rollout_s(self) -> float:
        return self.rollouts_done - self.start


@dataclass
class SimResult:
    steps: list[StepRecord]
    timeline: list[dict[str, float]]
    statuses: dict[str, int]
    attempts: int
    pool_decisions: list[tuple]
    fleet_decisions: list[tuple]
    fleet_observed: list[tuple[float, float, int]]
    fleet_blind_decisions: list[tuple] = field(default_factory=list)  # engines' gauges only (before)


def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.quantile(xs, q)) if xs.size else float("nan")


def latency_summary(lat: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(lat.mean()) if lat.size else float("nan"),
        "p50": _pct(lat, 0.5),
        "p99": _pct(lat, 0.99),
    }


async def _run(cfg: SimConfig) -> SimResult:
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(cfg.seed)
    lengths: dict[str, int] = {}

    def oracle(req: GenerateRequest) -> int:
        return lengths.pop(req.rid)

    def make_engine(name: str) -> SimEngine:
        return SimEngine(replace(cfg.engine, name=name), oracle)

    spec = cfg.workload
    sched = Scheduler(
        [make_engine(f"engine-{i}") for i in range(cfg.engines)],
        "kv-aware",
        max_response_tokens_default=spec.max_response_tokens,
        no_engine_timeout_s=None,
    )
    service = Service(rng, cfg.rtt_s)
    svc_cfg = ServiceConfig(
        workers=cfg.workers_per_pod,
        pool="sim",
        limits=SandboxLimits(timeout_seconds=spec.tool_timeout_s),
        batch_size=cfg.batch_size,
        queue_limit=cfg.queue_limit,
    )
    pool = PoolController(service, svc_cfg, cfg.pool_replicas, cfg.pool_autoscaling, cfg.pod_startup_s)
    await pool.start()
    fleet = FleetController(
        sched, make_engine, cfg.engine, cfg.fleet_autoscaling, cfg.engine_startup_s, cfg.fleet_dry_run
    )
    client = SandboxClient("http://sandbox", retries=5, request_timeout=60.0)
    client._session = service  # type: ignore[assignment]  # the Service replaces the aiohttp session
    stop = asyncio.Event()
    timeline: list[dict[str, float]] = []
    inflight = {"calls": 0, "rollouts": 0}

    async def sampler() -> None:
        while not stop.is_set():
            ready = pool.ready_pods
            timeline.append(
                {
                    "t": loop.time(),
                    "pods_desired": pool.replicas,
                    "pods_ready": len(ready),
                    "cores_ready": sum(p.cores for p in ready),
                    "queue": sum(len(p.svc.queue) for p in ready),
                    "busy": sum(p.svc.busy for p in ready),
                    "calls_inflight": inflight["calls"],
                    "rollouts_active": inflight["rollouts"],
                    "engines": fleet.in_service,
                    "engines_desired": fleet.replicas,
                    "rollouts_waiting": sched.waiting,
                }
            )
            try:
                await asyncio.wait_for(stop.wait(), cfg.sample_s)
            except TimeoutError:
                pass

    tasks = [
        loop.create_task(sampler()),
        loop.create_task(autoscaler_loop([pool, fleet], cfg.autoscale_interval_s, stop)),
    ]
    records = []

    async def call(
        code: str, rec: StepRecord, lat: list[float], disp: list[float], costs: list[float], cost: float
    ) -> None:
        c0 = loop.time()
        inflight["calls"] += 1
        try:
            await client.execute(code)
        except SandboxError:
            rec.failed_calls += 1
        finally:
            inflight["calls"] -= 1
        lat.append(loop.time() - c0)
        disp.append(c0 - rec.start)
        costs.append(cost)

    async def replay(
        rec: StepRecord, old: StepRecord, lat: list[float], disp: list[float], costs: list[float]
    ) -> None:
        pending = []
        for offset, cost in sorted(zip(old.dispatch, old.costs, strict=True)):
            await asyncio.sleep(max(0.0, rec.start + offset - loop.time()))
            pending.append(
                loop.create_task(call(encode_call(float(cost)), rec, lat, disp, costs, float(cost)))
            )
        await asyncio.sleep(max(0.0, rec.start + old.rollout_s - loop.time()))
        await asyncio.gather(*pending)

    async def run_batch(step: int, rec: StepRecord) -> list[RolloutPlan]:
        """One batch's rollouts, each through the scheduler and the sandbox; fills ``rec``."""
        lat: list[float] = []
        disp: list[float] = []
        costs: list[float] = []
        plans = cfg.plans[step] if cfg.plans else make_plans(spec, cfg.seed * 1000 + step)
        per_rollout: list[tuple[float, float, float, float]] = []  # end, wait, gen, tools

        async def rollout(
            i: int,
            plan: RolloutPlan,
            step: int = step,
            rec: StepRecord = rec,
            lat: list = lat,
            disp: list = disp,
            costs: list = costs,
            per_rollout: list = per_rollout,
        ) -> None:
            t0 = loop.time()
            gen = tools = 0.0
            async with sched.session(plan.prompt, spec.max_response_tokens) as engine:
                inflight["rollouts"] += 1
                wait = loop.time() - t0
                context = plan.prompt
                for t, tokens in enumerate(plan.turns):
                    rid = f"s{step}r{i}/t{t}"
                    lengths[rid] = tokens
                    g0 = loop.time()
                    out = await engine.generate(
                        GenerateRequest(
                            [0] * context, spec.max_response_tokens - (context - plan.prompt), rid=rid
                        )
                    )
                    gen += loop.time() - g0
                    context += len(out.output_ids)
                    if t == len(plan.turns) - 1:
                        break
                    c0 = loop.time()
                    cost = plan.tool_costs[t]
                    await call(encode_call(cost), rec, lat, disp, costs, cost)
                    tools += loop.time() - c0
                    context += plan.tool_tokens[t]
                inflight["rollouts"] -= 1
            per_rollout.append((loop.time(), wait, gen, tools))

        await asyncio.gather(*(rollout(i, p) for i, p in enumerate(plans)))
        rec.rollouts_done = loop.time()
        rec.calls = len(lat)
        rec.latency, rec.dispatch, rec.costs = np.array(lat), np.array(disp), np.array(costs)
        arr = np.array(per_rollout)
        last = arr[np.argmax(arr[:, 0])]
        rec.critical = {"wait_for_engine": last[1], "generation": last[2], "tools": last[3]}
        rec.mean_rollout = {
            "wait_for_engine": arr[:, 1].mean(),
            "generation": arr[:, 2].mean(),
            "tools": arr[:, 3].mean(),
        }
        return plans

    if cfg.ahead:
        sched.max_active = spec.rollouts * cfg.ahead  # k batches in flight, the older first (FIFO)
        done = [asyncio.Event() for _ in range(cfg.steps)]
        batch_records = [StepRecord(start=0.0) for _ in range(cfg.steps)]

        async def submit(i: int) -> None:
            if i:  # Event.set wakes its waiters in order: batch i's rollouts queue before i+1's
                await done[max(0, i - cfg.ahead)].wait()
            batch_records[i].start = loop.time()
            await run_batch(i, batch_records[i])
            if i:  # the trainer collects in order: batch i once it and batch i-1 are in
                await done[i - 1].wait()
            batch_records[i].end = loop.time()
            done[i].set()

        await asyncio.gather(*(submit(i) for i in range(cfg.steps)))
        records.extend(batch_records)
    steps = 0 if cfg.ahead else len(cfg.replay) if cfg.replay else cfg.steps
    if cfg.announce and steps:
        first = phases.workers_for_first_phase(cfg.engines)
        await pool.announce(autoscale.phase_floor(first, cfg.workers_per_pod), loop.time())
        await asyncio.sleep(cfg.replay[0].sync_s if cfg.replay else cfg.trainer.sync_seconds())

    async def between_steps(rec: StepRecord, last: bool) -> None:
        """The update, then the weight push; with announcements the pool follows the phases."""
        if cfg.announce:
            await pool.release(loop.time())
        await asyncio.sleep(rec.update_s)
        if cfg.announce and not last:
            mean_s = float(rec.costs.mean()) if rec.calls else 0.0
            workers = phases.workers_for_phase(phases.Phase(rec.calls, rec.rollouts_done - rec.start, mean_s))
            await pool.announce(autoscale.phase_floor(workers, cfg.workers_per_pod), loop.time())
        await asyncio.sleep(rec.sync_s)

    for step in range(steps):
        rec = StepRecord(start=loop.time())
        lat: list[float] = []
        disp: list[float] = []
        costs: list[float] = []
        if cfg.replay:
            old = cfg.replay[step]
            await replay(rec, old, lat, disp, costs)
            rec.rollouts_done = loop.time()
            rec.calls = len(lat)
            rec.latency, rec.dispatch, rec.costs = np.array(lat), np.array(disp), np.array(costs)
            rec.critical, rec.mean_rollout = old.critical, old.mean_rollout
            rec.update_s, rec.sync_s = old.update_s, old.sync_s
            await between_steps(rec, step == steps - 1)
            rec.end = loop.time()
            records.append(rec)
            continue
        plans = await run_batch(step, rec)
        rec.update_s = cfg.trainer.update_seconds(trained_tokens(plans, spec, cfg.trainer.kept_per_prompt))
        rec.sync_s = cfg.trainer.sync_seconds()
        await between_steps(rec, step == steps - 1)
        rec.end = loop.time()
        records.append(rec)
    stop.set()
    await asyncio.gather(*tasks)
    await pool.stop()
    await fleet.stop()
    await sched.close()
    for st in sched.stats:
        if st.engine is not None:
            await st.engine.close()
    return SimResult(
        records,
        timeline,
        dict(service.statuses),
        service.attempts,
        pool.log.decisions,
        fleet.log.decisions,
        fleet.observed,
        fleet.blind_log.decisions,
    )


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg.steps`` RL steps on a fresh virtual-time loop (deterministic for a seed)."""
    logging.getLogger("kuberl.sandbox").setLevel(logging.ERROR)  # one "pool ready" line per pod
    return run_virtual(lambda: _run(cfg))
