"""KEDA ScaledObjects: ``kuberl.io/autoscaler: keda`` hands a SandboxPool's or RolloutFleet's
autoscaling to KEDA, on the same signals the operator's own timer reads (``signals``)."""

from __future__ import annotations

from typing import Any

from kuberl.api import Resource, RolloutFleet, SandboxPool
from kuberl.api.group import API_VERSION
from kuberl.operator.render.engines import ENGINE_METRICS
from kuberl.operator.render.render_common import ANNOTATION_AUTOSCALER, Manifest, _meta, object_labels
from kuberl.operator.render.signals import (
    PIPELINE_IDLE_TARGET,
    PIPELINE_WAIT_TARGET,
    TRAINER_ENGINE_IDLE,
    TRAINER_ENGINES_SERVED,
    TRAINER_PHASE_WORKERS,
    TRAINER_ROLLOUT_WAIT,
)

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
    in flight keeps its pods), and the workers the pool's trainers announced for their rollout
    phase, ``sum(kuberl_rollout_phase_workers)`` with threshold workersPerPod
    (``autoscale.phase_floor``: the phase's pods before its burst). RolloutFleet: mean KV-cache
    usage as a Value metric (replicas * usage / target), queued requests per engine, and the
    asynchronous trainers' pipeline (:func:`pipeline_ratio_query`, a Value metric against 1:
    ``autoscale.recommend_by_pipeline`` as a ratio of today's engines; KV usage and queues count
    only while no asynchronous trainer reports, as in ``autoscale.recommend_fleet``). What KEDA
    cannot say:
    the operator drops its stabilization window when a phase is released, and the HPA's 10 %
    tolerance band holds a fleet whose pipeline asks for a change under 10 %.

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
            # the trainers' series carry the pool they call (label ``pool``), as the pool's own do
            trigger("announced-workers", "AverageValue", f"sum({TRAINER_PHASE_WORKERS}{series})", per_pod),
        ]
    else:
        component = "rollout"
        series = f'{{namespace="{namespace}",{PROM_INSTANCE_LABEL}="{name}"}}'
        usage, queue = ENGINE_METRICS[resource.spec.engine.type]
        # asynchronous trainers fill every engine by design: their pipeline decides instead
        unless = f' unless on() count({TRAINER_ROLLOUT_WAIT}{{namespace="{namespace}",fleet="{name}"}}) > 0) or vector(0)'
        triggers = [
            trigger(
                "kv-cache-utilization",
                "Value",
                f"(avg({usage}{series}){unless}",
                auto.target_kv_cache_utilization,
            ),
            trigger(
                "queued-requests",
                "AverageValue",
                f"(sum({queue}{series}){unless}",
                auto.target_queued_requests,
            ),
            trigger("trainer-pipeline", "Value", pipeline_ratio_query(namespace, name, f"{usage}{series}"), 1.0),
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


def pipeline_ratio_query(namespace: str, fleet: str, engine_series: str) -> str:
    """PromQL for the engines an asynchronous run's pipeline asks for, as a ratio of today's
    (``autoscale.recommend_by_pipeline``): with W the largest rollout wait, I the smallest engine
    idle and S the most engines in service over the fleet's trainers, and N today's engines
    (``engine_series``, one series an engine), R = S / N (1 where either is missing); then
    max(R / max(1 - W, 0.5), 1) while W > the wait target, else R (1 - I) / (1 - the idle target)
    while I > the idle target, else 1 (no trainer: no opinion). The trainers label their series
    with the fleet they roll out on (``fleet``)."""
    sel = f'{{namespace="{namespace}",fleet="{fleet}"}}'
    wait, idle = f"max({TRAINER_ROLLOUT_WAIT}{sel})", f"min({TRAINER_ENGINE_IDLE}{sel})"
    served = f"(max({TRAINER_ENGINES_SERVED}{sel}) / count({engine_series}) or vector(1))"
    grow = f"(clamp_min({served} / clamp_min(1 - {wait}, 0.5), 1) and {wait} > {PIPELINE_WAIT_TARGET:g})"
    shrink = f"({served} * (1 - {idle}) / {1 - PIPELINE_IDLE_TARGET:g} and {idle} > {PIPELINE_IDLE_TARGET:g})"
    return f"{grow} or {shrink} or vector(1)"


def wants_keda(resource: Resource) -> bool:
    return resource.metadata.annotations.get(ANNOTATION_AUTOSCALER) == "keda"
