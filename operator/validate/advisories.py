"""Warnings: what a manifest does that works but not as meant. `kuberl validate` prints them as
``Warning:`` lines (errors under ``--strict``); the admission webhook returns them as the
AdmissionReview's warnings, which kubectl prints the same way.

* the API server's own warnings on the children kuberl renders (``podwarnings``);
* capacity kuberl can compute: the sandbox workers against the tool-calling rollouts in flight.
"""

from __future__ import annotations

from kuberl.api import AgenticRLJob, ManifestError, Resource, parse_resource
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.podwarnings import object_warnings

ROLLOUTS_PER_WORKER = 256
"""Tool-calling rollouts in flight per sandbox worker above which calls queue for much of a step.
The paper's recipe (examples/rstar2-mi300x.yaml) runs 64; four times that is far fewer workers
than the rollouts call for."""


def rendered_warnings(resource: Resource, namespace: str = "default", fleet: RolloutFleetSpec | None = None) -> list[str]:
    """The API server's warnings on every object ``resource`` creates, inline children's included."""
    out: list[str] = []
    for obj in build_for(resource, namespace, fleet=fleet):
        if obj["apiVersion"] != API_VERSION:
            out += object_warnings(obj)
            continue
        try:
            child = parse_resource(obj, source="rendered")
        except ManifestError:
            continue  # refused by checks.rendered_problems
        out += rendered_warnings(child, namespace)
    return out


def rollouts_in_flight(job: AgenticRLJob) -> int:
    """The most rollouts one RL step has in flight: prompts x rollouts per prompt, times the
    batches an asynchronous run generates at once."""
    spec = job.spec
    a = spec.algorithm
    prompts = max((s.batch_size or a.batch_prompts for s in spec.stages if s.type == "rl"), default=0)
    return prompts * a.rollouts_per_prompt * (a.async_level + 1)


def sandbox_warnings(job: AgenticRLJob, pool: SandboxPoolSpec, where: str) -> list[str]:
    """A pool far smaller than the tool calls the job makes: rollouts queue on every call."""
    if not job.spec.rollout.tools:
        return []
    rollouts = rollouts_in_flight(job)
    replicas = pool.autoscaling.max_replicas if pool.autoscaling is not None else pool.replicas
    workers = max(1, replicas * pool.workers_per_pod)
    if rollouts <= ROLLOUTS_PER_WORKER * workers:
        return []
    return [
        f"{where}: {workers} sandbox workers ({'autoscaling.maxReplicas' if pool.autoscaling else 'replicas'} "
        f"{replicas} x workersPerPod {pool.workers_per_pod}) for up to {rollouts} tool-calling rollouts in "
        f"flight ({rollouts // workers} per worker): tool calls queue and every step waits on them; raise "
        "replicas (or autoscaling.maxReplicas) or workersPerPod"
    ]


def resource_warnings(
    resource: Resource,
    namespace: str = "default",
    fleet: RolloutFleetSpec | None = None,
    pool: tuple[SandboxPoolSpec, str] | None = None,
) -> list[str]:
    """All warnings for ``resource``; ``pool``: a referenced pool's spec and how to name it."""
    out = rendered_warnings(resource, namespace, fleet)
    if isinstance(resource, AgenticRLJob) and any(s.type == "rl" for s in resource.spec.stages):
        if resource.spec.sandbox.pool is not None:
            pool = (resource.spec.sandbox.pool, "spec.sandbox.pool")
        if pool is not None:
            out += sandbox_warnings(resource, *pool)
    return out
