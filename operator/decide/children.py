"""Pure rules about a custom resource's children that need the live state to decide.

* ``orphans``: children the owner created earlier that its current spec no longer builds (a
  fleet whose engines outgrew one node swaps its Deployment for a LeaderWorkerSet; the old
  Deployment still holds its GPUs until someone deletes it).
* ``inline_replicas``: how many replicas a job writes into its inline fleet/pool. When the
  child autoscales, its replica count belongs to the autoscaler; the job only sets it when it
  creates the child and when it suspends or resumes it (otherwise the two undo each other at
  every resync).
* ``held_spec``: what a held (suspended, preempted) job applies to its inline fleet/pool while
  its trainer pods are still stopping: they finish their step, which calls both, before the
  checkpoint, so the children keep their size until the last trainer pod is gone.
* ``trainers_stopping``: whether any trainer pod is still there to finish its step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def owned_by(obj: dict[str, Any], owner_uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == owner_uid for r in refs)


def orphans(
    live: Iterable[dict[str, Any]], wanted: set[tuple[str, str]], owner_uid: str
) -> list[dict[str, Any]]:
    """Live objects owned by ``owner_uid`` whose (kind, name) is not in ``wanted``.

    Ownership is checked by uid, not by labels alone: a label selector also matches objects of
    a different owner that happens to share the instance name (a job and a fleet named alike).
    """
    out = []
    for obj in live:
        key = (obj.get("kind", ""), (obj.get("metadata") or {}).get("name", ""))
        if owner_uid and owned_by(obj, owner_uid) and key not in wanted:
            out.append(obj)
    return out


def inline_replicas(desired_spec: dict[str, Any], live_spec: dict[str, Any] | None) -> int:
    """The ``spec.replicas`` a job applies to its inline fleet/pool (wire-format specs).

    * no autoscaling wanted, or the child is new: the job's own number (creation);
    * the live child has no autoscaling but the wanted one does: the job's number (resume
      after suspend, which dropped autoscaling and set 0);
    * both autoscale: whatever the autoscaler chose, clamped into the (possibly edited) bounds
      so the child never turns invalid.
    """
    replicas = int(desired_spec.get("replicas", 1))
    auto = desired_spec.get("autoscaling")
    if not auto or live_spec is None or not live_spec.get("autoscaling"):
        return replicas
    current = int(live_spec.get("replicas", replicas))
    lo = int(auto.get("minReplicas", 1))
    hi = int(auto.get("maxReplicas", max(current, lo)))
    return min(max(current, lo), hi)


def held_spec(desired_spec: dict[str, Any], live_spec: dict[str, Any] | None, trainers_stopping: bool) -> dict[str, Any]:
    """The spec a held job applies to its inline fleet/pool (wire format). ``desired_spec`` is the
    held one (0 replicas, no autoscaling). While trainer pods still stop, the live child keeps its
    replicas and autoscaling: a pool scaled to zero under a trainer finishing its step fails the
    step's tool calls and rewards, and the step is lost instead of checkpointed."""
    if not trainers_stopping or live_spec is None:
        return desired_spec
    kept = {**desired_spec, "replicas": int(live_spec.get("replicas", desired_spec.get("replicas", 0)))}
    if live_spec.get("autoscaling"):
        kept["autoscaling"] = live_spec["autoscaling"]
    return kept


def trainers_stopping(pods: Iterable[dict[str, Any]]) -> bool:
    """Whether any of a held job's trainer pods has yet to end (one being deleted included)."""
    return any((p.get("status") or {}).get("phase") not in ("Succeeded", "Failed") for p in pods)


def job_owner(obj: dict[str, Any], api_version: str) -> str | None:
    """The name of the AgenticRLJob (of ``api_version``) that controls ``obj``, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "AgenticRLJob" and ref.get("apiVersion") == api_version and ref.get("controller"):
            return ref.get("name")
    return None
