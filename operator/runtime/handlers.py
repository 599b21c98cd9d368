"""Reconcile AgenticRLJob, RolloutFleet and SandboxPool into running pods: one pass over one
object (the operator's memory of the objects is ``context.OperatorContext``).

``registry.build_registry(config)`` binds these to kopf's events on a fresh
``kopf.OperatorRegistry`` (not kopf's global one), so the CLI and each end-to-end test get their
own operator with their own timings, login and metrics scraper.

Per custom resource:

* create / update / resume -> ``reconcile``: build the children (``builders``), adopt them
  (ownerReferences, namespace), apply each one (``KubeClient.apply``: create, or a three-way
  merge patch that also removes what kuberl set before and no longer wants), delete children
  the spec no longer builds (found by instance label + owner uid), and write ``status``
  (phase, conditions, observedGeneration; replicas and selector for the scale subresource).
  An invalid spec is not retried: it gets phase ``Invalid``, a Ready=False condition with
  the field-level message and a Warning event. Every phase transition is an Event.
* ``resync_loop`` (every ``reconcile_interval``; ``loops.py``) runs the same reconcile over every object:
  drift repair (a deleted child is recreated, a hand-edited one patched back) and status
  refresh from the children (readiness, trainer completion/failure). Objects without
  ``status.observedGeneration`` have not been handled yet (kopf's create handler may still be
  queued): their children are created without "was missing" warnings.
* ``autoscale_loop`` (every ``autoscale_interval``, independent of the resync; ``loops.py``) scales pools
  and fleets with ``spec.autoscaling``: scrape each ready pod's /metrics, decide with
  ``autoscale.decide``, write the scale subresource (as an HPA would); skipped for
  ``kuberl.io/autoscaler: keda``. The stabilization window lives in
  ``status.recommendations``, so a restart cannot scale down early.
* a job's inline fleet/pool that autoscales keeps the autoscaler's replica count: the job
  writes ``spec.replicas`` only on create and suspend/resume (``children.inline_replicas``).
* no finalizers: every child carries an ownerReference, so Kubernetes' garbage collector
  removes them when the owner goes. The operator's memory of an object (last phase, lock,
  metric series) is dropped on its DELETED watch event (``kopf.on.event``; a
  ``kopf.on.delete`` handler would need kopf's finalizer to ever run) and, as a fallback, when
  a full resync no longer lists it. (kopf timers would add a finalizer to every object, which
  is why the resync and autoscale loops are plain loops.)
* optional validating/mutating admission (``admission.py``) when a webhook server is set.
* a job labelled ``kueue.x-k8s.io/queue-name`` runs only while Kueue admits its Workload
  (``queueing.py``; held as if suspended otherwise, with the assigned flavors once admitted).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf
from pydantic import ValidationError

from kuberl.api import AgenticRLJob, ManifestError, Resource, RolloutFleet, SandboxPool, parse_resource
from kuberl.api.group import GROUP, VERSION
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.operator.decide import children, conditions, queue, status
from kuberl.operator.render import builders, isolation, job_builder, keda, render_common, trainer_runs
from kuberl.operator.render import workload as workload_render
from kuberl.operator.runtime import metrics, queueing
from kuberl.operator.runtime.context import SCALED, TERMINAL, OperatorContext
from kuberl.operator.runtime.kube import ApiError, kind_of
from kuberl.operator.runtime.pods import engine_gaps, ready_pods, scrape_pods, train_progress
from kuberl.operator.validate import admission, checks

log = logging.getLogger("kuberl.operator")
# --- reconcile -----------------------------------------------------------------------------


def parse_body(body: Mapping[str, Any]) -> Resource:
    """The kuberl model of an object as the API serves it (metadata trimmed to what kuberl reads)."""
    raw = dict(body)
    meta = dict(raw.get("metadata") or {})
    doc = {
        "apiVersion": raw.get("apiVersion"),
        "kind": raw.get("kind"),
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "labels", "annotations", "generation", "uid")
            if k in meta
        },
        "spec": raw.get("spec") or {},
    }
    return parse_resource(doc, source="cluster")


def _workload_ref(objs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((o for o in objs if o["kind"] in ("Deployment", "LeaderWorkerSet")), None)


Adjust = Callable[[dict[str, Any], dict[str, Any] | None], dict[str, Any]]


async def _apply_all(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    objs: list[dict[str, Any]],
    first_time: bool,
    adjust: Callable[[dict[str, Any]], Adjust | None] = lambda _: None,
) -> tuple[dict[tuple[str, str], dict[str, Any]], list[status.Event], list[conditions.ChildFailure]]:
    """Apply every child; a refused one is recorded (``conditions``) and the others still go."""
    client = ctx.client()
    kopf.adopt(objs, owner=kopf.Body(dict(body)))
    live: dict[tuple[str, str], dict[str, Any]] = {}
    events: list[status.Event] = []
    failures: list[conditions.ChildFailure] = []
    for obj in objs:
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            action, current = await client.apply(obj, adjust=adjust(obj))
        except ApiError as err:
            if err.status == 422 and obj["kind"] == "Job":
                # batch/v1 pod templates are immutable: replace the trainer; it resumes from
                # its last checkpoint. The next reconcile creates the new one.
                await client.delete(
                    kind_of("batch/v1", "Job"), obj["metadata"]["namespace"], obj["metadata"]["name"]
                )
                events.append(status.Event("Normal", "TrainerReplaced", f"{what} spec changed; replacing it"))
                continue
            log.warning("cannot apply %s: %s", what, err)
            failures.append(conditions.failure_from_api(obj, err.status, err.reason, err.message))
            continue
        live[obj["kind"], obj["metadata"]["name"]] = current
        if action == "created" and not first_time:
            events.append(
                status.Event("Warning", "ChildRecreated", f"{what} was missing and has been recreated")
            )
        elif action == "updated":
            events.append(status.Event("Normal", "ChildUpdated", f"{what} updated to match the spec"))
    return live, events, failures


def _refusal_events(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    failures: list[conditions.ChildFailure],
    previous: dict[str, Any],
) -> list[status.Event]:
    """Warnings for refusals not yet reported; a refusal that went away may be reported again."""
    uid = body.get("metadata", {}).get("uid", "")
    events = conditions.failure_events(failures, previous, ctx.refusals.get(uid, set()))
    ctx.refusals[uid] = {f.line() for f in failures}
    return events


async def _prune(
    ctx: OperatorContext, body: Mapping[str, Any], wanted: list[dict[str, Any]]
) -> list[status.Event]:
    """Delete children this object created earlier that its spec no longer builds."""
    client = ctx.client()
    meta = body["metadata"]
    keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    live: list[dict[str, Any]] = []
    for api_version, kind_name in render_common.CHILD_KINDS.get(body["kind"], ()):
        kind = kind_of(api_version, kind_name)
        try:
            found = await client.list(kind, meta["namespace"], {render_common.LABEL_INSTANCE: meta["name"]})
        except ApiError as err:
            if err.status == 404:  # the kind is not installed (no LeaderWorkerSet CRD): nothing to prune
                continue
            raise
        live += [{**o, "apiVersion": api_version, "kind": kind_name} for o in found]
    events = []
    for obj in children.orphans(live, keep, meta.get("uid", "")):
        name = obj["metadata"]["name"]
        if await client.delete(kind_of(obj["apiVersion"], obj["kind"]), meta["namespace"], name):
            events.append(
                status.Event(
                    "Normal", "ChildDeleted", f"{obj['kind']}/{name} is no longer in the spec; deleted"
                )
            )
    return events


def _adjust(obj: dict[str, Any]) -> Adjust | None:
    """What apply must settle against the live child: a pool's token Secret keeps its token
    (or gets a fresh one); a job's inline fleet/pool leaves spec.replicas to its autoscaler."""
    if obj["kind"] == "Secret":
        return isolation.fill_token
    if obj["kind"] not in SCALED:
        return None

    def adjust(desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
        replicas = children.inline_replicas(desired["spec"], (live or {}).get("spec"))
        return {**desired, "spec": {**desired["spec"], "replicas": replicas}}

    return adjust


def _adjust_held(stopping: bool) -> Callable[[dict[str, Any]], Adjust | None]:
    """For a held (suspended or not admitted) job: its inline fleet/pool keep their size while
    trainer pods are ``stopping`` (``children.held_spec``), and its trainer Job keeps the node
    selector and tolerations it has: the template of a Job that ran may not change (the API
    server refuses it with 422, and the Job would be replaced), and a queued job's next
    admission sets them."""
    return functools.partial(_adjust_held_child, stopping)


def _held_child(stopping: bool, desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    return {**desired, "spec": children.held_spec(desired["spec"], (live or {}).get("spec"), stopping)}


def _adjust_held_child(stopping: bool, obj: dict[str, Any]) -> Adjust | None:
    if obj["kind"] in SCALED:
        return functools.partial(_held_child, stopping)
    if obj["kind"] != "Job":
        return _adjust(obj)

    def adjust(desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
        kept = ((((live or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
        if not kept:
            return desired
        out = copy.deepcopy(desired)
        pod = out["spec"]["template"].setdefault("spec", {})
        for key in ("nodeSelector", "tolerations"):
            if key in kept:
                pod[key] = kept[key]
        return out

    return adjust


async def reconcile(
    ctx: OperatorContext, body: Mapping[str, Any], *, first_time: bool
) -> tuple[dict[str, Any], list[status.Event]]:
    """Bring one custom resource's children in line with its spec; return (status, events).

    Serialized per object: the change handlers and the resync loop may both get here.
    """
    uid = body.get("metadata", {}).get("uid", "")
    ctx.remember(body)
    async with ctx.lock(uid):
        kind = body["kind"]
        previous = dict(body.get("status") or {})
        generation = body.get("metadata", {}).get("generation")
        old_phase = ctx.phases.get(uid, previous.get("phase"))
        try:
            res = parse_body(body)
        except ManifestError as err:
            new = status.invalid_status(str(err).removeprefix("cluster: "), generation, previous)
            events: list[status.Event] = []
        else:
            namespace = body["metadata"]["namespace"]
            if isinstance(res, AgenticRLJob):
                new, events = await _reconcile_job(
                    ctx, body, res, namespace, previous, generation, first_time
                )
            else:
                new, events = await _reconcile_scaled(
                    ctx, body, res, namespace, previous, generation, first_time
                )
        events = events + status.transition_events(kind, old_phase, new)
        if new.get("phase"):
            ctx.phases[uid] = new["phase"]
            if new["phase"] in TERMINAL:
                ctx.finished[uid] = generation
        return new, events


def pod_selector(res: SandboxPool | RolloutFleet) -> dict[str, str]:
    """Labels of a pool's or fleet's serving pods (what readiness, scraping and scale read)."""
    if isinstance(res, RolloutFleet):
        return builders.engine_selector(res)
    return render_common.selector_labels(res.metadata.name, "sandbox")


def _autoscaled_here(res: SandboxPool | RolloutFleet) -> bool:
    return res.spec.autoscaling is not None and not keda.wants_keda(res)


async def _reconcile_scaled(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    res: SandboxPool | RolloutFleet,
    namespace: str,
    previous: dict[str, Any],
    generation: int | None,
    first_time: bool,
) -> tuple[dict[str, Any], list[status.Event]]:
    problems = checks.rendered_problems(res, namespace)
    if problems:
        return status.invalid_status(conditions.invalid_children_message(problems), generation, previous), []
    if "replicas" not in (body.get("spec") or {}):
        # The CRD leaves replicas unset (its default depends on autoscaling), but the scale
        # subresource (kubectl scale, HPA, KEDA) cannot read a resource without it.
        kind = kind_of(f"{GROUP}/{VERSION}", res.KIND)
        await ctx.client().patch(kind, namespace, res.metadata.name, {"spec": {"replicas": res.spec.replicas}})
    objs = builders.build_for(res, namespace)
    objs = [o for o in objs if o["kind"] != "ScaledObject"]  # KEDA objects are rendered, not applied
    component = "sandbox" if isinstance(res, SandboxPool) else "rollout"
    live, events, failures = await _apply_all(
        ctx, body, objs, first_time and not previous.get("phase"), adjust=_adjust
    )
    events += await _prune(ctx, body, objs)
    ref = _workload_ref(objs)
    workload = live.get((ref["kind"], ref["metadata"]["name"])) if ref else None
    sel = pod_selector(res)
    ready = int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)
    waiting = None
    if workload is not None and ready < res.spec.replicas:
        waiting = status.unschedulable(await ctx.client().list(kind_of("v1", "Pod"), namespace, sel))
    new = status.scaled_status(
        desired=res.spec.replicas,
        workload=workload,
        selector=render_common.selector_string(sel),
        generation=generation,
        previous=previous,
        noun="sandbox" if component == "sandbox" else "engine",
        unschedulable=waiting,
    )
    if isinstance(res, RolloutFleet):
        pods = await ready_pods(ctx.client(), namespace, sel)
        new["engines"] = sorted(f"{p['status']['podIP']}:{res.spec.engine.port}" for p in pods)
    desired = res.spec.replicas
    if _autoscaled_here(res) and isinstance(previous.get("desiredReplicas"), int):
        desired = previous["desiredReplicas"]
    metrics.record(namespace, res.KIND, res.metadata.name, desired=desired, ready=new["readyReplicas"])
    events += _refusal_events(ctx, body, failures, previous)
    return conditions.with_child_failures(new, failures, generation, previous), events


async def _reconcile_job(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    job: AgenticRLJob,
    namespace: str,
    previous: dict[str, Any],
    generation: int | None,
    first_time: bool,
) -> tuple[dict[str, Any], list[status.Event]]:
    client = ctx.client()
    name = job.metadata.name
    events: list[status.Event] = []
    trainer_name = job_builder.trainer_name(name)
    uid = body.get("metadata", {}).get("uid", "")
    # Also from memory: a pass may still hold a body read before the terminal status was written.
    finished = (
        previous.get("phase") in TERMINAL and previous.get("observedGeneration") == generation
    ) or (ctx.finished.get(uid) == generation and generation is not None)
    if finished:
        # Terminal: no trainer is recreated; the job-owned fleet and pool are released.
        for kind, child in (
            ("RolloutFleet", job_builder.inline_fleet_name(name)),
            ("SandboxPool", job_builder.inline_pool_name(name)),
        ):
            if await client.delete(kind_of(f"{GROUP}/{VERSION}", kind), namespace, child):
                events.append(
                    status.Event("Normal", "Released", f"{kind}/{child} deleted: the job has finished")
                )
        if workload_render.queue_name(job.metadata.labels):  # its quota goes back to the queue
            done = previous.get("phase") == "Succeeded"
            await queueing.finish(ctx, namespace, name, done, f"the job is {previous.get('phase')}")
        return {}, events

    waiting: list[str] = []
    rollout, sandbox = job.spec.rollout, job.spec.sandbox
    fleet_spec: RolloutFleetSpec | None = None
    if rollout.fleet_ref and job_builder.uses_fleet(job):
        fleet = await client.get(kind_of(f"{GROUP}/{VERSION}", "RolloutFleet"), namespace, rollout.fleet_ref)
        if fleet is None:
            waiting.append(
                f"RolloutFleet {namespace}/{rollout.fleet_ref} (spec.rollout.fleetRef) which does not exist"
            )
        else:
            waiting += [
                f"RolloutFleet {namespace}/{rollout.fleet_ref} (spec.rollout.fleetRef) {problem}"
                for problem in admission.context_length_problems(job, fleet)
            ]
            try:  # its scheduler policy and weightSync volume go into the trainer pods
                fleet_spec = RolloutFleetSpec.model_validate(fleet.get("spec") or {})
            except ValidationError as err:
                waiting.append(
                    f"RolloutFleet {namespace}/{rollout.fleet_ref} (spec.rollout.fleetRef) to be valid ({err})"
                )
    if sandbox.pool_ref:
        if (
            await client.get(kind_of(f"{GROUP}/{VERSION}", "SandboxPool"), namespace, sandbox.pool_ref)
            is None
        ):
            waiting.append(
                f"SandboxPool {namespace}/{sandbox.pool_ref} (spec.sandbox.poolRef) which does not exist"
            )

    problems = checks.rendered_problems(job, namespace, fleet=fleet_spec)
    if problems:
        return status.invalid_status(conditions.invalid_children_message(problems), generation, previous), events
    built = builders.build_for(job, namespace, fleet=fleet_spec)
    gate, workload, queued_events = None, None, []
    if workload_render.queue_name(job.metadata.labels):
        gate, workload, built, queued_events = await _through_queue(ctx, body, job, namespace, built, fleet_spec)
    held = job.spec.suspend or (gate is not None and not gate.admitted)
    # The trainer would only crash-loop without its dependencies: hold it back (but keep one
    # that already runs: the reference may come back).
    objs = [o for o in built if o["kind"] != "Job"] if waiting else built
    # read fresh, not from the pass's cache: a trainer pod that started since the cache was loaded
    # would be missed, and its pool scaled to zero under its last step
    stopping = held and children.trainers_stopping(
        await client.list(
            kind_of("v1", "Pod"), namespace, render_common.selector_labels(name, "trainer"), fresh=True
        )
    )
    live, events, failures = await _apply_all(
        ctx, body, objs, first_time and not previous.get("phase"), adjust=_adjust_held(stopping) if held else _adjust
    )
    events = queued_events + events
    events += await _prune(ctx, body, built)
    trainer = live.get(("Job", trainer_name))
    labels = render_common.selector_labels(name, "trainer")
    pods = await client.list(kind_of("v1", "Pod"), namespace, labels) if trainer is not None else []
    progress: dict[str, Any] = {}
    gaps: dict[str, float] = {}
    running = [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and (p.get("status") or {}).get("podIP")
    ]
    if running:
        texts = await scrape_pods(ctx.scrape, running[:1], ("metrics",))
        if texts:
            progress = train_progress(texts[0], name)
            gaps = engine_gaps(texts[0], name)
    if trainer is not None and conditions.trainer_short_of_pods(trainer):
        found = await client.list(
            kind_of("v1", "Event"),
            namespace,
            fields={"involvedObject.kind": "Job", "involvedObject.name": trainer_name, "reason": "FailedCreate"},
        )
        refusal = conditions.latest_failed_create(trainer, found)
        failures += [refusal] if refusal is not None else []
    restarts = max(int(previous.get("restarts") or 0), ctx.restarts.get(uid, 0))
    failed = status.failed_trainer_message(trainer, pods)
    if failed is not None:
        decision = trainer_runs.restart_decision(failed, restarts, job.spec.trainer.max_restarts)
        if decision.restart:
            # The whole trainer goes (a distributed step cannot lose a rank); the next pass
            # creates it again and it resumes from the checkpoint volume.
            await client.delete(kind_of("batch/v1", "Job"), namespace, trainer_name)
            ctx.restarts[uid] = restarts = decision.restarts
            events.append(status.Event("Warning", "TrainerRestarted", decision.message))
            trainer, pods = None, []
    if gate is not None and gate.evicted and workload is not None:
        events += await queueing.release_if_stopped(ctx, namespace, workload, pods)
    new = status.job_status(
        trainer=trainer,
        pods=pods,
        suspended=job.spec.suspend,
        waiting_for=waiting,
        generation=generation,
        previous=previous,
        progress=progress,
        queue=gate,
    )
    if gate is not None and new.get("phase") in TERMINAL:
        ready = next((c for c in new.get("conditions", []) if c["type"] in ("Complete", "Failed")), {})
        await queueing.finish(ctx, namespace, name, new["phase"] == "Succeeded", ready.get("message", ""))
    if restarts and new:
        new["restarts"] = restarts
    in_step = status.engines_condition(
        gaps, job.spec.rollout.spot_check_tolerance, generation, list(previous.get("conditions") or [])
    )
    if in_step is not None and new.get("phase") == "Running":
        new["conditions"].append(in_step)
        if in_step["status"] == "False" and not any(
            c.get("type") == "EnginesInStep" and c.get("status") == "False" for c in previous.get("conditions") or []
        ):
            events.append(status.Event("Warning", "EngineWeightsDiffer", in_step["message"]))
    events += _refusal_events(ctx, body, failures, previous)
    return conditions.with_child_failures(new, failures, generation, previous), events


async def _through_queue(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    job: AgenticRLJob,
    namespace: str,
    built: list[dict[str, Any]],
    fleet_spec: RolloutFleetSpec | None,
) -> tuple[queue.Gate | None, dict[str, Any] | None, list[dict[str, Any]], list[status.Event]]:
    """A job with Kueue's queue-name label: its children as its Workload's admission allows
    (held as if suspended until admitted; with the assigned flavors once admitted)."""
    if job.spec.suspend:  # the user's suspend: the job leaves the queue and frees its quota
        return None, None, built, await queueing.release_suspended(ctx, namespace, job.metadata.name)
    live, events, unavailable = await queueing.workload_for(ctx, body, job, namespace, built)
    gate = queue.gate(live) if unavailable is None else queue.Gate(False, "KueueUnavailable", unavailable)
    if gate.admitted and live is not None:
        return gate, live, workload_render.with_flavors(built, await queueing.placement(ctx, live)), events
    held = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    return gate, live, builders.build_for(held, namespace, fleet=fleet_spec), events


# --- events ------------------------------------------------------------------------------------


async def post_events(ctx: OperatorContext, body: Mapping[str, Any], events: list[status.Event]) -> None:
    """Record core/v1 Events on the custom resource (best effort: a lost event is only logged)."""
    meta = body.get("metadata", {})
    for ev in events:
        now = status.now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "generateName": f"{meta.get('name', 'kuberl')}.",
                "namespace": meta.get("namespace"),
            },
            "involvedObject": {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": ev.type,
            "reason": ev.reason,
            "message": ev.message[:1024],
            "source": {"component": "kuberl-operator"},
            "reportingComponent": "kuberl-operator",
            "reportingInstance": "kuberl-operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await ctx.client().create(event)
        except (ApiError, aiohttp.ClientError) as err:
            log.warning(
                "could not post event %s on %s/%s: %s", ev.reason, body.get("kind"), meta.get("name"), err
            )
