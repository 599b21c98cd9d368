"""Kueue's queue objects for one test namespace: a ClusterQueue of its own (``amd.com/gpu`` on a
flavor of the MI300X nodes; CPUs, memory and disk on a default flavor without node labels) and
the LocalQueue ``lq`` that points at it. Shared by tests/test_k8s_kueue.py (kwok's GPU nodes) and
tests/test_real_node_trainer.py (the real node's CPUs)."""

from __future__ import annotations

from dataclasses import dataclass

from k8s_fixtures import Kube

from kuberl.operator.render.render_common import AMD_GPU_RESOURCE, AMD_PRODUCT_LABEL

KUEUE_API = "kueue.x-k8s.io/v1beta2"
LOCAL_QUEUE = "lq"


@dataclass(frozen=True)
class Queues:
    """The cluster-scoped names made for one namespace."""

    gpu_flavor: str
    default_flavor: str
    cluster_queue: str

    def drop(self, kube: Kube) -> None:
        kube.run("delete", "clusterqueue", self.cluster_queue, "--wait=false", check=False)
        kube.run("delete", "resourceflavor", self.gpu_flavor, self.default_flavor, "--wait=false", check=False)


def make_queues(kube: Kube, ns: str, *, gpus: int = 16, cpu: str = "10000", preemption: bool = False) -> Queues:
    """A ClusterQueue for ``ns``'s LocalQueue ``lq``: ``gpus`` MI300X GPUs and ``cpu`` CPUs (memory
    and disk without a real bound); with ``preemption``, a higher-priority workload preempts a
    lower one inside it."""
    names = Queues(f"mi300x-{ns}", f"default-{ns}", f"cq-{ns}")
    other = {"cpu": cpu, "memory": "1000Ti", "ephemeral-storage": "1000Ti"}
    cluster_queue = {
        "apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": names.cluster_queue},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "resourceGroups": [
                {"coveredResources": [AMD_GPU_RESOURCE],
                 "flavors": [{"name": names.gpu_flavor, "resources": [{"name": AMD_GPU_RESOURCE, "nominalQuota": gpus}]}]},
                {"coveredResources": list(other),
                 "flavors": [{"name": names.default_flavor,
                              "resources": [{"name": r, "nominalQuota": q} for r, q in other.items()]}]},
            ],
            **({"preemption": {"withinClusterQueue": "LowerPriority"}} if preemption else {}),
        },
    }  # fmt: skip
    kube.apply([
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": names.gpu_flavor},
         "spec": {"nodeLabels": {AMD_PRODUCT_LABEL: "AMD_Instinct_MI300X_OAM"}}},
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": names.default_flavor}},
        cluster_queue,
        {"apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": LOCAL_QUEUE, "namespace": ns},
         "spec": {"clusterQueue": names.cluster_queue}},
    ])  # fmt: skip
    return names


def priority_class(kube: Kube, name: str, value: int) -> None:
    kube.apply([{"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}])
