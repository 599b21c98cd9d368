"""Status computation as pure functions: live children in, ``status`` patch out.

Kept apart from the handlers so the phase/condition rules are unit-testable and the same
for the create/update/resume handlers and the periodic timer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuberl.api.common import now_rfc3339
from kuberl.operator.decide.queue import Gate


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the custom resource."""

    type: str  # Normal | Warning
    reason: str
    message: str


def condition(
    type_: str,
    ok: bool | None,
    reason: str,
    message: str,
    generation: int | None,
    previous: list[dict[str, Any]],
) -> dict[str, Any]:
    """A metav1.Condition; lastTransitionTime only moves when the status value flips."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    old = next((c for c in previous if c.get("type") == type_), None)
    when = (
        old["lastTransitionTime"]
        if old and old.get("status") == status and old.get("lastTransitionTime")
        else now_rfc3339()
    )
    out = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": when}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def unschedulable(pods: list[dict[str, Any]]) -> str | None:
    """Why the first of ``pods`` the scheduler cannot place waits (its PodScheduled condition:
    a claim that does not exist, no node with the GPUs, a taint), or None."""
    for pod in sorted(pods, key=lambda p: p["metadata"].get("name", "")):
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return f"pod {pod['metadata'].get('name')} cannot be scheduled: {c.get('message', '').strip()}"
    return None


def scaled_status(
    *,
    desired: int,
    workload: dict[str, Any] | None,
    selector: str,
    generation: int | None,
    previous: dict[str, Any],
    noun: str,
    unschedulable: str | None = None,
) -> dict[str, Any]:
    """Status of a SandboxPool/RolloutFleet from its Deployment (or LeaderWorkerSet).

    ``replicas`` and ``selector`` back the scale subresource (kubectl scale, HPA, KEDA);
    ``unschedulable`` is why a pod of it waits for a node (:func:`unschedulable`).
    """
    st = (workload or {}).get("status") or {}
    replicas = int(st.get("replicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    prev_conds = list(previous.get("conditions") or [])
    # The ReplicaSet controller's refusal to create pods (a ResourceQuota, Pod Security admission)
    # is copied onto the Deployment as ReplicaFailure; without it the owner would just say
    # "0/N ready" for ever.
    refused = next(
        (
            c
            for c in st.get("conditions") or []
            if c.get("type") == "ReplicaFailure" and c.get("status") == "True"
        ),
        None,
    )
    wgen = ((workload or {}).get("metadata") or {}).get("generation")
    stale = wgen is not None and st.get("observedGeneration") is not None and st["observedGeneration"] < wgen
    if workload is None:
        phase, ok, reason, msg = (
            "Pending",
            False,
            "WorkloadMissing",
            f"the {noun} workload does not exist yet",
        )
    elif refused is not None:
        phase, ok = "Degraded", False
        reason = refused.get("reason") or "ReplicaFailure"
        msg = (
            f"{ready}/{desired} {noun} replicas ready; {workload.get('kind')}/"
            f"{workload.get('metadata', {}).get('name')} cannot create pods: {refused.get('message', '')}"
        )
    elif stale:
        # Ready counts of the previous generation say nothing about the spec just applied.
        phase, ok, reason = "Progressing", False, "RolloutPending"
        msg = f"the {noun} workload has not yet observed generation {wgen} (status is of {st['observedGeneration']})"
    elif ready >= desired and replicas <= desired:
        phase = "Ready"
        ok, reason, msg = True, "AllReplicasReady", f"{ready}/{desired} {noun} replicas ready"
    else:
        phase = "Progressing" if ready > 0 or desired > 0 else "Pending"
        ok, reason, msg = False, "ReplicasNotReady", f"{ready}/{desired} {noun} replicas ready"
        if unschedulable:
            reason, msg = "Unschedulable", f"{msg}; {unschedulable}"
    return {
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector,
        "observedGeneration": generation,
        "conditions": [condition("Ready", ok, reason, msg, generation, prev_conds)],
    }


def invalid_status(message: str, generation: int | None, previous: dict[str, Any]) -> dict[str, Any]:
    prev_conds = list(previous.get("conditions") or [])
    return {
        "phase": "Invalid",
        "observedGeneration": generation,
        "conditions": [condition("Ready", False, "InvalidSpec", message, generation, prev_conds)],
    }


def _job_condition(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def pod_failure_message(pods: list[dict[str, Any]]) -> str:
    """The most useful line about why trainer pods failed (reason, exit code, last log lines)."""
    lines = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Failed":
            continue
        name = pod.get("metadata", {}).get("name", "?")
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term:
                detail = f"{term.get('reason', 'Error')} (exit {term.get('exitCode', '?')})"
                if term.get("message"):
                    detail += f": {term['message'].strip()[-300:]}"
                lines.append(f"pod {name}: {detail}")
        if not lines and (pod.get("status") or {}).get("message"):
            lines.append(f"pod {name}: {pod['status']['message']}")
    return "; ".join(lines)


def failed_trainer_message(trainer: dict[str, Any] | None, pods: list[dict[str, Any]]) -> str | None:
    """Why the trainer Job failed (its Failed condition and the pods' reasons), None if it did not."""
    failed = _job_condition(trainer or {}, "Failed")
    if failed is None:
        return None
    msg = f"{failed.get('reason', 'Failed')}: {failed.get('message', 'trainer failed')}"
    detail = pod_failure_message(pods)
    return f"{msg}; {detail}" if detail else msg


def job_status(
    *,
    trainer: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    suspended: bool,
    waiting_for: list[str],
    generation: int | None,
    previous: dict[str, Any],
    progress: dict[str, Any] | None = None,
    queue: Gate | None = None,
) -> dict[str, Any]:
    """Phase of an AgenticRLJob from its trainer Job and pods.

    Phases: Waiting (a referenced fleet/pool is missing), Queued (Kueue has not admitted it),
    Pending, Running, Suspended (spec.suspend, or Kueue took its admission away), Succeeded,
    Failed. Succeeded/Failed are terminal: the operator stops recreating children. ``queue``:
    the gate of a job with Kueue's queue-name label (``decide.queue``).
    """
    prev_conds = list(previous.get("conditions") or [])
    out: dict[str, Any] = {"observedGeneration": generation}
    st = (trainer or {}).get("status") or {}
    complete, failed = (_job_condition(trainer or {}, "Complete"), _job_condition(trainer or {}, "Failed"))
    conds: list[dict[str, Any]] = []
    if previous.get("phase") in ("Succeeded", "Failed") and trainer is None:
        return {}  # terminal and already reported; children may be gone on purpose
    if waiting_for:
        out["phase"] = "Waiting"
        msg = "waiting for " + ", ".join(waiting_for)
        conds.append(condition("Ready", False, "DependencyMissing", msg, generation, prev_conds))
    elif failed:
        out["phase"] = "Failed"
        detail = pod_failure_message(pods)
        msg = f"{failed.get('reason', 'Failed')}: {failed.get('message', 'trainer failed')}"
        if detail:
            msg += f"; {detail}"
        conds.append(
            condition("Failed", True, failed.get("reason") or "TrainerFailed", msg, generation, prev_conds)
        )
        conds.append(condition("Ready", False, "TrainerFailed", msg, generation, prev_conds))
        out["completionTime"] = failed.get("lastTransitionTime") or now_rfc3339()
    elif complete:
        out["phase"] = "Succeeded"
        msg = f"all {st.get('succeeded', 0)} trainer pods completed"
        conds.append(condition("Complete", True, "TrainerSucceeded", msg, generation, prev_conds))
        conds.append(condition("Ready", False, "Completed", msg, generation, prev_conds))
        out["completionTime"] = st.get("completionTime") or now_rfc3339()
    elif suspended:
        out["phase"] = "Suspended"
        conds.append(
            condition("Suspended", True, "Suspended", "spec.suspend is true", generation, prev_conds)
        )
        conds.append(condition("Ready", False, "Suspended", "spec.suspend is true", generation, prev_conds))
    elif queue is not None and not queue.admitted:
        out["phase"] = queue.phase
        conds.append(condition("Suspended", True, queue.reason, queue.message, generation, prev_conds))
        conds.append(condition("Ready", False, queue.reason, queue.message, generation, prev_conds))
    elif trainer is None:
        out["phase"] = "Pending"
        conds.append(
            condition("Ready", False, "TrainerMissing", "trainer Job not created yet", generation, prev_conds)
        )
    else:
        # Job.status.active counts pods still Pending too: a trainer runs once its pods are
        # Ready, and is Ready once every rank is (torchrun waits for all of them).
        active = int(st.get("active") or 0)
        ready = int(st.get("ready") or 0)
        expected = int(((trainer or {}).get("spec") or {}).get("parallelism") or 1)
        out["phase"] = "Running" if ready > 0 else "Pending"
        msg = f"{ready} of {expected} trainer pods ready ({active} active)"
        all_ready = ready >= expected
        reason = "TrainerReady" if all_ready else "TrainerPending"
        if not all_ready and (why := unschedulable(pods)):
            reason, msg = "Unschedulable", f"{msg}; {why}"
        conds.append(condition("Ready", all_ready, reason, msg, generation, prev_conds))
        resumed = "spec.suspend is false" + (f"; {queue.message}" if queue is not None else "")
        conds.append(condition("Suspended", False, "Resumed", resumed, generation, prev_conds))
    if st.get("startTime"):
        out["startTime"] = st["startTime"]
    out["conditions"] = conds
    if progress:
        out.update(progress)
    return out


def engines_condition(
    gaps: dict[str, float],
    tolerance: float | None,
    generation: int | None,
    previous: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """``EnginesInStep``: False while the trainer's spot check finds an engine further from the
    trained policy than ``rollout.spotCheckTolerance`` (it serves other weights than were pushed
    to it: a restarted replica, a failed reload); None when nothing was checked or the check is off."""
    if tolerance is None or not gaps:
        return None
    out = {name: gap for name, gap in sorted(gaps.items()) if gap > tolerance}
    if out:
        listed = ", ".join(f"{name} ({gap:.3f})" for name, gap in out.items())
        msg = (
            f"engines serving other weights than were pushed (mean |engine - trainer| log-prob above "
            f"{tolerance:g} nats/token): {listed}; restart them"
        )
        return condition("EnginesInStep", False, "EngineWeightsDiffer", msg, generation, previous)
    msg = f"{len(gaps)} engines within {tolerance:g} nats/token of the trained policy"
    return condition("EnginesInStep", True, "SpotCheckPassed", msg, generation, previous)


def transition_events(kind: str, old_phase: str | None, new_status: dict[str, Any]) -> list[Event]:
    """One event per phase change, Warning for the bad ones, with the Ready message."""
    new_phase = new_status.get("phase")
    if not new_phase or new_phase == old_phase:
        return []
    ready = next((c for c in new_status.get("conditions", []) if c["type"] in ("Failed", "Ready")), None)
    message = f"{kind} is {new_phase}" + (f": {ready['message']}" if ready and ready.get("message") else "")
    bad = new_phase in ("Invalid", "Failed", "Waiting", "Degraded")
    return [Event("Warning" if bad else "Normal", new_phase, message)]
