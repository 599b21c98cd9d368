"""Pydantic models of the kuberl custom resources: the single source of truth for CRDs and configs.

``job``, ``rollout_fleet``, ``sandbox_pool``: the three kinds; ``common``: metadata, status,
conditions and field rules they share; ``pod_template`` and ``pod_shapes``: podTemplate
overrides and the PodSpec types they hold; ``tracking``: ``spec.tracking``; ``loader``: reading
manifests with errors that name the field; ``crdgen``: the CRDs generated from the models.
"""

from kuberl.api.common import Condition, ObjectMeta, Resource
from kuberl.api.job import AgenticRLJob, AgenticRLJobSpec, AgenticRLJobStatus, StageSpec
from kuberl.api.loader import KINDS, ManifestError, load_manifests, parse_resource
from kuberl.api.rollout_fleet import RolloutFleet, RolloutFleetSpec, RolloutFleetStatus
from kuberl.api.sandbox_pool import SandboxPool, SandboxPoolSpec, SandboxPoolStatus

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
