"""Warnings: what a manifest does that works but not as meant. `kuberl validate` prints them as
``Warning:`` lines (errors under ``--strict``); the admission webhook returns them as the
AdmissionReview's warnings, which kubectl prints the same way.

* the API server's own warnings on the children kuberl renders (``podwarnings``);
* capacity kuberl can compute: the sandbox workers against the tool-calling rollouts in flight,
  and, where the model's name gives its size (``Qwen/Qwen3-14B``), the trainer's and the
  engines' accelerator memory against it.
"""

from __future__ import annotations

import re

from kuberl.api import AgenticRLJob, ManifestError, Resource, RolloutFleet, parse_resource
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.podwarnings import object_warnings

ROLLOUTS_PER_WORKER = 256
"""Tool-calling rollouts in flight per sandbox worker above which calls queue for much of a step.
The paper's recipe (examples/rstar2-mi300x.yaml) runs 64; four times that is far fewer workers
than the rollouts call for."""


ACCELERATOR_MEMORY_GB = {"mi300x": 192, "h100": 80}
"""Memory of one accelerator of each GPU profile."""
TRAINER_BYTES_PER_PARAMETER = 16
"""float32 weights, gradients and both AdamW moments (trainer.precision keeps all four float32)."""
TRAINER_STATE_SHARE = 0.8
"""Share of each accelerator the sharded training state may take: activations need the rest."""
ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
"""Bytes per weight as an engine serves them (auto: the checkpoint's own, bf16 for current models)."""
ENGINE_WEIGHTS_SHARE = 0.9
"""Share of the engine's memory (memFractionStatic) its weights may take: the KV cache needs the rest."""
_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([BM])(?![a-z])", re.IGNORECASE)


def model_parameters(name: str) -> float | None:
    """Parameters of a model its name counts (``Qwen3-14B``: 14e9, ``SmolLM2-135M``: 135e6;
    ``Qwen3-235B-A22B``: 235e9, every expert), or None where the name says nothing."""
    m = _SIZE.search(name.rsplit("/", 1)[-1])
    if m is None:
        return None
    return float(m[1]) * (1e9 if m[2].upper() == "B" else 1e6)


def trainer_memory_warnings(job: AgenticRLJob) -> list[str]:
    """Training state that cannot fit the trainer's accelerators, however FSDP shards it."""
    t = job.spec.trainer
    params = model_parameters(job.spec.model.base)
    memory = ACCELERATOR_MEMORY_GB.get(t.accelerator.profile)
    if params is None or memory is None:
        return []
    gpus = t.replicas * t.accelerator.count
    state_gb = TRAINER_BYTES_PER_PARAMETER * params / 1e9
    if state_gb / gpus <= TRAINER_STATE_SHARE * memory:
        return []
    return [
        f"spec.trainer: {job.spec.model.base}'s float32 weights, gradients and AdamW moments take "
        f"{state_gb:.0f} GB ({TRAINER_BYTES_PER_PARAMETER} bytes x {params / 1e9:g}B parameters), "
        f"{state_gb / gpus:.0f} GB on each of its {gpus} {t.accelerator.profile} accelerators (replicas "
        f"{t.replicas} x accelerator.count {t.accelerator.count}) against {memory} GB each, before "
        "activations: the trainer runs out of memory; raise trainer.replicas"
    ]


def engine_memory_warnings(fleet: RolloutFleetSpec, where: str, model: str) -> list[str]:
    """Served weights (``model``) that leave an engine's accelerators no room for the KV cache."""
    params = model_parameters(model)
    memory = ACCELERATOR_MEMORY_GB.get(fleet.accelerator.profile)
    if params is None or memory is None:
        return []
    tp = fleet.engine.tensor_parallel
    weights_gb = ENGINE_DTYPE_BYTES[fleet.engine.dtype] * params / 1e9 / tp
    budget_gb = fleet.engine.mem_fraction_static * memory
    if weights_gb <= ENGINE_WEIGHTS_SHARE * budget_gb:
        return []
    return [
        f"{where}engine: {model}'s weights take {weights_gb:.0f} GB on each of the engine's "
        f"{tp} accelerators (tensorParallel {tp}) against the {budget_gb:.0f} GB memFractionStatic "
        f"{fleet.engine.mem_fraction_static:g} leaves of {memory} GB: little or no room for the KV cache, "
        "so rollouts queue or the engine does not start; raise engine.tensorParallel"
    ]


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
    if isinstance(resource, RolloutFleet):
        out += engine_memory_warnings(resource.spec, "spec.", resource.spec.model.uri)
    if isinstance(resource, AgenticRLJob):
        out += trainer_memory_warnings(resource)
        inline = resource.spec.rollout.fleet
        if inline is not None:  # serves the job's model unless it names its own
            model = inline.model.uri if inline.model is not None else resource.spec.model.base
            out += engine_memory_warnings(inline, "spec.rollout.fleet.", model)
    if isinstance(resource, AgenticRLJob) and any(s.type == "rl" for s in resource.spec.stages):
        if resource.spec.sandbox.pool is not None:
            pool = (resource.spec.sandbox.pool, "spec.sandbox.pool")
        if pool is not None:
            out += sandbox_warnings(resource, *pool)
    return out
