"""Admission rules the CRD schema cannot express, as plain functions (kopf wraps them).

Validation: the whole pydantic model (cross-field rules such as replicas within the
autoscaling bounds, clip.high >= clip.low, tensorParallel vs accelerators per node, unique
stage names), the children it renders as the API server would judge them
(``rendered.rendered_problems``, as `kuberl validate` does), then references: a job's ``rollout.fleetRef`` / ``sandbox.poolRef`` must name
an existing RolloutFleet / SandboxPool in the job's namespace, the referenced fleet's
``engine.contextLength`` must exceed every RL stage's ``maxResponseTokens`` (SGLang answers
HTTP 400 to a request whose prompt plus ``max_new_tokens`` reaches the context length), and
a ``keda`` autoscaler annotation needs ``spec.autoscaling``, and a job's Kueue queue label
(``kueue.x-k8s.io/queue-name``) must name a LocalQueue of its namespace (else Kueue never
admits it and it waits forever).

Updates (``old`` given) are judged on what they change: an update that leaves ``spec`` and the
annotations alone (labels, kopf's bookkeeping, finalizers, a deletion) is always admitted, and
a reference is only looked up when the update changes it. Otherwise a job whose fleet was
deleted could no longer be suspended, edited or even cleaned up.

Mutation: fills in what is derived rather than defaulted -- an inline fleet's model comes
from the job's ``model.base`` -- and labels every kuberl resource ``app.kubernetes.io/name:
kuberl`` so ``kubectl get -l`` finds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kuberl.api import AgenticRLJob, ManifestError, RolloutFleet, SandboxPool, parse_resource
from kuberl.api.job import QUEUE_LABEL
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render.render_common import ANNOTATION_AUTOSCALER, APP_NAME, LABEL_NAME
from kuberl.operator.validate.feasibility import fleet_problems, pool_problems, resource_problems
from kuberl.operator.validate.rendered import rendered_problems

# (kind, namespace, name) -> the live object, or None if it does not exist (kind LocalQueue: Kueue's)
Lookup = Callable[[str, str, str], Awaitable[dict[str, Any] | None]]


def missing_queue_message(namespace: str, queue: str) -> str:
    return (f"metadata.labels[{QUEUE_LABEL}]: LocalQueue {namespace}/{queue} does not exist, so Kueue would "
            f"never admit the job: create it (kubectl get localqueues -n {namespace} lists those there) "
            "or fix the label")


def context_length_problems(job: AgenticRLJob, fleet: dict[str, Any]) -> list[str]:
    """Why ``fleet`` (a live RolloutFleet) cannot serve ``job``'s RL stages ([] = it can).

    A fleet without ``engine.contextLength`` uses the model's own limit, unknown here: no
    problem is reported for it.
    """
    engine = ((fleet.get("spec") or {}).get("engine")) or {}
    limit = engine.get("contextLength")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return []
    problems = []
    for stage in job.spec.stages:
        if stage.type != "rl":
            continue
        tokens = job.spec.stage_max_response_tokens(stage)
        if limit <= tokens:
            problems.append(
                f"has engine.contextLength {limit}, which must exceed stage '{stage.name}' "
                f"maxResponseTokens {tokens} (SGLang rejects a request whose prompt plus "
                "max_new_tokens reaches the context length with HTTP 400): raise the fleet's "
                "engine.contextLength or lower the stage's maxResponseTokens"
            )
    return problems


def _as_manifest(body: dict[str, Any]) -> dict[str, Any]:
    meta = dict(body.get("metadata") or {})
    # Server-managed metadata is irrelevant to the spec rules; keep what ObjectMeta reads.
    keep = {
        k: meta[k] for k in ("name", "namespace", "labels", "annotations", "generation", "uid") if k in meta
    }
    if "name" not in keep and meta.get("generateName"):
        keep["name"] = meta["generateName"].rstrip("-") or "x"
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": keep,
        "spec": body.get("spec"),
    }


def _judged(body: dict[str, Any]) -> tuple[Any, Any]:
    """What the rules read: the spec and the annotations (labels and bookkeeping are free)."""
    return body.get("spec"), (body.get("metadata") or {}).get("annotations") or {}


def _changed_refs(body: dict[str, Any], old: dict[str, Any] | None) -> set[str]:
    """Which of spec.rollout.fleetRef / spec.sandbox.poolRef this write sets or changes."""

    def refs(doc: dict[str, Any] | None) -> dict[str, Any]:
        spec = (doc or {}).get("spec") or {}
        return {
            "fleetRef": (spec.get("rollout") or {}).get("fleetRef"),
            "poolRef": (spec.get("sandbox") or {}).get("poolRef"),
        }

    new, before = refs(body), refs(old)
    return {k for k in new if old is None or new[k] != before[k]}


def _referenced_fleet_problems(job: AgenticRLJob, fleet: dict[str, Any], name: str) -> list[str]:
    """``feasibility.fleet_problems`` of a live fleet (one the schema let in parses)."""
    try:
        spec = RolloutFleetSpec.model_validate(fleet.get("spec") or {})
    except ValueError:
        return []  # the fleet's own admission judged it
    return fleet_problems(job, spec, f"RolloutFleet {name} (spec.rollout.fleetRef) spec.", inline=False)


def _referenced_pool_problems(job: AgenticRLJob, pool: dict[str, Any], name: str) -> list[str]:
    """``feasibility.pool_problems`` of a live pool (one the schema let in parses)."""
    try:
        spec = SandboxPoolSpec.model_validate(pool.get("spec") or {})
    except ValueError:
        return []  # the pool's own admission judged it
    return pool_problems(job, spec, f"SandboxPool {name} (spec.sandbox.poolRef) spec.")


async def validation_errors(
    body: dict[str, Any], lookup: Lookup | None, old: dict[str, Any] | None = None
) -> list[str]:
    """Everything wrong with ``body`` (empty list = admit). ``lookup=None`` skips the refs.

    ``old``: the stored object on UPDATE (None on CREATE); see the module docstring.
    """
    if old is not None:
        if (body.get("metadata") or {}).get("deletionTimestamp") or _judged(body) == _judged(old):
            return []
    try:
        res = parse_resource(_as_manifest(body), source="admission")
    except ManifestError as err:
        return [str(err).removeprefix("admission: ")]
    ns = res.metadata.namespace or (body.get("metadata") or {}).get("namespace") or "default"
    # what the API server would refuse among its children: refused now, with `kuberl validate`'s
    # words, rather than left for the operator to mark Invalid after the write
    errors: list[str] = resource_problems(res) + rendered_problems(res, ns)
    if isinstance(res, SandboxPool | RolloutFleet):
        if res.metadata.annotations.get(ANNOTATION_AUTOSCALER) == "keda" and res.spec.autoscaling is None:
            errors.append(
                f"annotation {ANNOTATION_AUTOSCALER}=keda needs spec.autoscaling (min/max replicas)"
            )
    if isinstance(res, AgenticRLJob) and lookup is not None:
        queue = (res.metadata.labels or {}).get(QUEUE_LABEL)
        if queue and await lookup("LocalQueue", ns, queue) is None:
            errors.append(missing_queue_message(ns, queue))
        rollout, sandbox = res.spec.rollout, res.spec.sandbox
        changed = _changed_refs(body, old)
        if rollout.fleet_ref and rollout.engine != "local" and "fleetRef" in changed:
            fleet = await lookup("RolloutFleet", ns, rollout.fleet_ref)
            if fleet is None:
                errors.append(f"spec.rollout.fleetRef: RolloutFleet {ns}/{rollout.fleet_ref} does not exist")
            else:
                errors += [
                    f"spec.rollout.fleetRef: RolloutFleet {ns}/{rollout.fleet_ref} {problem}"
                    for problem in context_length_problems(res, fleet)
                ]
                errors += _referenced_fleet_problems(res, fleet, f"{ns}/{rollout.fleet_ref}")
        if sandbox.pool_ref and "poolRef" in changed:
            pool = await lookup("SandboxPool", ns, sandbox.pool_ref)
            if pool is None:
                errors.append(f"spec.sandbox.poolRef: SandboxPool {ns}/{sandbox.pool_ref} does not exist")
            else:
                errors += _referenced_pool_problems(res, pool, f"{ns}/{sandbox.pool_ref}")
    return errors


async def validation_warnings(body: dict[str, Any], lookup: Lookup | None) -> list[str]:
    """What kubectl prints as ``Warning:`` on admitting ``body``: the same warnings as
    `kuberl validate` (``advisories``), for a body ``validation_errors`` admits."""
    from kuberl.operator.validate.advisories import resource_warnings

    try:
        res = parse_resource(_as_manifest(body), source="admission")
    except ManifestError:
        return []
    ns = res.metadata.namespace or (body.get("metadata") or {}).get("namespace") or "default"
    pool = None
    if isinstance(res, AgenticRLJob) and res.spec.sandbox.pool_ref and lookup is not None:
        live = await lookup("SandboxPool", ns, res.spec.sandbox.pool_ref)
        try:
            if live is not None:
                spec = SandboxPoolSpec.model_validate(live.get("spec") or {})
                pool = (spec, f"SandboxPool {res.spec.sandbox.pool_ref} (spec.sandbox.poolRef) spec")
        except ValueError:
            pool = None
    fleet = None
    if isinstance(res, AgenticRLJob) and res.spec.rollout.fleet_ref and lookup is not None:
        live_fleet = await lookup("RolloutFleet", ns, res.spec.rollout.fleet_ref)
        try:
            fleet = RolloutFleetSpec.model_validate(live_fleet.get("spec") or {}) if live_fleet else None
        except ValueError:
            fleet = None
    return resource_warnings(res, ns, fleet=fleet, pool=pool)


def mutation(body: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that completes ``body`` (empty dict = nothing to change)."""
    patch: dict[str, Any] = {}
    labels = (body.get("metadata") or {}).get("labels") or {}
    if LABEL_NAME not in labels:
        patch["metadata"] = {"labels": {LABEL_NAME: APP_NAME}}
    if body.get("kind") == "AgenticRLJob":
        spec = body.get("spec") or {}
        fleet = (spec.get("rollout") or {}).get("fleet")
        base = (spec.get("model") or {}).get("base")
        if isinstance(fleet, dict) and not fleet.get("model") and base:
            patch["spec"] = {"rollout": {"fleet": {"model": {"uri": base, "servedName": "policy"}}}}
    return patch
