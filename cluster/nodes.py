"""The simulated nodes a local control plane gets.

Nodes are shaped as the cloud's are, so that the operator's scheduling fields meet what they
would meet there: MI300X nodes carry the AMD GPU operator's labeller labels, H100 nodes NVIDIA
GPU feature discovery's, and both are tainted with their GPU resource name (pods that do not ask
for a GPU stay off them). kwok manages the nodes annotated ``kwok.x-k8s.io/node: fake``: it keeps
them Ready and plays their kubelet for the pods bound to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kuberl.operator.render.render_common import (
    AMD_DEVICE_ID_LABEL,
    AMD_GPU_RESOURCE,
    AMD_PRODUCT_LABEL,
    NVIDIA_GPU_RESOURCE,
    NVIDIA_PRESENT_LABEL,
    NVIDIA_PRODUCT_LABEL,
)

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
"""A running pod labelled with this (value ``"true"``) is marked Failed by kwok's chaos stage, its
containers terminated with exit code 1, as a kubelet reports a crashed process."""
COMPLETE_LABEL = "kwok.kuberl.io/complete"
"""A running pod of a Job labelled with this (value ``"true"``) completes. kwok's released stages
complete every Job pod as soon as it runs (batch work that ends at once); a trainer runs until
its training ends, so here it runs until told."""


@dataclass(frozen=True)
class NodePool:
    """``count`` nodes named ``<prefix>-<i>`` with the same shape."""

    prefix: str
    count: int
    cpu: str
    memory: str
    pods: int
    gpus: dict[str, int]
    labels: dict[str, str]
    taint: str | None = None


def default_pools(*, mi300x: int = 6, h100: int = 2, cpu: int = 4, pods_per_cpu_node: int = 250) -> list[NodePool]:
    """MI300X nodes (8 GPUs), H100 nodes (8 GPUs) and CPU nodes for sandbox pools."""
    return [
        NodePool("mi300x", mi300x, "192", "2Ti", 110, {AMD_GPU_RESOURCE: 8},
                 {AMD_PRODUCT_LABEL: "AMD_Instinct_MI300X_OAM", AMD_DEVICE_ID_LABEL: "74a1"}, AMD_GPU_RESOURCE),
        NodePool("h100", h100, "192", "2Ti", 110, {NVIDIA_GPU_RESOURCE: 8},
                 {NVIDIA_PRESENT_LABEL: "true", NVIDIA_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}, NVIDIA_GPU_RESOURCE),
        NodePool("cpu", cpu, "96", "768Gi", pods_per_cpu_node, {}, {"kuberl.io/node-kind": "cpu"}),
    ]


def node_manifest(pool: NodePool, index: int) -> dict[str, Any]:
    """One kwok-managed Node of ``pool``."""
    name = f"{pool.prefix}-{index}"
    capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": str(pool.pods), "ephemeral-storage": "1Ti",
                **{k: str(v) for k, v in pool.gpus.items()}}
    spec: dict[str, Any] = {}
    if pool.taint:
        spec["taints"] = [{"key": pool.taint, "value": "present", "effect": "NoSchedule"}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": pool.prefix,
                "type": "kwok",
                **pool.labels,
            },
        },
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def node_manifests(pools: list[NodePool]) -> list[dict[str, Any]]:
    return [node_manifest(p, i) for p in pools for i in range(p.count)]


def kwok_config(stage_files: list[Path]) -> str:
    """kwok's configuration: its released pod stages, the Job-pod completion held back until
    COMPLETE_LABEL is set."""
    stages = [yaml.safe_load(p.read_text()) for p in stage_files]
    for stage in stages:
        if stage["metadata"]["name"] == "pod-complete":
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": f'.metadata.labels["{COMPLETE_LABEL}"]', "operator": "In", "values": ["true"]})
    return yaml.safe_dump_all(stages, sort_keys=False)
