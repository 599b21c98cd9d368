"""What a queued AgenticRLJob may run, read off its Kueue Workload, and the Workload status
writes the external-framework contract leaves to the job's controller.

* :func:`gate`: admitted (run), or held (queued, or evicted: preempted, deactivated, ...) with
  Kueue's own reason and message for the job's ``Suspended`` condition;
* :func:`placement`: the node labels and tolerations of the flavors Kueue assigned, per pod set;
* :func:`release_patch`: once an evicted job's trainer pods are gone, the admission is given back
  (QuotaReserved=False, Requeued after a preemption), as Kueue's own job reconciler does;
* :func:`finish_patch`: a finished job's Workload is Finished, which frees its quota.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Gate:
    """``admitted``: the job runs; else ``reason``/``message`` say why not (Kueue's words).
    ``evicted``: Kueue withdrew an admission the job still holds; it must stop, then release."""

    admitted: bool
    reason: str
    message: str
    evicted: bool = False

    @property
    def phase(self) -> str:
        """Queued until first admitted; Suspended once an admission was taken away."""
        return "Queued" if self.reason in ("Queued", "Pending", "Inadmissible", "KueueUnavailable") else "Suspended"


def _conds(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((workload.get("status") or {}).get("conditions") or [])}


def _true(cond: dict[str, Any] | None) -> bool:
    return bool(cond) and cond.get("status") == "True"  # type: ignore[union-attr]


def gate(workload: dict[str, Any] | None) -> Gate:
    """The job's gate from its Workload (None: not created yet, so not admitted)."""
    if workload is None:
        return Gate(False, "Queued", "waiting for Kueue to see the job's Workload")
    conds = _conds(workload)
    admission = (workload.get("status") or {}).get("admission")
    evicted = conds.get("Evicted")
    if _true(evicted):
        reason = evicted.get("reason") or "Evicted"  # type: ignore[union-attr]
        return Gate(False, reason, f"evicted by Kueue ({reason}): {evicted.get('message', '')}",  # type: ignore[union-attr]
                    evicted=admission is not None)
    if _true(conds.get("Admitted")) and admission is not None:
        cq = admission.get("clusterQueue", "?")
        return Gate(True, "Admitted", f"admitted by ClusterQueue {cq}")
    waiting = conds.get("QuotaReserved") or {}
    msg = waiting.get("message") or "waiting for Kueue to reserve quota"
    requeued = conds.get("Requeued")
    if requeued and requeued.get("reason") in ("Preempted", "PodsReadyTimeout", "NodeFailures"):
        # put back in the queue after an eviction: say so until it runs again
        return Gate(False, requeued["reason"], f"{requeued['reason'].lower()} by Kueue and queued again: {msg}")
    return Gate(False, "Queued", f"queued in LocalQueue {workload.get('spec', {}).get('queueName', '?')}: {msg}")


def placement(workload: dict[str, Any], flavors: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod set -> {nodeSelector, tolerations} of the ResourceFlavors (by name, their spec)
    Kueue assigned it."""
    out: dict[str, dict[str, Any]] = {}
    admission = (workload.get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        labels: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for flavor_name in sorted(set((assignment.get("flavors") or {}).values())):
            spec = flavors.get(flavor_name) or {}
            labels.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        if labels or tolerations:
            out[assignment["name"]] = {"nodeSelector": labels, "tolerations": tolerations}
    return out


def assigned_flavors(workload: dict[str, Any]) -> list[str]:
    admission = (workload.get("status") or {}).get("admission") or {}
    return sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set(conds: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    out = [c for c in conds if c["type"] != new["type"]]
    old = next((c for c in conds if c["type"] == new["type"]), None)
    if old is not None and old.get("status") == new["status"]:
        new = {**new, "lastTransitionTime": old.get("lastTransitionTime") or new["lastTransitionTime"]}
    return [*out, new]


def _cond(kind: str, status: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    out = {"type": kind, "status": "True" if status else "False", "reason": reason,
           "message": message[:32768], "lastTransitionTime": _now()}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def release_patch(workload: dict[str, Any]) -> dict[str, Any]:
    """The status merge patch that gives an evicted Workload's quota back (its job's pods are
    gone): no admission, QuotaReserved and Admitted False, Requeued (True after a preemption:
    the job queues again)."""
    conds = list((workload.get("status") or {}).get("conditions") or [])
    gen = (workload.get("metadata") or {}).get("generation")
    evicted = _conds(workload).get("Evicted") or {}
    reason, msg = evicted.get("reason") or "Evicted", evicted.get("message") or "evicted"
    requeue = reason in ("Preempted", "NodeFailures")
    conds = _set(conds, _cond("Requeued", requeue, reason, msg, gen))
    conds = _set(conds, _cond("QuotaReserved", False, "Pending", msg, gen))
    conds = _set(conds, _cond("Admitted", False, "NoReservation", "the workload has no quota reservation", gen))
    return {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
            "status": {"admission": None, "conditions": conds}}


def finish_patch(workload: dict[str, Any], succeeded: bool, message: str) -> dict[str, Any] | None:
    """The status merge patch that marks a Workload Finished (None: it is already)."""
    if _true(_conds(workload).get("Finished")):
        return None
    conds = list((workload.get("status") or {}).get("conditions") or [])
    gen = (workload.get("metadata") or {}).get("generation")
    conds = _set(conds, _cond("Finished", True, "Succeeded" if succeeded else "Failed", message, gen))
    return {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
            "status": {"conditions": conds}}
