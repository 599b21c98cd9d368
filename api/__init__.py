"""Pydantic models of the kuberl custom resources: the single source of truth for CRDs and configs."""

from .common import Condition, ObjectMeta, Resource
from .job import AgenticRLJob, AgenticRLJobSpec, AgenticRLJobStatus, StageSpec
from .loader import KINDS, ManifestError, load_manifests, parse_resource
from .rollout_fleet import RolloutFleet, RolloutFleetSpec, RolloutFleetStatus
from .sandbox_pool import SandboxPool, SandboxPoolSpec, SandboxPoolStatus

__all__ = [
    "KINDS",
    "AgenticRLJob",
    "AgenticRLJobSpec",
    "AgenticRLJobStatus",
    "Condition",
    "ManifestError",
    "ObjectMeta",
    "Resource",
    "RolloutFleet",
    "RolloutFleetSpec",
    "RolloutFleetStatus",
    "SandboxPool",
    "SandboxPoolSpec",
    "SandboxPoolStatus",
    "StageSpec",
    "load_manifests",
    "parse_resource",
]
