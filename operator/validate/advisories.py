"""Warnings: what a manifest does that works but not as meant. `kuberl validate` prints them as
``Warning:`` lines (errors under ``--strict``); the admission webhook returns them as the
AdmissionReview's warnings, which kubectl prints the same way.

* the API server's own warnings on the children kuberl renders (``podwarnings``);
* capacity kuberl can compute: the sandbox workers against the tool-calling rollouts in flight,
  and, where the model's name gives its size (``Qwen/Qwen3-14B``), the trainer's and the
  engines' accelerator memory against it, and the fleet's KV cache against the rollouts in
  flight (``kvcache``).
"""

from __future__ import annotations

from kuberl.api import AgenticRLJob, ManifestError, Resource, RolloutFleet, SandboxPool, parse_resource
from kuberl.api.common import quantity_value
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import SGLANG_CPU_IMAGE_HINT, RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render.builders import build_for
from kuberl.operator.render.job_builder import uses_fleet
from kuberl.operator.validate.kvcache import context_warnings, kv_cache_warnings
from kuberl.operator.validate.models import ACCELERATOR_MEMORY_GB, ENGINE_DTYPE_BYTES, model_parameters
from kuberl.operator.validate.podwarnings import object_warnings

ROLLOUTS_PER_WORKER = 256
"""Tool-calling rollouts in flight per sandbox worker above which calls queue for much of a step.
The paper's recipe (examples/rstar2-mi300x.yaml) runs 64; four times that is far fewer workers
than the rollouts call for."""


MIN_TOOL_RESPONSE_TOKENS = 64
"""Response tokens of the shortest rollout that calls a tool: the call (``<tool_call>{"name":
"execute_python_code_with_standard_io", "arguments": {"code": ..., "input": ""}}</tool_call>``,
about 40 tokens), its output (counted in the budget) and an ``<answer>`` block."""
WORKERS_PER_CPU = 4
"""Sandbox workers per CPU of their container above which calls mostly wait for a CPU (workers
idle between a model's turns, so some sharing is free: the paper's pool runs one per CPU)."""
TRAINER_BYTES_PER_PARAMETER = 16
"""float32 weights, gradients and both AdamW moments (trainer.precision keeps all four float32)."""
TRAINER_STATE_SHARE = 0.8
"""Share of each accelerator the sharded training state may take: activations need the rest."""
ENGINE_WEIGHTS_SHARE = 0.9
"""Share of the engine's memory (memFractionStatic) its weights may take: the KV cache needs the rest."""


def trainer_device_warnings(job: AgenticRLJob) -> list[str]:
    """GPUs the trainer's pods hold while it computes on their CPUs."""
    t = job.spec.trainer
    if t.device != "cpu" or t.accelerator.profile == "cpu":
        return []
    gpus = t.replicas * t.accelerator.count
    return [
        f"spec.trainer.device: cpu on {t.accelerator.profile} pods: the trainer computes on CPUs while its "
        f"{gpus} GPUs (replicas {t.replicas} x accelerator.count {t.accelerator.count}) idle for the whole run, "
        "many times slower than meant; set device: auto (or cuda), or accelerator.profile: cpu"
    ]


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


def engine_image_warnings(fleet: RolloutFleetSpec, where: str) -> list[str]:
    """A cpu SGLang fleet on the default image, which nobody publishes (``SGLANG_CPU_IMAGE_HINT``):
    its pods would wait in ImagePullBackOff."""
    if fleet.engine.type != "sglang" or fleet.accelerator.profile != "cpu" or fleet.engine.image:
        return []
    return [f"{where}engine: the default image {fleet.image} is built, not pulled: {SGLANG_CPU_IMAGE_HINT}"]


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
    batches the rollout worker generates at once (``max(1, asyncLevel)``: at level 1 the next batch
    generates while the trainer trains the current one, which is no longer in flight)."""
    spec = job.spec
    a = spec.algorithm
    prompts = max((s.batch_size or a.batch_prompts for s in spec.stages if s.type == "rl"), default=0)
    return prompts * a.rollouts_per_prompt * max(1, a.async_level)


def pool_cpu_warnings(pool: SandboxPoolSpec, where: str) -> list[str]:
    """More warm workers than the sandbox container has CPUs for: CPU-bound calls share them, and
    a call's ``timeoutSeconds`` is wall-clock, so calls time out that would finish alone."""
    cpu = pool.resources.limits.get("cpu") or pool.resources.requests.get("cpu")
    if cpu is None:
        return []
    try:
        cpus = float(quantity_value(cpu))
    except ValueError:
        return []  # refused as a quantity by the rendered-children check
    if cpus <= 0 or pool.workers_per_pod <= WORKERS_PER_CPU * cpus:
        return []
    return [
        f"{where}workersPerPod: {pool.workers_per_pod} workers share the sandbox container's {cpu} CPUs "
        f"(resources {'limits' if 'cpu' in pool.resources.limits else 'requests'}.cpu), "
        f"{pool.workers_per_pod / cpus:.0f} per CPU: CPU-bound tool calls run that many times slower and hit "
        f"limits.timeoutSeconds ({pool.limits.timeout_seconds:g} s of wall clock); give the pod more CPUs or "
        "lower workersPerPod"
    ]


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


def schedule_warnings(job: AgenticRLJob) -> list[str]:
    """A checkpoint interval no step of the run reaches, and tools the turn limit never lets the
    model read back."""
    spec = job.spec
    out = []
    total = sum(s.steps for s in spec.stages)
    if total > 1 and spec.checkpoint.every_steps >= total:
        out.append(
            f"spec.checkpoint.everySteps: {spec.checkpoint.every_steps} is not below the run's {total} steps "
            "(all stages), so no checkpoint is written before the end: a trainer that fails or is evicted "
            f"restarts (trainer.maxRestarts) from step 0; set everySteps below {total}"
        )
    short = [s for s in spec.stages if s.type == "rl" and spec.stage_max_response_tokens(s) < MIN_TOOL_RESPONSE_TOKENS]
    if spec.rollout.tools and short:
        s = short[0]
        field = (
            f"spec.stages[{spec.stages.index(s)}].maxResponseTokens" if s.max_response_tokens else "spec.rollout.maxResponseTokens"
        )
        out.append(
            f"{field}: {spec.stage_max_response_tokens(s)} tokens for stage '{s.name}' cannot hold a tool call "
            "(<tool_call>{\"name\": \"execute_python_code_with_standard_io\", ...}</tool_call>, about 40 tokens), "
            f"its output and an <answer> block (about {MIN_TOOL_RESPONSE_TOKENS}): the rollouts cannot use "
            "spec.rollout.tools and learn no tool use (the paper uses 8192); raise it, or set tools: []"
        )
    turns = [s.name for s in spec.stages if s.type == "rl" and spec.stage_max_turns(s) == 1]
    if spec.rollout.tools and turns:
        out.append(
            f"spec.rollout.maxTurns: 1 turn for RL stage{'s' if len(turns) > 1 else ''} "
            f"{', '.join(map(repr, turns))}: a tool call's output comes back in the next turn, which never "
            "comes, so the rollouts cannot use spec.rollout.tools (the paper's multi-turn rollouts take up to "
            "10-15); raise maxTurns or set tools: []"
        )
    return out


def _job_kv_warnings(job: AgenticRLJob, referenced: RolloutFleetSpec | None) -> list[str]:
    """The KV cache of the fleet ``job`` rolls out on (inline, or ``referenced`` by fleetRef)."""
    inline = job.spec.rollout.fleet
    if inline is not None:
        model = inline.model.uri if inline.model is not None else job.spec.model.base
        where = "spec.rollout.fleet."
        return context_warnings(job, inline, where) + kv_cache_warnings(job, inline, where, model, rollouts_in_flight(job))
    if referenced is None or referenced.model is None:
        return []
    where = f"RolloutFleet {job.spec.rollout.fleet_ref} (spec.rollout.fleetRef) spec."
    return context_warnings(job, referenced, where) + kv_cache_warnings(
        job, referenced, where, referenced.model.uri, rollouts_in_flight(job)
    )


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
        out += engine_image_warnings(resource.spec, "spec.")
    if isinstance(resource, SandboxPool):
        out += pool_cpu_warnings(resource.spec, "spec.")
    if isinstance(resource, AgenticRLJob) and resource.spec.sandbox.pool is not None:
        out += pool_cpu_warnings(resource.spec.sandbox.pool, "spec.sandbox.pool.")
    if isinstance(resource, AgenticRLJob):
        out += trainer_memory_warnings(resource)
        out += trainer_device_warnings(resource)
        out += schedule_warnings(resource)
        inline = resource.spec.rollout.fleet
        if inline is not None:  # serves the job's model unless it names its own
            model = inline.model.uri if inline.model is not None else resource.spec.model.base
            out += engine_memory_warnings(inline, "spec.rollout.fleet.", model)
        if uses_fleet(resource):
            out += _job_kv_warnings(resource, fleet)
            if inline is not None:
                out += engine_image_warnings(inline, "spec.rollout.fleet.")
    if isinstance(resource, AgenticRLJob) and any(s.type == "rl" for s in resource.spec.stages):
        if resource.spec.sandbox.pool is not None:
            pool = (resource.spec.sandbox.pool, "spec.sandbox.pool")
        if pool is not None:
            out += sandbox_warnings(resource, *pool)
    return out
