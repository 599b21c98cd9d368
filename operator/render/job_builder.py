"""AgenticRLJob -> its manifests: the trainer's Indexed Job, headless Service, ConfigMap, RBAC,
checkpoint PVC and NetworkPolicy inputs, and the RolloutFleet/SandboxPool it declares inline
(pure; split out of ``builders.py``, which re-exports these names and dispatches to them).
"""

from __future__ import annotations

from typing import Any

import yaml

from kuberl.api import AgenticRLJob
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import ModelRef, RolloutFleetSpec
from kuberl.operator.render import podtemplate, sizing, trainer_runs
from kuberl.operator.render.isolation import (
    token_env,
)
from kuberl.operator.render.render_common import (
    ANNOTATION_CONFIG_HASH,
    JOB_CONFIG_PATH,
    JOB_RUN_DIR,
    SANDBOX_PORT,
    SANDBOX_UID,
    TRAINER_METRICS_PORT,
    TRAINER_RENDEZVOUS_PORT,
    WEIGHTS_VOLUME,
    Manifest,
    _meta,
    _shm_volume,
    accelerator_pod_fields,
    object_labels,
    selector_labels,
    spec_hash,
    weights_volume,
)
from kuberl.operator.render.tracking_env import tracking_env

TRAINER_TMP = "/tmp"
# How long a trainer pod asked to stop (deleted, evicted, its job suspended or preempted) has to
# end its step and write the checkpoint it resumes from (trainer/stages.py stops at a step
# boundary on SIGTERM): an RL step with its rollouts takes minutes on a big model, and the
# kubelet's default 30 s would kill it mid-step, losing every step since the last checkpoint.
TRAINER_GRACE_S = 300
# The trainer images' user (images/trainer/Dockerfile.*), as PodSecurity "restricted" asks.
# fsGroup makes the checkpoint volume writable by it: a fresh volume's root belongs to root
# (CSI volumes, local volumes), and the kubelet gives it to this group.
TRAINER_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": SANDBOX_UID,
    "runAsGroup": SANDBOX_UID,
    "fsGroup": SANDBOX_UID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}


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
            if fleet_spec.accelerator.profile != "cpu":  # the first rollout phase's sandbox sizing
                gpus = fleet_spec.replicas * fleet_spec.accelerator.count * fleet_spec.nodes_per_engine
                env.append({"name": "KUBERL_ROLLOUT_GPUS", "value": str(gpus)})
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
        # the root filesystem is read-only: whatever a library caches under ~ goes to /tmp
        {"name": "HOME", "value": TRAINER_TMP},
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
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kuberl", "readOnly": True},
            {"name": "tmp", "mountPath": TRAINER_TMP},
            {"name": "run", "mountPath": JOB_RUN_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": "/models"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": config_map_name(name)}},
        {"name": "run", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
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
                    "terminationGracePeriodSeconds": TRAINER_GRACE_S,
                    "securityContext": dict(TRAINER_POD_SECURITY, seccompProfile={"type": "RuntimeDefault"}),
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
    # torchrun ends with 1 on SIGTERM: the relay ends with 143 then, which the pod failure policy
    # takes for a trainer stopped at a checkpoint (suspended, preempted), not a failed one
    return [
        "python",
        "-m",
        "kuberl.util.relay",
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


