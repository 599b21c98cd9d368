"""Checks of a manifest that need its rendered children: what `kuberl validate` and the operator's
pre-flight run before anything is created (``rendered.rendered_problems`` for each child, the
references a file resolves, objects two resources would both create, sizes likely to fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kuberl.api import AgenticRLJob, ManifestError, Resource, RolloutFleet, SandboxPool, parse_resource
from kuberl.api.common import quantity_value
from kuberl.api.group import API_VERSION
from kuberl.api.job import QUEUE_LABEL
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render.builders import build_for
from kuberl.operator.render.job_builder import uses_fleet
from kuberl.operator.validate.admission import context_length_problems
from kuberl.operator.validate.advisories import resource_warnings
from kuberl.operator.validate.feasibility import fleet_problems, pool_problems, resource_problems
from kuberl.operator.validate.rendered import rendered_problems


@dataclass
class Verdict:
    """What `kuberl validate` says about one resource of a file."""

    resource: Resource
    problems: list[str] = field(default_factory=list)  # the API server or the operator would refuse
    notes: list[str] = field(default_factory=list)  # not checked here, or likely to fail at run time
    warnings: list[str] = field(default_factory=list)  # `Warning:` lines; errors under --strict


def _pool_notes(spec: SandboxPoolSpec, where: str, name: str = "pool") -> list[str]:
    """Concurrent tool calls that together may pass the pod's memory limit get the whole pod
    OOM-killed (every call in flight fails, not just the greedy one). The limit is the rendered
    sandbox container's, so a ``podTemplate`` override of its resources counts."""
    pool = SandboxPool.model_validate({"metadata": {"name": name}, "spec": spec.wire()})
    deploy = next(o for o in build_for(pool) if o["kind"] == "Deployment")
    containers = deploy["spec"]["template"]["spec"].get("containers") or []
    container = next((c for c in containers if isinstance(c, dict) and c.get("name") == "sandbox"), {})
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    if limit is None:
        return []
    need = spec.workers_per_pod * spec.limits.memory_mb * 2**20
    try:
        have = quantity_value(limit)
    except ValueError:
        return []  # refused as a quantity by the rendered-children check
    if need <= have:
        return []
    return [
        f"warning: {where}workersPerPod ({spec.workers_per_pod}) x limits.memoryMB "
        f"({spec.limits.memory_mb}) = {need / 2**30:.1f} GiB exceeds the pod's memory limit ({limit}): "
        "calls running together can get the pod OOM-killed; lower memoryMB or workersPerPod, or raise "
        "the sandbox container's memory limit (resources.limits.memory, or its podTemplate override)"
    ]


def _checkpoint_notes(job: AgenticRLJob) -> list[str]:
    """Checkpoints that would not survive the trainer's pod, or could not be written."""
    uri = job.spec.checkpoint.uri
    tpl = job.spec.trainer.pod_template
    spec = tpl.spec if tpl is not None else {}
    mounts = [
        m.get("mountPath", "")
        for c in spec.get("containers") or []
        if c.get("name") == "trainer"
        for m in c.get("volumeMounts") or []
    ]
    if uri.startswith("/") and not any(uri == m or uri.startswith(m.rstrip("/") + "/") for m in mounts):
        return [
            f"warning: checkpoint.uri {uri} is not on a volume the trainer mounts: its checkpoints go with the "
            "pod; mount one there with trainer.podTemplate, or use a relative uri (the job's own volume)"
        ]
    if uri.startswith("s3://"):
        env = [
            e.get("name", "")
            for c in spec.get("containers") or []
            if c.get("name") == "trainer"
            for e in c.get("env") or []
        ]
        has_from = any(c.get("envFrom") for c in spec.get("containers") or [] if c.get("name") == "trainer")
        if not has_from and not any(n.startswith("AWS_") for n in env):
            return [
                f"not checked: checkpoint.uri {uri} needs S3 credentials in the trainer (AWS_* from a Secret "
                "through trainer.podTemplate env/envFrom, or a node or workload identity)"
            ]
    return []


def _tracking_notes(job: AgenticRLJob) -> list[str]:
    """Trackers a trainer pod cannot log to as configured: W&B online without an API key, and an
    MLflow file store in the run folder, which goes with the pod."""
    tracking = job.spec.tracking
    if tracking is None:
        return []
    out = []
    tpl = job.spec.trainer.pod_template
    trainer = [c for c in (tpl.spec if tpl is not None else {}).get("containers") or [] if c.get("name") == "trainer"]
    env = {e.get("name") for c in trainer for e in c.get("env") or []}
    has_from = any(c.get("envFrom") for c in trainer)
    wandb = tracking.wandb
    if wandb is not None and wandb.mode == "online" and wandb.api_key_secret is None and "WANDB_API_KEY" not in env and not has_from:
        out.append(
            "not checked: spec.tracking.wandb logs online but names no apiKeySecret: the trainer pods need "
            "WANDB_API_KEY (apiKeySecret, or trainer.podTemplate env/envFrom), or W&B refuses the run's login"
        )
    if tracking.mlflow is not None and not tracking.mlflow.tracking_uri:
        out.append(
            "warning: spec.tracking.mlflow has no trackingUri: its file store (mlruns/ in the run folder) goes "
            "with the trainer pod, and every logged metric with it; name an http(s):// tracking server"
        )
    return out


def _warmup_notes(job: AgenticRLJob) -> list[str]:
    """Stages that end before their learning-rate warm-up does (it restarts in every stage)."""
    warm = job.spec.algorithm.warmup_steps
    short = [s for s in job.spec.stages if 1 < s.steps < warm]
    return [
        f"warning: spec.algorithm.warmupSteps {warm} exceeds stage '{s.name}''s {s.steps} steps: its learning "
        f"rate never gets past {s.steps / warm:.0%} of its value, so the stage learns slower than meant; lower "
        "warmupSteps"
        for s in short
    ]


def _algorithm_notes(job: AgenticRLJob) -> list[str]:
    """Settings that validate but were seen to make a run diverge."""
    a = job.spec.algorithm
    passes = a.ppo_epochs * a.mini_batches
    if a.async_level >= 2 and passes > 1:
        return [
            f"warning: spec.algorithm.asyncLevel {a.async_level} with {passes} optimizer steps per batch "
            f"(ppoEpochs {a.ppo_epochs} x miniBatches {a.mini_batches}): every step trains several times on "
            "rollouts up to "
            f"{a.async_level} versions old, which truncated importance sampling does not undo (training "
            "can collapse); INTELLECT-2 trains one optimizer step "
            "per batch: set ppoEpochs and miniBatches to 1, or asyncLevel to 1"
        ]
    return []


def rendered_names(resource: Resource, namespace: str) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of ``resource`` and of every object it creates, inline children's
    children included."""
    names = {(resource.KIND, namespace, resource.metadata.name)}
    for obj in build_for(resource, namespace):
        if obj["apiVersion"] == API_VERSION:
            try:
                names |= rendered_names(parse_resource(obj, source="rendered"), namespace)
            except ManifestError:
                continue  # reported by rendered_problems
        else:
            names.add((obj["kind"], namespace, obj["metadata"]["name"]))
    return names


def collision_problems(resources: list[Resource], namespace: str = "default") -> dict[int, list[str]]:
    """Two resources of one file that create (or are) the same object: job ``a``'s inline fleet is
    RolloutFleet ``a-rollout``, so a RolloutFleet ``a-rollout`` beside it would be fought over by
    two owners (the operator patches it for one, the other sees drift). Keyed by index."""
    owner: dict[tuple[str, str, str], int] = {}
    out: dict[int, list[str]] = {}
    for i, r in enumerate(resources):
        for key in sorted(rendered_names(r, r.metadata.namespace or namespace)):
            j = owner.setdefault(key, i)
            if j != i:
                other = resources[j]
                out.setdefault(i, []).append(
                    f"{key[0]}/{key[2]} is also created by {other.KIND}/{other.metadata.name} in this file; "
                    "rename one of them"
                )
    return out


def check_file(resources: list[Resource], namespace: str = "default") -> list[Verdict]:
    """Per resource: refusals (rendered children, references this file can resolve, objects two
    resources would both create) and notes (references it cannot, resource sizes likely to fail
    at run time). A reference resolves to a resource of the same namespace only."""

    def ns_of(r: Resource) -> str:
        return r.metadata.namespace or namespace

    fleets = {(ns_of(r), r.metadata.name): r for r in resources if isinstance(r, RolloutFleet)}
    pools = {(ns_of(r), r.metadata.name): r for r in resources if isinstance(r, SandboxPool)}
    collisions = collision_problems(resources, namespace)
    out = []
    for i, r in enumerate(resources):
        v = Verdict(r, problems=list(collisions.get(i, [])))
        fleet_spec = None
        pool: tuple[SandboxPoolSpec, str] | None = None
        if isinstance(r, AgenticRLJob):
            ref = r.spec.rollout.fleet_ref
            if ref and uses_fleet(r):
                if (ns_of(r), ref) in fleets:
                    fleet_spec = fleets[ns_of(r), ref].spec
                    v.problems += [
                        f"spec.rollout.fleetRef: RolloutFleet {ref} (in this file) {p}"
                        for p in context_length_problems(r, fleets[ns_of(r), ref].wire())
                    ]
                    v.problems += fleet_problems(
                        r, fleet_spec, f"RolloutFleet {ref} (spec.rollout.fleetRef) spec.", inline=False
                    )
                else:
                    v.notes.append(
                        f"not checked: spec.rollout.fleetRef names RolloutFleet {ref!r}, which is not in this "
                        f"file (namespace {ns_of(r)}); the operator holds the trainer back until it exists (and checks its "
                        "engine.contextLength then)"
                    )
            pref = r.spec.sandbox.pool_ref
            if pref and (ns_of(r), pref) in pools:
                pool = (pools[ns_of(r), pref].spec, f"SandboxPool {pref} (spec.sandbox.poolRef) spec")
                v.problems += pool_problems(r, pool[0], f"{pool[1]}.")
            if pref and (ns_of(r), pref) not in pools:
                v.notes.append(
                    f"not checked: spec.sandbox.poolRef names SandboxPool {pref!r}, which is not in this file "
                    f"(namespace {ns_of(r)}); "
                    "the operator holds the trainer back until it exists"
                )
            if r.spec.sandbox.pool is not None:
                v.notes += _pool_notes(r.spec.sandbox.pool, "spec.sandbox.pool.")
            v.notes += _checkpoint_notes(r)
            v.notes += _algorithm_notes(r) + _warmup_notes(r) + _tracking_notes(r)
            if queue := (r.metadata.labels or {}).get(QUEUE_LABEL):
                v.warnings.append(
                    f"metadata.labels[{QUEUE_LABEL}] names LocalQueue {ns_of(r)}/{queue}, which cannot be checked "
                    "offline: if it does not exist Kueue never admits the job (`kuberl validate --server` and the "
                    "admission webhook refuse it then)"
                )
        elif isinstance(r, SandboxPool):
            v.notes += _pool_notes(r.spec, "spec.", r.metadata.name)
        v.problems += resource_problems(r)
        v.problems += rendered_problems(r, ns_of(r), fleet=fleet_spec)
        if not v.problems:
            v.warnings += resource_warnings(r, ns_of(r), fleet=fleet_spec, pool=pool)
        out.append(v)
    return out
