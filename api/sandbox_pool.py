"""SandboxPool: CPU pods that execute model-written Python (rStar2-Agent section 3.1)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kuberl.api.common import (
    Autoscaling,
    KubeModel,
    Resource,
    ResourceRequirements,
    ScaledResourceStatus,
    check_replicas_in_bounds,
    default_replicas_to_min,
    without_default,
)
from kuberl.api.pod_template import PodTemplateOverride

DEFAULT_SANDBOX_IMAGE = "ghcr.io/kuberl/sandbox:0.1.0"


class SandboxLimits(KubeModel):
    """Per tool call limits, enforced inside the pod for every execution."""

    timeout_seconds: float = Field(10.0, gt=0, le=600, description="Wall-clock deadline of one call.")
    memory_mb: int = Field(
        1024, alias="memoryMB", ge=32, le=65536, description="Address-space/cgroup memory of one call."
    )
    max_output_bytes: int = Field(16384, ge=256, description="stdout/stderr beyond this is truncated.")
    max_processes: int = Field(
        32, ge=1, le=4096, description="pids limit of one call (fork bombs stop here)."
    )
    disk_mb: int = Field(
        256, alias="diskMB", ge=16, le=65536, description="Files one call may keep in its scratch directory."
    )
    max_code_kb: int = Field(
        256, alias="maxCodeKB", ge=1, le=65536, description="Largest code of one call (UTF-8); larger is refused with 413."
    )
    max_stdin_kb: int = Field(
        1024, alias="maxStdinKB", ge=0, le=65536, description="Largest stdin of one call (UTF-8); larger is refused with 413."
    )
    max_request_mb: int = Field(
        16,
        alias="maxRequestMB",
        ge=1,
        le=1024,
        description="Largest HTTP request body (a batch's total); refused with 413 before it is read whole.",
    )


class SandboxAutoscaling(Autoscaling):
    target_queue_per_worker: float = Field(
        4.0, gt=0, description="Scale so that queued calls per worker stay at or below this."
    )


class SandboxPoolSpec(KubeModel):
    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Pods; the scale subresource writes this field. Default: autoscaling.minReplicas, else 1.",
        json_schema_extra=without_default,
    )
    image: str = DEFAULT_SANDBOX_IMAGE
    workers_per_pod: int = Field(2, ge=1, le=256, description="Warm fork-server workers in each pod.")
    # Requests equal to limits and whole CPUs: a Guaranteed pod, which the kubelet's static CPU
    # manager gives an exclusive cpuset, so each worker keeps to a CPU of its own (workersPerPod 2).
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "2", "memory": "8Gi"}, limits={"cpu": "2", "memory": "8Gi"}
        ),
        description="The sandbox container's resources; by default a Guaranteed pod with whole CPUs.",
    )
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    network: Literal["none"] = Field("none", description="Sandboxed code never gets network access.")
    runtime_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description=(
            "RuntimeClass of the sandbox pods, e.g. gvisor or kata: a second kernel boundary around "
            "model-written code (see docs/sandbox.md for what each mode contains)."
        ),
    )
    autoscaling: SandboxAutoscaling | None = None
    pod_template: PodTemplateOverride | None = Field(
        None, description="PodTemplateSpec merged over the rendered sandbox pods (env, secrets, scheduling, ...)."
    )

    @model_validator(mode="after")
    def _replicas_in_bounds(self) -> SandboxPoolSpec:
        default_replicas_to_min(self)
        check_replicas_in_bounds(self.replicas, self.autoscaling)
        return self


class SandboxPoolStatus(ScaledResourceStatus):
    queue_depth: float | None = None
    workers_busy: float | None = None
    announced_workers: float | None = Field(
        None,
        description="Sandbox workers the pool's trainers announced for their coming or current rollout "
        "phases; the pool is held at least that large until the phases are over.",
    )


class SandboxPool(Resource):
    """A pool of CPU pods that execute model-written Python for tool calls, scaled with kubectl scale."""

    KIND: ClassVar[str] = "SandboxPool"
    PLURAL: ClassVar[str] = "sandboxpools"
    SHORT_NAMES: ClassVar[tuple[str, ...]] = ("sbx",)

    kind: Literal["SandboxPool"] = "SandboxPool"
    # Required, as the CRD says (`spec: {}` takes every default): the API server refuses a pool without it.
    spec: SandboxPoolSpec
    status: SandboxPoolStatus | None = None
