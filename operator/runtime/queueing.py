"""A queued AgenticRLJob's Workload on the cluster: created and owned by the job, read for its
admission, released after an eviction, finished with the job (pure parts: ``render.workload``,
``decide.queue``). Kueue's API is read only for jobs with the queue-name label, so a cluster
without Kueue runs every other job as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kuberl.api import AgenticRLJob
from kuberl.operator.decide import queue
from kuberl.operator.decide.status import Event
from kuberl.operator.render import workload as wl
from kuberl.operator.runtime.context import OperatorContext
from kuberl.operator.runtime.kube import ApiError, kind_of

log = logging.getLogger("kuberl.operator")

WORKLOAD = kind_of(wl.API_VERSION, "Workload")
FLAVOR = kind_of(wl.API_VERSION, "ResourceFlavor")
PRIORITY_CLASS = kind_of(wl.API_VERSION, "WorkloadPriorityClass")


async def _priority(ctx: OperatorContext, name: str | None) -> tuple[int | None, list[Event]]:
    if not name:
        return None, []
    found = await ctx.client().get(PRIORITY_CLASS, "", name)
    if found is None:
        return 0, [Event("Warning", "PriorityClassMissing",
                         f"WorkloadPriorityClass {name} (label {wl.PRIORITY_LABEL}) does not exist; priority 0")]
    return int(found.get("value") or 0), []


async def workload_for(
    ctx: OperatorContext, body: Mapping[str, Any], job: AgenticRLJob, namespace: str, built: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, list[Event], str | None]:
    """The job's live Workload, created (or replaced, when the job's shape changed) first; and
    why there can be none (Kueue not installed, the operator not allowed), else None."""
    client = ctx.client()
    labels = job.metadata.labels or {}
    queue_name = wl.queue_name(labels) or ""
    priority_class = labels.get(wl.PRIORITY_LABEL)
    events: list[Event] = []
    try:
        priority, missing = await _priority(ctx, priority_class)
        desired = wl.build_workload(job.metadata.name, namespace, queue_name, wl.pod_sets(built, namespace),
                                    priority_class, priority)
        name = desired["metadata"]["name"]
        live = await client.get(WORKLOAD, namespace, name, fresh=True)
        if live is not None and (live["metadata"].get("annotations") or {}).get(wl.SHAPE_ANNOTATION) != \
                desired["metadata"]["annotations"][wl.SHAPE_ANNOTATION]:
            await client.delete(WORKLOAD, namespace, name)
            events.append(Event("Normal", "WorkloadReplaced",
                                f"Workload {name}: the job's pods, queue or priority changed; it asks Kueue again"))
            return None, events, None  # the next pass creates it once the old one is gone
        if live is None:
            kopf.adopt([desired], owner=kopf.Body(dict(body)))
            try:
                live = await client.create(desired)
            except ApiError as err:
                if err.status == 409:  # the replaced one is still being deleted
                    return None, events, None
                raise
            events += missing  # said once, when the Workload is made
            events.append(Event("Normal", "Queued", f"Workload {name} created in LocalQueue {queue_name}"))
    except ApiError as err:
        if err.status == 404:
            return None, events, (f"the cluster does not serve Kueue's Workloads ({err.message}): install Kueue, "
                                  f"or remove the label {wl.QUEUE_LABEL}")
        if err.status == 403:
            return None, events, (f"the operator may not use Kueue's API ({err.message}): install the chart "
                                  "with kueue.enabled=true")
        raise
    return live, events, None


async def placement(ctx: OperatorContext, workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod set -> nodeSelector and tolerations of the flavors Kueue assigned."""
    flavors = {}
    for name in queue.assigned_flavors(workload):
        found = await ctx.client().get(FLAVOR, "", name)
        flavors[name] = (found or {}).get("spec") or {}
    return queue.placement(workload, flavors)


async def release_if_stopped(
    ctx: OperatorContext, namespace: str, workload: dict[str, Any], trainer_pods: list[dict[str, Any]]
) -> list[Event]:
    """After an eviction: once no trainer pod is left, give the admission back to Kueue."""
    if trainer_pods:
        return []
    name = workload["metadata"]["name"]
    try:
        await ctx.client().patch(WORKLOAD, namespace, name, queue.release_patch(workload), sub="status")
    except ApiError as err:
        if err.status in (404, 409):  # gone, or changed since read: the next pass decides again
            return []
        raise
    return [Event("Normal", "QuotaReleased", f"Workload {name}: the trainer stopped; its quota is given back")]


async def finish(ctx: OperatorContext, namespace: str, job_name: str, succeeded: bool, message: str) -> None:
    """Mark the job's Workload Finished (frees its quota); nothing when there is none."""
    name = wl.workload_name(job_name)
    live = await ctx.client().get(WORKLOAD, namespace, name, fresh=True)
    patch = queue.finish_patch(live, succeeded, message) if live is not None else None
    if patch is None:
        return
    try:
        await ctx.client().patch(WORKLOAD, namespace, name, patch, sub="status")
    except ApiError as err:
        if err.status not in (404, 409):
            raise


async def release_suspended(ctx: OperatorContext, namespace: str, job_name: str) -> list[Event]:
    """A job suspended by its user leaves the queue: its Workload goes (and its quota with it)."""
    name = wl.workload_name(job_name)
    if await ctx.client().delete(WORKLOAD, namespace, name):
        return [Event("Normal", "Dequeued", f"Workload {name} deleted: spec.suspend is true")]
    return []

