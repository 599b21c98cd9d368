"""What every builder shares: kuberl's labels and annotations, the ports and paths of its pods,
the children each kind may have, and the scheduling fields of an accelerator profile (pure).

Split out of ``builders.py`` (which re-exports every name here) so the per-kind builders
(``builders.py`` for pools and fleets, ``job_builder.py`` for jobs) import one base.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kuberl.api import Resource
from kuberl.api.common import AcceleratorSpec, ResourceRequirements
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import WeightSyncSpec

Manifest = dict[str, Any]

# --- labels -------------------------------------------------------------------------------

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER_KIND = "kuberl.io/owner-kind"
ANNOTATION_CONFIG_HASH = "kuberl.io/config-hash"
ANNOTATION_AUTOSCALER = "kuberl.io/autoscaler"
"""``kuberl.io/autoscaler: keda`` hands a resource's autoscaling to KEDA: ``render`` emits a
ScaledObject and the operator's own autoscaling timer leaves the resource alone."""

APP_NAME = "kuberl"
MANAGED_BY = "kuberl"

SANDBOX_PORT = 8080
TRAINER_RENDEZVOUS_PORT = 29500
TRAINER_METRICS_PORT = 9090
JOB_CONFIG_PATH = "/etc/kuberl/job.yaml"
JOB_RUN_DIR = "/var/run/kuberl"
SANDBOX_UID = 65532  # the distroless "nonroot" uid


def selector_labels(instance: str, component: str) -> dict[str, str]:
    """The labels a Deployment/Service selects on: stable for the object's lifetime."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance, LABEL_COMPONENT: component}


def object_labels(instance: str, component: str, owner_kind: str) -> dict[str, str]:
    """DESIGN.md labels on everything the operator creates, plus the owning kind for watches."""
    return {
        **selector_labels(instance, component),
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_OWNER_KIND: owner_kind,
    }


# Every kind a builder may emit per owner kind (apiVersion, kind); KEDA ScaledObjects are only
# rendered (``kuberl render``), never applied, so they are not children to clean up.
CHILD_KINDS: dict[str, tuple[tuple[str, str], ...]] = {
    "SandboxPool": (
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("policy/v1", "PodDisruptionBudget"),
        ("v1", "Secret"),
    ),
    "RolloutFleet": (
        ("apps/v1", "Deployment"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("policy/v1", "PodDisruptionBudget"),
    ),
    "AgenticRLJob": (
        ("v1", "ServiceAccount"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("v1", "ConfigMap"),
        ("v1", "Service"),
        ("batch/v1", "Job"),
        (API_VERSION, "RolloutFleet"),
        (API_VERSION, "SandboxPool"),
    ),
}
LABEL_ROLE = "kuberl.io/role"


def trainer_peers(resource: Resource) -> dict[str, str]:
    """The trainer pods that may reach a pool's sandboxes or a fleet's engines: one job's when
    ``resource`` is that job's inline child (its labels name the job), else every kuberl
    trainer of the namespace (any job there may reference it)."""
    sel = {LABEL_NAME: APP_NAME, LABEL_COMPONENT: "trainer"}
    labels = resource.metadata.labels
    if labels.get(LABEL_OWNER_KIND) == "AgenticRLJob" and labels.get(LABEL_INSTANCE):
        sel[LABEL_INSTANCE] = labels[LABEL_INSTANCE]
    return sel


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the string form the scale subresource wants (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _meta(name: str, namespace: str, labels: dict[str, str], **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    meta.update({k: v for k, v in extra.items() if v})
    return meta


def _resources(req: ResourceRequirements) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.requests:
        out["requests"] = {k: str(v) for k, v in req.requests.items()}
    if req.limits:
        out["limits"] = {k: str(v) for k, v in req.limits.items()}
    return out


def spec_hash(obj: Any) -> str:
    """Short content hash; put on pod templates so a config change rolls the pods."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --- accelerator profiles -----------------------------------------------------------------

AMD_GPU_RESOURCE = "amd.com/gpu"
NVIDIA_GPU_RESOURCE = "nvidia.com/gpu"
AMD_PRODUCT_LABEL = "amd.com/gpu.product-name"
AMD_DEVICE_ID_LABEL = "amd.com/gpu.device-id"
MI300X_PRODUCT_NAMES = ("AMD_Instinct_MI300X_OAM", "AMD_Instinct_MI300X")
MI300X_DEVICE_IDS = ("74a1", "74b5")  # MI300X and its SR-IOV virtual function
NVIDIA_PRESENT_LABEL = "nvidia.com/gpu.present"
NVIDIA_PRODUCT_LABEL = "nvidia.com/gpu.product"
H100_PRODUCT_NAMES = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-NVL", "NVIDIA-H100-PCIe")


def accelerator_pod_fields(acc: AcceleratorSpec) -> dict[str, Any]:
    """Scheduling fields (affinity/tolerations) for an accelerator profile.

    mi300x: nodes whose GPUs the AMD GPU operator's node labeller names MI300X, by product name
    or by PCI device id (nodeSelectorTerms are ORed). Not "any AMD GPU" (Node Feature
    Discovery's ``feature.node.kubernetes.io/amd-gpu``): the default images are built for MI30x
    (gfx942) only and would fail on other AMD GPUs. h100: NVIDIA GPU feature discovery's
    product label.
    GPU nodes are commonly tainted with the resource name, so both tolerate that taint.
    """
    if acc.profile == "mi300x":
        terms = [
            {
                "matchExpressions": [
                    {"key": AMD_PRODUCT_LABEL, "operator": "In", "values": list(MI300X_PRODUCT_NAMES)}
                ]
            },
            {
                "matchExpressions": [
                    {"key": AMD_DEVICE_ID_LABEL, "operator": "In", "values": list(MI300X_DEVICE_IDS)}
                ]
            },
        ]
        taint = AMD_GPU_RESOURCE
    elif acc.profile == "h100":
        terms = [
            {
                "matchExpressions": [
                    {"key": NVIDIA_PRODUCT_LABEL, "operator": "In", "values": list(H100_PRODUCT_NAMES)}
                ]
            }
        ]
        taint = NVIDIA_GPU_RESOURCE
    else:
        return {}
    return {
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
        },
        "tolerations": [{"key": taint, "operator": "Exists", "effect": "NoSchedule"}],
    }


def _shm_volume(size: str) -> dict[str, Any]:
    # NCCL/RCCL and torch dataloaders use /dev/shm; the container default (64 MiB) is too small.
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}



WEIGHTS_VOLUME = "policy-weights"


def weights_volume(ws: WeightSyncSpec) -> dict[str, Any]:
    return {"name": WEIGHTS_VOLUME, "persistentVolumeClaim": {"claimName": ws.claim_name}}
