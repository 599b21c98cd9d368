"""Pure builders: a kuberl custom resource in, the Kubernetes manifests that run it out.

Nothing here talks to a cluster. The kopf handlers (``handlers.py``) adopt and apply what
these functions return, and ``kuberl render FILE`` prints it, so what a person reviews with
``render`` is byte-for-byte what the operator creates (minus ownerReferences, which need the
owner's uid).

Naming (``<name>`` is the custom resource's name):

* SandboxPool ``<name>``: Deployment ``<name>``, Service ``<name>`` (port ``http``),
  NetworkPolicy ``<name>-deny-egress``.
* RolloutFleet ``<name>``: Deployment ``<name>`` (or LeaderWorkerSet ``<name>`` when one
  engine spans nodes), headless Service ``<name>`` (port ``http``; one DNS record per engine).
* AgenticRLJob ``<name>``: ServiceAccount/Role/RoleBinding ``<name>-trainer`` (read
  EndpointSlices), ConfigMap ``<name>-config`` (key ``job.yaml``), headless Service
  ``<name>-trainer``, Indexed Job ``<name>-trainer``, and -- only when declared inline --
  RolloutFleet ``<name>-rollout`` and SandboxPool ``<name>-sandbox``.

``CHILD_KINDS`` lists every kind each builder can emit, so the operator can find (by the
instance label and the owner's uid) and delete children a spec change no longer builds.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from kuberl import API_VERSION
from kuberl.api import AgenticRLJob, Resource, RolloutFleet, SandboxPool
from kuberl.api.common import AcceleratorSpec, ResourceRequirements
from kuberl.api.rollout_fleet import ModelRef, RolloutFleetSpec, WeightSyncSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator import disruption, podtemplate, sizing, trainer_runs
from kuberl.operator.engines import (
    ENGINE_METRICS,
    SGLANG_DIST_PORT,
    engine_command,
    engine_env,
    engine_probes,
)
from kuberl.operator.isolation import (
    fleet_policy,
    sandbox_policy,
    token_env,
    token_secret,
)
from kuberl.operator.rbac import (  # noqa: F401 - re-exported: the operator's RBAC lived here
    operator_cluster_rules,
    operator_namespaced_rules,
    operator_rbac_rules,
)
from kuberl.operator.tracking_env import tracking_env

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


# --- SandboxPool --------------------------------------------------------------------------


SANDBOX_TMP_MARGIN_MIB = 256


def sandbox_tmp_mib(spec: SandboxPoolSpec) -> int:
    """Size of a sandbox pod's /tmp: a call is killed beyond ``diskMB``, so the workers together
    can never fill it (an emptyDir over its sizeLimit gets the whole pod evicted)."""
    return spec.workers_per_pod * spec.limits.disk_mb + SANDBOX_TMP_MARGIN_MIB


def build_sandbox_pool(pool: SandboxPool, namespace: str = "default") -> list[Manifest]:
    """Deployment + Service + egress-denying NetworkPolicy for a SandboxPool.

    Security tradeoff (documented because the sandbox design wants more than a restricted pod
    grants): the pod runs under the Kubernetes "restricted" profile -- non-root uid 65532,
    seccomp RuntimeDefault, no privilege escalation, every capability dropped, read-only root
    filesystem with writable emptyDirs for /tmp and the workers' scratch space, no service
    account token. Without CAP_SYS_ADMIN the server cannot create its own network namespace
    or per-call cgroups, so inside a pod it relies on (1) this NetworkPolicy for "no network",
    (2) the container's own PID namespace and cgroup (pod limits) as the outer bound, and
    (3) per-call rlimits (CPU, AS, FSIZE, NOFILE, NPROC), setsid + kill of the process group,
    and a pyseccomp filter, all of which work unprivileged (no_new_privs is already set).
    Granting SYS_ADMIN to regain per-call cgroups would weaken the pod far more than it gains.
    """
    spec: SandboxPoolSpec = pool.spec
    name = pool.metadata.name
    sel = selector_labels(name, "sandbox")
    labels = object_labels(name, "sandbox", "SandboxPool")
    limits_json = json.dumps(spec.limits.wire(), sort_keys=True)
    pod_annotations = {
        ANNOTATION_CONFIG_HASH: spec_hash([spec.image, spec.workers_per_pod, limits_json]),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(SANDBOX_PORT),
        "prometheus.io/path": "/metrics",
    }
    container = {
        "name": "sandbox",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kuberl", "sandbox", "serve"],
        "args": [
            "--host",
            "0.0.0.0",
            "--port",
            str(SANDBOX_PORT),
            "--workers",
            str(spec.workers_per_pod),
            "--pool",
            name,
        ],  # fmt: skip
        "env": [
            {"name": "KUBERL_SANDBOX_LIMITS", "value": limits_json},
            {"name": "KUBERL_SANDBOX_POOL", "value": name},
            token_env(name),
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        ],
        "ports": [{"name": "http", "containerPort": SANDBOX_PORT, "protocol": "TCP"}],
        "resources": _resources(spec.resources),
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": SANDBOX_UID,
            "runAsGroup": SANDBOX_UID,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "work", "mountPath": "/work"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": sel},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels, "annotations": pod_annotations},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": int(spec.limits.timeout_seconds) + 5,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": SANDBOX_UID,
                        "runAsGroup": SANDBOX_UID,
                        "fsGroup": SANDBOX_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    **({"runtimeClassName": spec.runtime_class_name} if spec.runtime_class_name else {}),
                    "containers": [container],
                    "volumes": [
                        # the workers' scratch directories live in /tmp: room for every worker's
                        # disk quota (spec.limits.diskMB) plus the server's own files
                        {"name": "tmp", "emptyDir": {"sizeLimit": f"{sandbox_tmp_mib(spec)}Mi"}},
                        {"name": "work", "emptyDir": {"sizeLimit": "4Gi"}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "selector": sel,
            "ports": [{"name": "http", "port": SANDBOX_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    netpol = sandbox_policy(
        _meta(f"{name}-deny-egress", namespace, labels),
        sel,
        SANDBOX_PORT,
        trainers=trainer_peers(pool),
        annotations=pool.metadata.annotations,
    )
    deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] = disruption.spread(sel)
    deployment["spec"]["template"] = podtemplate.apply(deployment["spec"]["template"], spec.pod_template)
    pdb = disruption.budget(name, namespace, labels, sel, "25%")
    return [deployment, service, netpol, pdb, token_secret(name, namespace, labels)]


# --- RolloutFleet -------------------------------------------------------------------------


def _engine_pod_spec(
    spec: RolloutFleetSpec, served_name: str, *, multi_node: bool, leader: bool
) -> dict[str, Any]:
    eng = spec.engine
    acc = spec.accelerator
    size = sizing.size_pod(acc, spec.resources, spec.model_cache_size)
    container: dict[str, Any] = {
        "name": spec.engine.type,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": engine_command(spec, served_name, multi_node=multi_node),
        "env": engine_env(spec),
        "ports": [{"name": "http", "containerPort": eng.port, "protocol": "TCP"}],
        "resources": size.resources,
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": "/models"},
        ],
    }
    if multi_node:
        container["ports"].append({"name": "dist", "containerPort": SGLANG_DIST_PORT, "protocol": "TCP"})
    if leader:
        container.update(engine_probes(spec))
    volumes = [_shm_volume(size.shm), {"name": "model-cache", "emptyDir": {"sizeLimit": size.model_cache}}]
    if spec.weight_sync is not None:
        # The trainer writes policy versions here; the engine only reads them.
        volumes.append(weights_volume(spec.weight_sync))
        container["volumeMounts"].append(
            {"name": WEIGHTS_VOLUME, "mountPath": spec.weight_sync.mount_path, "readOnly": True}
        )
    return {
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
        **accelerator_pod_fields(acc),
        "containers": [container],
        "volumes": volumes,
    }


WEIGHTS_VOLUME = "policy-weights"


def weights_volume(ws: WeightSyncSpec) -> dict[str, Any]:
    return {"name": WEIGHTS_VOLUME, "persistentVolumeClaim": {"claimName": ws.claim_name}}


def engine_selector(fleet: RolloutFleet) -> dict[str, str]:
    """Labels of the pods that serve HTTP: every pod of a Deployment, only LeaderWorkerSet
    leaders (workers carry the same instance labels but serve nothing). The Service, the scale
    subresource's ``status.selector`` and the autoscaler's scrape all use this."""
    sel = selector_labels(fleet.metadata.name, "rollout")
    return sel if fleet.spec.nodes_per_engine == 1 else {**sel, LABEL_ROLE: "leader"}


def _spread_engines(workload: Manifest, sel: dict[str, str]) -> None:
    if workload["kind"] == "Deployment":
        workload["spec"]["template"]["spec"]["topologySpreadConstraints"] = disruption.spread(sel)
    else:  # groups' leaders apart (the workers follow their leader's group placement)
        leader = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        leader["spec"]["topologySpreadConstraints"] = disruption.spread({**sel, LABEL_ROLE: "leader"})


def _override_templates(workload: Manifest, spec: RolloutFleetSpec) -> None:
    """The fleet's podTemplate goes over every engine pod (LeaderWorkerSet leaders and workers)."""
    if workload["kind"] == "Deployment":
        workload["spec"]["template"] = podtemplate.apply(workload["spec"]["template"], spec.pod_template)
        return
    lwt = workload["spec"]["leaderWorkerTemplate"]
    for part in ("leaderTemplate", "workerTemplate"):
        lwt[part] = podtemplate.apply(lwt[part], spec.pod_template)


def build_rollout_fleet(fleet: RolloutFleet, namespace: str = "default") -> list[Manifest]:
    """Engines (SGLang or vLLM) for a RolloutFleet plus a headless Service for per-engine discovery.

    One engine = one pod (Deployment) when its tensor-parallel group fits one node; otherwise
    one engine = one LeaderWorkerSet group of ``nodes_per_engine`` pods, and the Service
    selects only group leaders (worker index 0), which are the ones serving HTTP.
    """
    spec = fleet.spec
    name = fleet.metadata.name
    sel = selector_labels(name, "rollout")
    labels = object_labels(name, "rollout", "RolloutFleet")
    nodes = spec.nodes_per_engine
    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.engine.port),
        "prometheus.io/path": "/metrics",
    }
    if nodes == 1:
        workload: Manifest = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(name, namespace, labels),
            "spec": {
                "replicas": spec.replicas,
                "selector": {"matchLabels": sel},
                # No spare accelerators for a surge pod: replace engines one at a time.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                "template": {
                    "metadata": {"labels": labels, "annotations": pod_annotations},
                    "spec": _engine_pod_spec(spec, name, multi_node=False, leader=True),
                },
            },
        }
        service_selector = sel
    else:
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": _meta(name, namespace, labels),
            "spec": {
                "replicas": spec.replicas,
                "startupPolicy": "LeaderCreated",
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
                },
                "leaderWorkerTemplate": {
                    "size": nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": {
                            "labels": {**labels, LABEL_ROLE: "leader"},
                            "annotations": pod_annotations,
                        },
                        "spec": _engine_pod_spec(spec, name, multi_node=True, leader=True),
                    },
                    "workerTemplate": {
                        "metadata": {"labels": {**labels, LABEL_ROLE: "worker"}},
                        "spec": _engine_pod_spec(spec, name, multi_node=True, leader=False),
                    },
                },
            },
        }
        service_selector = engine_selector(fleet)
    _spread_engines(workload, sel)
    _override_templates(workload, spec)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "clusterIP": "None",  # headless: DNS returns every ready engine; the scheduler picks
            "selector": service_selector,
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    netpol = fleet_policy(
        _meta(f"{name}-ingress", namespace, labels),
        sel,
        spec.engine.port,
        trainers=trainer_peers(fleet),
        annotations=fleet.metadata.annotations,
    )
    # One engine at a time: a Deployment pod, or every pod of one LeaderWorkerSet group.
    pdb = disruption.budget(name, namespace, labels, sel, nodes)
    return [workload, service, netpol, pdb]


# --- AgenticRLJob -------------------------------------------------------------------------


def inline_fleet_name(job_name: str) -> str:
    return f"{job_name}-rollout"


def inline_pool_name(job_name: str) -> str:
    return f"{job_name}-sandbox"


def trainer_name(job_name: str) -> str:
    return f"{job_name}-trainer"


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def uses_fleet(job: AgenticRLJob) -> bool:
    """``rollout.engine: local`` runs generation inside the trainer: no fleet is created."""
    return job.spec.rollout.engine != "local"


def _inline_child(
    job: AgenticRLJob, namespace: str, kind: str, name: str, component: str, wire: dict[str, Any]
) -> Manifest:
    if job.spec.suspend:  # a suspended job holds no accelerators and no sandbox pods
        wire["replicas"] = 0
        wire.pop("autoscaling", None)
    labels = object_labels(job.metadata.name, component, "AgenticRLJob")
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": _meta(name, namespace, labels), "spec": wire}


def _inline_children(job: AgenticRLJob, namespace: str) -> list[Manifest]:
    name = job.metadata.name
    out: list[Manifest] = []
    fleet = job.spec.rollout.fleet
    if fleet is not None and uses_fleet(job):
        fspec = fleet.model_copy(deep=True)
        if fspec.model is None:
            fspec.model = ModelRef(uri=job.spec.model.base, served_name="policy")
        wire = RolloutFleetSpec.model_validate(fspec.wire()).wire()
        out.append(_inline_child(job, namespace, "RolloutFleet", inline_fleet_name(name), "rollout", wire))
    pool = job.spec.sandbox.pool
    if pool is not None:
        out.append(
            _inline_child(job, namespace, "SandboxPool", inline_pool_name(name), "sandbox", pool.wire())
        )
    return out


def resolved_job_document(job: AgenticRLJob, namespace: str) -> dict[str, Any]:
    """The job as the in-pod trainer reads it: defaults filled in, inline children as refs.

    The trainer never creates cluster objects; it is told which fleet/pool to use and finds
    their engines/workers through the Services named after them (see ``endpoints_env``).
    """
    doc = AgenticRLJob.model_validate(job.wire()).wire()
    doc.pop("status", None)
    # Suspension is the Job controller's business; keeping it out of the document keeps the
    # pod template (whose hash covers this document) unchanged across suspend/resume.
    doc["spec"].pop("suspend", None)
    meta = {"name": job.metadata.name, "namespace": namespace}
    if job.metadata.labels:
        meta["labels"] = dict(job.metadata.labels)
    doc["metadata"] = meta
    rollout, sandbox = doc["spec"]["rollout"], doc["spec"]["sandbox"]
    if rollout.pop("fleet", None) is not None and uses_fleet(job):
        rollout["fleetRef"] = inline_fleet_name(job.metadata.name)
    if sandbox.pop("pool", None) is not None:
        sandbox["poolRef"] = inline_pool_name(job.metadata.name)
    return doc


def job_fleet_spec(job: AgenticRLJob, referenced: RolloutFleetSpec | None = None) -> RolloutFleetSpec | None:
    """The spec of the fleet a job rolls out on: its inline fleet, else the referenced one
    (which the operator reads from the cluster; None when unknown or not rolling out on a fleet)."""
    if not uses_fleet(job):
        return None
    return job.spec.rollout.fleet or (referenced if job.spec.rollout.fleet_ref else None)


def endpoints_env(
    job: AgenticRLJob, namespace: str, fleet_spec: RolloutFleetSpec | None = None
) -> list[dict[str, str]]:
    """Where the trainer finds its fleet and pool (in-cluster DNS of their Services), how to
    schedule over the fleet and where its engines load new weights from."""
    env: list[dict[str, str]] = []
    fleet = job.spec.rollout.fleet_ref or (
        inline_fleet_name(job.metadata.name) if job.spec.rollout.fleet else None
    )
    if fleet and uses_fleet(job):
        port = fleet_spec.engine.port if fleet_spec else 30000
        env.append({"name": "KUBERL_ROLLOUT_FLEET", "value": fleet})
        env.append({"name": "KUBERL_ROLLOUT_SERVICE", "value": f"{fleet}.{namespace}.svc:{port}"})
        if fleet_spec is not None:
            env.append({"name": "KUBERL_ROLLOUT_ENGINE", "value": fleet_spec.engine.type})
            env.append({"name": "KUBERL_ROLLOUT_DTYPE", "value": fleet_spec.engine.dtype})
            env.append({"name": "KUBERL_SCHEDULER_POLICY", "value": fleet_spec.scheduler.policy})
            if fleet_spec.weight_sync is not None:
                env.append({"name": "KUBERL_WEIGHTS_DIR", "value": fleet_spec.weight_sync.mount_path})
    pool = job.spec.sandbox.pool_ref or (
        inline_pool_name(job.metadata.name) if job.spec.sandbox.pool else None
    )
    if pool:
        env.append({"name": "KUBERL_SANDBOX_POOL", "value": pool})
        env.append({"name": "KUBERL_SANDBOX_URL", "value": f"http://{pool}.{namespace}.svc:{SANDBOX_PORT}"})
        env.append(token_env(pool))
    return env


def build_job(
    job: AgenticRLJob, namespace: str = "default", fleet: RolloutFleetSpec | None = None
) -> list[Manifest]:
    """ConfigMap + headless Service + Indexed Job of trainer pods (+ inline fleet/pool CRs).

    An Indexed Job (not a StatefulSet) because training runs to completion: its pods get
    stable hostnames ``<job>-trainer-<i>`` under the headless Service, so rank 0 is the
    torch.distributed rendezvous (MASTER_ADDR) and JOB_COMPLETION_INDEX is the node rank;
    Job conditions (Complete/Failed) and ``suspend`` give completion, failure and pausing.
    """
    spec = job.spec
    name = job.metadata.name
    tname = trainer_name(name)
    sel = selector_labels(name, "trainer")
    labels = object_labels(name, "trainer", "AgenticRLJob")
    doc = resolved_job_document(job, namespace)
    job_yaml = yaml.safe_dump(doc, sort_keys=False)
    fleet_spec = job_fleet_spec(job, fleet)
    trainer = spec.trainer
    acc = trainer.accelerator
    size = sizing.size_pod(acc, trainer.resources, trainer.model_cache_size)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(config_map_name(name), namespace, labels),
        "data": {"job.yaml": job_yaml},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(tname, namespace, labels),
        "spec": {
            "clusterIP": "None",
            # Rendezvous happens before any pod is Ready; DNS must resolve them anyway.
            "publishNotReadyAddresses": True,
            "selector": sel,
            "ports": [
                {"name": "rendezvous", "port": TRAINER_RENDEZVOUS_PORT, "protocol": "TCP"},
                {"name": "metrics", "port": TRAINER_METRICS_PORT, "protocol": "TCP"},
            ],
        },
    }
    master = f"{tname}-0.{tname}.{namespace}.svc"
    env = [
        {"name": "KUBERL_JOB", "value": name},
        {"name": "KUBERL_METRICS_PORT", "value": str(TRAINER_METRICS_PORT)},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(TRAINER_RENDEZVOUS_PORT)},
        {"name": "NNODES", "value": str(trainer.replicas)},
        {"name": "NPROC_PER_NODE", "value": str(acc.count)},
        {"name": "WORLD_SIZE", "value": str(trainer_world_size(job))},
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "HF_HOME", "value": "/models"},
        {"name": "KUBERL_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *endpoints_env(job, namespace, fleet_spec),
        *tracking_env(spec.tracking, trainer_runs.CHECKPOINT_DIR if spec.checkpoint.on_volume else None),
    ]
    if trainer.threads:
        env.append({"name": "OMP_NUM_THREADS", "value": str(trainer.threads)})
    container = {
        "name": "trainer",
        "image": trainer.resolved_image,
        "imagePullPolicy": "IfNotPresent",
        "command": trainer_command(job),
        # A crash's last log lines become the pod's termination message -> job status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": env,
        "ports": [
            {"name": "rendezvous", "containerPort": TRAINER_RENDEZVOUS_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": TRAINER_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": size.resources,
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kuberl", "readOnly": True},
            {"name": "run", "mountPath": JOB_RUN_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": "/models"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": config_map_name(name)}},
        {"name": "run", "emptyDir": {}},
        _shm_volume(size.shm),
        {"name": "model-cache", "emptyDir": {"sizeLimit": size.model_cache}},
    ]
    if fleet_spec is not None and fleet_spec.weight_sync is not None:
        volumes.append(weights_volume(fleet_spec.weight_sync))
        container["volumeMounts"].append(
            {"name": WEIGHTS_VOLUME, "mountPath": fleet_spec.weight_sync.mount_path}
        )
    claim = trainer_runs.checkpoint_claim(job, namespace, labels)
    if (ckpt := trainer_runs.checkpoint_volume(job)) is not None:
        volumes.append(ckpt[0])
        container["volumeMounts"].append(ckpt[1])
    trainer_job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(tname, namespace, labels),
        "spec": {
            "completionMode": "Indexed",
            "completions": trainer.replicas,
            "parallelism": trainer.replicas,
            # A distributed step cannot survive a lost rank: fail fast, and the operator restarts
            # the whole trainer (trainer.maxRestarts), which resumes from its last checkpoint.
            # Evicted/preempted pods are replaced without counting (podFailurePolicy).
            "backoffLimit": 0,
            "podFailurePolicy": trainer_runs.POD_FAILURE_POLICY,
            "suspend": spec.suspend,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        # Only what defines the run: a label on the job must not replace it.
                        ANNOTATION_CONFIG_HASH: spec_hash(trainer_runs.run_document(doc)),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(TRAINER_METRICS_PORT),
                    },
                },
                "spec": {
                    "restartPolicy": "Never",
                    "subdomain": tname,
                    "serviceAccountName": tname,
                    "enableServiceLinks": False,
                    **accelerator_pod_fields(acc),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    trainer_job["spec"]["template"] = podtemplate.apply(trainer_job["spec"]["template"], trainer.pod_template)
    return [
        *trainer_rbac(job, namespace),
        config_map,
        service,
        *([claim] if claim is not None else []),
        trainer_job,
        *_inline_children(job, namespace),
    ]


def trainer_world_size(job: AgenticRLJob) -> int:
    acc = job.spec.trainer.accelerator
    return job.spec.trainer.replicas * (acc.count if acc.profile != "cpu" else 1)


def trainer_command(job: AgenticRLJob) -> list[str]:
    """``kuberl run`` on the resolved job; under torchrun when the job spans several processes
    (one per accelerator in every trainer pod; rank 0's pod is the rendezvous, see build_job).
    ``$(VAR)`` is expanded by the kubelet from the container's env."""
    run = ["run", JOB_CONFIG_PATH, "--out", JOB_RUN_DIR]
    if trainer_world_size(job) == 1:
        return ["kuberl", *run]
    return [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "kuberl",
        *run,
    ]


def trainer_rbac(job: AgenticRLJob, namespace: str) -> list[Manifest]:
    """The trainer's own identity: it may read EndpointSlices (to find the fleet's ready
    engines, see kuberl.rollout.discovery) in its namespace, and nothing else."""
    name = trainer_name(job.metadata.name)
    labels = object_labels(job.metadata.name, "trainer", "AgenticRLJob")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(name, namespace, labels),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(name, namespace, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


# --- KEDA ---------------------------------------------------------------------------------

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# app.kubernetes.io/instance as a Prometheus label (the chart's monitors copy it onto every series).
PROM_INSTANCE_LABEL = "app_kubernetes_io_instance"


def build_keda_scaled_object(
    resource: Resource, namespace: str = "default", prometheus_url: str = DEFAULT_PROMETHEUS
) -> Manifest:
    """A KEDA ScaledObject equivalent to the operator's own autoscaling timer.

    KEDA scales the custom resource itself through its scale subresource (kubectl-scale
    semantics), so the operator keeps reconciling the Deployment from spec.replicas. Several
    triggers make the HPA take the largest demand, as ``autoscale.recommend_*`` does.

    SandboxPool: queued calls, ``sum(queue)/workersPerPod`` as an AverageValue metric gives
    ``ceil(queue / (workersPerPod * targetQueuePerWorker))`` pods, and busy workers,
    ``sum(busy)`` with threshold workersPerPod gives ``ceil(busy / workersPerPod)`` pods (work
    in flight keeps its pods). RolloutFleet: mean KV-cache usage as a Value metric
    (replicas * usage / target) and queued requests per engine.

    Every query selects one object's series only: the namespace plus the pool's own ``pool``
    label, or for SGLang (whose metrics carry no fleet name) the ``app_kubernetes_io_instance``
    label that the chart's PodMonitor copies from the pod (``podTargetLabels``). A name regex
    such as ``pod=~"gen-.*"`` would also match fleet ``gen-x``.
    """
    if not isinstance(resource, SandboxPool | RolloutFleet):
        raise ValueError(f"{resource.KIND} has no autoscaling; KEDA applies to SandboxPool and RolloutFleet")
    name = resource.metadata.name
    auto = resource.spec.autoscaling
    if auto is None:
        raise ValueError(f"{resource.KIND}/{name}: spec.autoscaling is not set, nothing to render for KEDA")

    def trigger(trigger_name: str, metric_type: str, query: str, threshold: float) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": trigger_name,
            "metricType": metric_type,
            "metadata": {"serverAddress": prometheus_url, "query": query, "threshold": f"{threshold:g}"},
        }

    if isinstance(resource, SandboxPool):
        component = "sandbox"
        series = f'{{namespace="{namespace}",pool="{name}"}}'
        per_pod = resource.spec.workers_per_pod
        triggers = [
            trigger(
                "queue-per-worker",
                "AverageValue",
                f"sum(kuberl_sandbox_queue_depth{series}) / {per_pod}",
                auto.target_queue_per_worker,
            ),
            trigger("busy-workers", "AverageValue", f"sum(kuberl_sandbox_workers_busy{series})", per_pod),
        ]
    else:
        component = "rollout"
        series = f'{{namespace="{namespace}",{PROM_INSTANCE_LABEL}="{name}"}}'
        usage, queue = ENGINE_METRICS[resource.spec.engine.type]
        triggers = [
            trigger(
                "kv-cache-utilization",
                "Value",
                f"avg({usage}{series})",
                auto.target_kv_cache_utilization,
            ),
            trigger(
                "queued-requests",
                "AverageValue",
                f"sum({queue}{series})",
                auto.target_queued_requests,
            ),
        ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(name, namespace, object_labels(name, component, resource.KIND)),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": resource.KIND, "name": name},
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": 15,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds}
                    }
                }
            },
            "triggers": triggers,
        },
    }


def wants_keda(resource: Resource) -> bool:
    return resource.metadata.annotations.get(ANNOTATION_AUTOSCALER) == "keda"


# --- dispatch -----------------------------------------------------------------------------


def build_for(
    resource: Resource, namespace: str = "default", *, fleet: RolloutFleetSpec | None = None
) -> list[Manifest]:
    """Every manifest the operator creates for ``resource`` (dispatch on kind; used by render).

    ``fleet``: the spec of the RolloutFleet an AgenticRLJob references (its scheduler policy
    and weightSync volume go into the trainer pods). Objects carry no ownerReferences here:
    those need the live owner's uid and are added by the operator (kopf.adopt) when it applies them.
    """
    ns = resource.metadata.namespace or namespace
    if isinstance(resource, SandboxPool):
        out = build_sandbox_pool(resource, ns)
    elif isinstance(resource, RolloutFleet):
        out = build_rollout_fleet(resource, ns)
    elif isinstance(resource, AgenticRLJob):
        out = build_job(resource, ns, fleet)
    else:
        raise ValueError(f"no builder for kind {resource.KIND!r}")
    if (
        isinstance(resource, SandboxPool | RolloutFleet)
        and wants_keda(resource)
        and resource.spec.autoscaling
    ):
        out.append(build_keda_scaled_object(resource, ns))
    return copy.deepcopy(out)


# --- the operator itself ------------------------------------------------------------------

OPERATOR_IMAGE = "ghcr.io/kuberl/kuberl:0.1.0"
OPERATOR_METRICS_PORT = 8080


def build_operator(namespace: str = "kuberl-system", image: str = OPERATOR_IMAGE) -> list[Manifest]:
    """ServiceAccount, ClusterRole(+Binding) and Deployment that run ``kuberl operator -A``.

    One replica without leader election (the chart adds the Lease election): run exactly one. Its own
    Prometheus metrics (``kuberl_autoscaler_*``) are served on the container port ``metrics``.
    """
    name = "kuberl-operator"
    labels = {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: "operator",
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    sel = {LABEL_NAME: APP_NAME, LABEL_COMPONENT: "operator"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": labels},
            "rules": operator_rbac_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(name, namespace, labels),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # never two operators at once
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": name,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": SANDBOX_UID,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "operator",
                                "image": image,
                                "command": ["kuberl", "operator", "--all-namespaces"],
                                "env": [
                                    {
                                        "name": "KUBERL_OPERATOR_METRICS_PORT",
                                        "value": str(OPERATOR_METRICS_PORT),
                                    }
                                ],
                                "ports": [
                                    {
                                        "name": "metrics",
                                        "containerPort": OPERATOR_METRICS_PORT,
                                        "protocol": "TCP",
                                    }
                                ],
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "256Mi"},
                                    "limits": {"memory": "1Gi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
        },
    ]
