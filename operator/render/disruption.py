"""Keeping enough engines and sandboxes up through node drains and spreading them (pure).

* A PodDisruptionBudget per SandboxPool and RolloutFleet: a node drain (cluster upgrade,
  autoscaler scale-down) evicts at most one engine (one LeaderWorkerSet group: all its pods) or
  a quarter of the sandbox pods at a time, instead of every replica that shares the node pool.
  The trainer gets none: a distributed step cannot lose a rank anyway, the Job ignores the
  eviction (podFailurePolicy) and the operator restarts it from its checkpoint.
* A topology spread over nodes (``ScheduleAnyway``: a preference, never a reason to stay
  Pending), so one node going away does not take several engines or sandboxes with it.
* Except for engines that use part of a GPU node: those are packed onto as few nodes as they
  fill. Spread, eight 1-GPU engines take a GPU on each of eight nodes and no trainer rank that
  needs a whole node (8 GPUs) fits anywhere, though 56 GPUs are free.
"""

from __future__ import annotations

from typing import Any

HOSTNAME = "kubernetes.io/hostname"


def budget(
    name: str, namespace: str, labels: dict[str, str], selector: dict[str, str], max_unavailable: int | str
) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": dict(selector)}},
    }


def spread(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(selector)},
        }
    ]


def pack(selector: dict[str, str]) -> dict[str, Any]:
    """A pod affinity (preferred, never a reason to stay Pending) for the nodes that already run
    pods of ``selector``: partial-node GPU pods fill nodes and leave whole ones free."""
    return {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": HOSTNAME},
            }
        ]
    }
