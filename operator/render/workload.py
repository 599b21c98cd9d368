"""The Kueue Workload of a queued AgenticRLJob, and the assigned flavors in its pods.

kuberl's operator is the job integration Kueue's external-framework contract asks for (Kueue
config ``integrations.externalFrameworks: [AgenticRLJob.v1alpha1.kuberl.io]``): a job labelled
``kueue.x-k8s.io/queue-name`` gets one Workload it owns, with a podSet per kind of pod the job
runs at full size, so Kueue admits it all or nothing:

* ``trainer``: the trainer Job's pods (``trainer.replicas``, each with its accelerators);
* ``rollout``: the inline fleet's engine pods (each engine group's pods for multi-node engines);
* ``sandbox``: the inline pool's sandbox pods.

An autoscaled fleet or pool asks for its ``maxReplicas``: what it may scale to stays inside
what the queue admitted. A changed shape (replicas, resources) is a new Workload, which asks
again (``shape_hash``). Referenced fleets and pools (fleetRef, poolRef) are not the job's and
are not counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kuberl.api import RolloutFleet, SandboxPool
from kuberl.api.job import PRIORITY_LABEL, QUEUE_LABEL
from kuberl.operator.render.builders import build_for
from kuberl.operator.render.render_common import Manifest, object_labels

API_VERSION = "kueue.x-k8s.io/v1beta2"
__all__ = ["PRIORITY_LABEL", "QUEUE_LABEL"]  # re-exported: the operator's name for them
SHAPE_ANNOTATION = "kuberl.io/workload-shape"
WORKLOAD_PREFIX = "agenticrljob-"
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName", "overhead")


def queue_name(labels: dict[str, str] | None) -> str | None:
    return (labels or {}).get(QUEUE_LABEL) or None


def workload_name(job_name: str) -> str:
    return f"{WORKLOAD_PREFIX}{job_name}"


def _containers(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Kueue counts of each container: its name and requests (limits stand in for absent
    requests, as the API server defaults them)."""
    out = []
    for c in containers:
        res = c.get("resources") or {}
        requests = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out.append({"name": c["name"], "image": c.get("image", ""), "resources": {"requests": requests}})
    return out


def _template(pod: dict[str, Any]) -> dict[str, Any]:
    spec = pod.get("spec") or {}
    out: dict[str, Any] = {"containers": _containers(spec.get("containers") or [])}
    if spec.get("initContainers"):
        out["initContainers"] = _containers(spec["initContainers"])
    out.update({k: copy.deepcopy(spec[k]) for k in POD_FIELDS if spec.get(k)})
    return {"spec": out}


def _workload_pods(objs: list[Manifest]) -> tuple[int, dict[str, Any]] | None:
    """(pods, pod template) of the pods a fleet's or pool's children run at spec.replicas."""
    for obj in objs:
        spec = obj.get("spec") or {}
        if obj["kind"] in ("Deployment", "StatefulSet"):
            return int(spec.get("replicas") or 0), spec["template"]
        if obj["kind"] == "LeaderWorkerSet":
            group = spec["leaderWorkerTemplate"]
            return int(spec.get("replicas") or 0) * int(group.get("size") or 1), group["workerTemplate"]
    return None


def _scaled_pod_set(name: str, child: Manifest, namespace: str) -> dict[str, Any] | None:
    spec = dict(child["spec"])
    if spec.get("autoscaling"):
        spec["replicas"] = spec["autoscaling"]["maxReplicas"]
    model = RolloutFleet if child["kind"] == "RolloutFleet" else SandboxPool
    res = model.model_validate({**child, "spec": spec})
    found = _workload_pods(build_for(res, namespace))
    if found is None or found[0] == 0:
        return None
    count, pod = found
    return {"name": name, "count": count, "template": _template(pod)}


def pod_sets(children: list[Manifest], namespace: str) -> list[dict[str, Any]]:
    """The Workload's podSets from the job's children as built unsuspended."""
    out = []
    for child in children:
        if child["kind"] == "Job":
            spec = child["spec"]
            out.append({"name": "trainer", "count": int(spec.get("parallelism") or 1),
                        "template": _template(spec["template"])})
        elif child["kind"] in ("RolloutFleet", "SandboxPool"):
            name = "rollout" if child["kind"] == "RolloutFleet" else "sandbox"
            if (ps := _scaled_pod_set(name, child, namespace)) is not None:
                out.append(ps)
    return out


def shape_hash(sets: list[dict[str, Any]], queue: str, priority: str | None) -> str:
    text = json.dumps([sets, queue, priority], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_workload(
    job_name: str, namespace: str, queue: str, sets: list[dict[str, Any]],
    priority_class: str | None = None, priority: int | None = None,
) -> Manifest:
    """The Workload (owner reference added by the operator, as for every child)."""
    labels = object_labels(job_name, "workload", "AgenticRLJob")
    spec: dict[str, Any] = {"queueName": queue, "podSets": sets}
    if priority_class:
        spec["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                    "name": priority_class}
        spec["priority"] = int(priority or 0)
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {"name": workload_name(job_name), "namespace": namespace, "labels": labels,
                     "annotations": {SHAPE_ANNOTATION: shape_hash(sets, queue, priority_class)}},
        "spec": spec,
    }


def with_flavors(children: list[Manifest], placement: dict[str, dict[str, Any]]) -> list[Manifest]:
    """``children`` with each pod set's assigned flavor (``placement``: pod set -> nodeSelector
    and tolerations) in its pods: the trainer Job's template, the inline fleet's and pool's
    podTemplate."""
    out = []
    for child in children:
        name = {"Job": "trainer", "RolloutFleet": "rollout", "SandboxPool": "sandbox"}.get(child["kind"])
        place = placement.get(name or "")
        if not place:
            out.append(child)
            continue
        child = copy.deepcopy(child)
        if child["kind"] == "Job":
            pod = child["spec"]["template"].setdefault("spec", {})
        else:
            pod = child["spec"].setdefault("podTemplate", {}).setdefault("spec", {})
        if place.get("nodeSelector"):
            pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **place["nodeSelector"]}
        extra = [t for t in place.get("tolerations") or [] if t not in (pod.get("tolerations") or [])]
        if extra:
            pod["tolerations"] = [*(pod.get("tolerations") or []), *extra]
        out.append(child)
    return out
