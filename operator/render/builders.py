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
import json
from typing import Any

from kuberl.api import AgenticRLJob, Resource, RolloutFleet, SandboxPool
from kuberl.api.common import AcceleratorSpec
from kuberl.api.rollout_fleet import GPUS_PER_NODE, RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.operator.render import disruption, podtemplate, sizing
from kuberl.operator.render.engines import (
    DRAIN_GRACE_S,
    SGLANG_DIST_PORT,
    engine_command,
    engine_env,
    engine_lifecycle,
    engine_probes,
)
from kuberl.operator.render.isolation import (
    fleet_policy,
    sandbox_policy,
    token_env,
    token_secret,
)
from kuberl.operator.render.job_builder import (
    build_job,
)
from kuberl.operator.render.keda import build_keda_scaled_object, wants_keda
from kuberl.operator.render.rbac import (
    operator_rbac_rules,
)
from kuberl.operator.render.render_common import (
    ANNOTATION_CONFIG_HASH,
    APP_NAME,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    MANAGED_BY,
    SANDBOX_PORT,
    SANDBOX_UID,
    WEIGHTS_VOLUME,
    Manifest,
    _meta,
    _resources,
    _shm_volume,
    accelerator_pod_fields,
    object_labels,
    selector_labels,
    spec_hash,
    trainer_peers,
    weights_volume,
)

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
        container["lifecycle"] = engine_lifecycle(spec)
    volumes = [_shm_volume(size.shm), {"name": "model-cache", "emptyDir": {"sizeLimit": size.model_cache}}]
    if spec.weight_sync is not None:
        # The trainer writes policy versions here; the engine only reads them.
        volumes.append(weights_volume(spec.weight_sync))
        container["volumeMounts"].append(
            {"name": WEIGHTS_VOLUME, "mountPath": spec.weight_sync.mount_path, "readOnly": True}
        )
    return {
        "terminationGracePeriodSeconds": DRAIN_GRACE_S,
        "enableServiceLinks": False,
        **accelerator_pod_fields(acc),
        "containers": [container],
        "volumes": volumes,
    }


def engine_selector(fleet: RolloutFleet) -> dict[str, str]:
    """Labels of the pods that serve HTTP: every pod of a Deployment, only LeaderWorkerSet
    leaders (workers carry the same instance labels but serve nothing). The Service, the scale
    subresource's ``status.selector`` and the autoscaler's scrape all use this."""
    sel = selector_labels(fleet.metadata.name, "rollout")
    return sel if fleet.spec.nodes_per_engine == 1 else {**sel, LABEL_ROLE: "leader"}


def _spread_engines(workload: Manifest, sel: dict[str, str], acc: AcceleratorSpec) -> None:
    if workload["kind"] == "Deployment":
        pod = workload["spec"]["template"]["spec"]
        if acc.profile != "cpu" and acc.count < GPUS_PER_NODE:
            pod.setdefault("affinity", {})["podAffinity"] = disruption.pack(sel)
        else:
            pod["topologySpreadConstraints"] = disruption.spread(sel)
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
    _spread_engines(workload, sel, spec.accelerator)
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
