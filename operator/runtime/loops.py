"""The operator's periodic work: the resync loop (drift repair and status refresh over every
object) and the autoscaling loop (scrape, decide, write the scale subresource), split from
``handlers.py`` (which keeps the per-object reconcile and the kopf registry).

* ``resync_loop`` (every ``reconcile_interval``): ``reconcile`` over every object, status
  written when it changed, events posted; the read cache is invalidated at the start of each
  pass (one LIST per kind and namespace per pass, ``cache.py``); an object a complete pass no
  longer lists is forgotten.
* ``autoscale_loop`` (every ``autoscale_interval``): ``autoscale_once`` per pool/fleet with
  ``spec.autoscaling`` (not KEDA's), written as an HPA would.
* ``stale_loops``: what kopf's liveness probe handler reports (a wedged loop fails it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from kuberl.api import ManifestError, RolloutFleet, SandboxPool
from kuberl.api.group import GROUP, VERSION
from kuberl.operator.decide import autoscale, status
from kuberl.operator.render import keda
from kuberl.operator.runtime import metrics
from kuberl.operator.runtime.context import PLURALS, SCALED, OperatorContext
from kuberl.operator.runtime.handlers import parse_body, pod_selector, post_events, reconcile
from kuberl.operator.runtime.kube import ApiError, is_subset, kind_of
from kuberl.operator.runtime.pods import ready_pods, scrape_pods, trainer_pods_using
from kuberl.operator.runtime.summary import summary_line

log = logging.getLogger("kuberl.operator")
SUMMARY_EVERY = 600.0
"""Seconds between two unchanged summary lines of the resync loop (``summary.summary_line``)."""


# --- autoscaling ---------------------------------------------------------------------------


@dataclass
class ScaleResult:
    decision: autoscale.Decision
    status: dict[str, Any]
    events: list[status.Event]

    @property
    def replicas(self) -> int:
        return self.decision.desired


async def autoscale_once(ctx: OperatorContext, body: Mapping[str, Any]) -> ScaleResult | None:
    """Scrape the pods' /metrics and decide the replica count (None: not autoscaled here)."""
    try:
        res = parse_body(body)
    except ManifestError:
        return None
    if (
        not isinstance(res, SandboxPool | RolloutFleet)
        or res.spec.autoscaling is None
        or keda.wants_keda(res)
    ):
        return None
    auto = res.spec.autoscaling
    namespace = body["metadata"]["namespace"]
    pods = await ready_pods(ctx.client(), namespace, pod_selector(res))
    texts = await scrape_pods(ctx.scrape, pods, ("http",))
    current = res.spec.replicas
    rec: int | None = None
    st: dict[str, Any] = {}
    previous = body.get("status") or {}
    history = autoscale.history_from_status(previous.get("recommendations"))
    floor = 0
    if isinstance(res, SandboxPool):
        load = autoscale.pool_load(texts)
        if load is not None:
            rec = autoscale.recommend_pool(current, load, res.spec.workers_per_pod, auto)
            st.update(queueDepth=load.queue_depth, workersBusy=load.workers_busy)
        # rank 0 of each trainer using the pool announces its rollout phases on "metrics"
        trainers = await trainer_pods_using(ctx.client(), namespace, "KUBERL_SANDBOX_POOL", res.metadata.name)
        announced = autoscale.phase_workers(await scrape_pods(ctx.scrape, trainers, ("metrics",)))
        floor = autoscale.phase_floor(announced, res.spec.workers_per_pod)
        st["announcedWorkers"] = announced
        if not announced and previous.get("announcedWorkers"):
            history = ()  # the phase is over: its pods need not wait out the window
    else:
        # rank 0 of each trainer using the fleet serves its scheduler's backlog on "metrics"
        trainers = await trainer_pods_using(ctx.client(), namespace, "KUBERL_ROLLOUT_FLEET", res.metadata.name)
        fload = autoscale.fleet_load(texts, await scrape_pods(ctx.scrape, trainers, ("metrics",)))
        if fload is not None:
            rec = autoscale.recommend_fleet(current, fload, auto)
            st.update(
                kvCacheUtilization=round(fload.mean_token_usage, 4),
                queuedRequests=round(fload.queued_per_engine, 3),
                rolloutsWaiting=fload.waiting,
            )
            if fload.rollout_wait is not None:
                st["trainerRolloutWait"] = round(fload.rollout_wait, 3)
            if fload.engine_idle is not None:
                st["engineIdle"] = round(fload.engine_idle, 3)
            if fload.engines_served is not None:
                st["enginesServed"] = fload.engines_served
    decision = autoscale.decide(
        current,
        rec if rec is not None or not floor else floor,
        history,
        min_replicas=max(auto.min_replicas, floor),
        max_replicas=auto.max_replicas,
        stabilization_s=auto.scale_down_stabilization_seconds,
        now=ctx.config.clock(),
    )
    st["desiredReplicas"] = decision.desired
    st["recommendations"] = autoscale.history_to_status(decision.history)
    events = []
    if decision.desired != current:
        events.append(
            status.Event(
                "Normal",
                "ScaledUp" if decision.desired > current else "ScaledDown",
                f"replicas {current} -> {decision.desired} ({decision.reason}; load asks for {decision.recommendation})",
            )
        )
    return ScaleResult(decision, st, events)


# --- the periodic passes -------------------------------------------------------------------


def _status_changed(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k != "lastTransitionTime"}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d

    return not is_subset(strip(dict(new)), strip(dict(current or {})))


async def resync_object(ctx: OperatorContext, body: Mapping[str, Any]) -> None:
    """One periodic pass over one object: drift repair and status refresh."""
    kind = kind_of(body["apiVersion"], body["kind"])
    meta = body["metadata"]
    # Not handled yet (kopf's create handler may be queued behind this pass): whatever is
    # missing was never created, so no "was missing" warnings.
    first_time = (body.get("status") or {}).get("observedGeneration") is None
    new, events = await reconcile(ctx, body, first_time=first_time)
    if new and _status_changed(body.get("status") or {}, new):
        await ctx.client().patch(kind, meta["namespace"], meta["name"], {"status": new}, sub="status")
    await post_events(ctx, body, events)


async def autoscale_object(ctx: OperatorContext, body: Mapping[str, Any]) -> None:
    """One autoscaling decision for one pool/fleet, written as an HPA would."""
    scaled = await autoscale_once(ctx, body)
    if scaled is None:
        return
    client = ctx.client()
    kind = kind_of(body["apiVersion"], body["kind"])
    meta = body["metadata"]
    ctx.remember(body)
    if scaled.replicas != body["spec"].get("replicas"):
        # Through the scale subresource, so the change is a spec change (kopf's update handler
        # then resizes the workload at once).
        await client.patch(
            kind, meta["namespace"], meta["name"], {"spec": {"replicas": scaled.replicas}}, sub="scale"
        )
    if _status_changed(body.get("status") or {}, scaled.status):
        await client.patch(kind, meta["namespace"], meta["name"], {"status": scaled.status}, sub="status")
    metrics.record(meta["namespace"], body["kind"], meta["name"], desired=scaled.replicas)
    await post_events(ctx, body, scaled.events)


ObjectPass = Callable[[OperatorContext, Mapping[str, Any]], Awaitable[None]]


async def _each_object(ctx: OperatorContext, kinds: tuple[str, ...], one: ObjectPass) -> set[str] | None:
    """Run ``one`` over every live object of ``kinds`` in the watched namespaces.

    Returns the uids seen, or None when some list failed (then nobody may be forgotten).
    """
    seen: set[str] | None = set()
    for kind_name in kinds:
        kind = kind_of(f"{GROUP}/{VERSION}", kind_name)
        for ns in ctx.namespaces or [None]:
            try:
                items = await ctx.client().list(kind, ns)  # type: ignore[arg-type]
            except (ApiError, aiohttp.ClientError, TimeoutError) as err:
                log.warning("cannot list %s: %s", kind.plural, err)
                seen = None
                continue
            for body in items:
                body.setdefault("apiVersion", kind.api_version)
                body.setdefault("kind", kind.kind)
                if seen is not None:
                    seen.add(body["metadata"].get("uid", ""))
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    await one(ctx, body)
                except (ApiError, aiohttp.ClientError, TimeoutError, kopf.TemporaryError) as err:
                    log.warning(
                        "%s of %s/%s failed: %s", one.__name__, kind.kind, body["metadata"].get("name"), err
                    )
    return seen


async def _every(
    interval: float, ctx: OperatorContext, body: Callable[[], Awaitable[None]], name: str = ""
) -> None:
    while ctx.connection is None:
        await asyncio.sleep(0.05)
    while True:
        started = time.monotonic()
        try:
            await body()
        except Exception:  # noqa: BLE001 - one bad pass must not stop drift repair for good
            log.exception("periodic pass failed; retrying in %.1f s", interval)
        ctx.heartbeats[name or body.__qualname__] = time.monotonic()
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def stale_loops(ctx: OperatorContext, now: float, grace: float = 120.0) -> list[str]:
    """Periodic loops whose last pass ended longer ago than ``grace`` plus three periods (a
    wedged loop: kopf's liveness endpoint then answers 500 and the kubelet restarts the pod)."""
    periods = {"resync": ctx.config.reconcile_interval, "autoscale": ctx.config.autoscale_interval}
    return [
        f"{name} loop: last pass {now - beat:.0f} s ago"
        for name, beat in sorted(ctx.heartbeats.items())
        if now - beat > grace + 3 * periods.get(name, 0.0)
    ]


async def resync_loop(ctx: OperatorContext) -> None:
    """Controller-style periodic resync over every kuberl object (no finalizers needed).

    kopf timers would do this per object but require a finalizer on each one (so a deleted
    object hangs while the operator is down); a plain loop over LIST results needs none,
    and the children are cleaned up by ownerReferences. An object that a complete pass no
    longer lists was deleted while its DELETED event went unseen: it is forgotten here.
    """

    said = ["", 0.0]  # the last summary line and when it was logged
    bodies: list[dict[str, Any]] = []  # this pass's objects, for the summary line

    async def resync_object_noted(ctx: OperatorContext, body: Mapping[str, Any]) -> None:
        bodies.append(dict(body))
        await resync_object(ctx, body)

    resync_object_noted.__name__ = "resync_object"  # _each_object's warnings name it

    async def one_pass() -> None:
        ctx.client().invalidate()  # one LIST per kind and namespace this pass (operator/runtime/cache.py)
        before = set(ctx.known)  # objects first seen during the pass are not candidates
        bodies.clear()
        seen = await _each_object(ctx, tuple(PLURALS), resync_object_noted)
        if seen is not None:
            for uid in before - seen:
                ctx.forget(uid)
        line = summary_line(bodies)  # on a change, else every SUMMARY_EVERY seconds
        if line != said[0] or time.monotonic() - float(said[1]) >= SUMMARY_EVERY:
            log.info("%s", line)
            said[:] = [line, time.monotonic()]

    await _every(ctx.config.reconcile_interval, ctx, one_pass, "resync")


async def autoscale_loop(ctx: OperatorContext) -> None:
    """Autoscaling at its own pace (``autoscale_interval``), however long the resync period is."""

    async def one_pass() -> None:
        # fresh pods (who is ready to be scraped) and replica counts; children stay cached
        ctx.client().invalidate([kind_of("v1", "Pod")] + [kind_of(f"{GROUP}/{VERSION}", k) for k in PLURALS])
        await _each_object(ctx, SCALED, autoscale_object)

    await _every(ctx.config.autoscale_interval, ctx, one_pass, "autoscale")
