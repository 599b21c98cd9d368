"""How much CPU, memory and disk an engine or trainer pod asks for (pure).

Requesting only accelerators makes a pod BestEffort: the scheduler counts none of its memory,
it is the first evicted under pressure, and a namespace with a cpu/memory ResourceQuota refuses
it outright ("must specify requests.memory"). Its memory-backed /dev/shm (NCCL/RCCL buffers,
dataloader workers) is charged to the pod's memory cgroup but was counted nowhere, and the
/models cache (downloaded weights) was an unbounded emptyDir.

So, per pod, unless ``resources`` says otherwise:

* ``requests.cpu``: 8 per accelerator (MI300X and H100 nodes have 12-24 cores per device);
  the cpu profile asks for its ``count``;
* ``requests.memory`` = ``limits.memory``: 32Gi per accelerator plus the /dev/shm size, so the
  memory the pod can pin in shm is part of what it is scheduled with (the cpu profile, meant for
  small and local runs, requests 2Gi plus shm and sets no limit it might outgrow);
* /dev/shm: 8Gi per accelerator, at most 64Gi (1Gi for the cpu profile); when ``resources``
  sets a memory limit (or only a request), shm takes at most half of it, so a full shm still
  leaves the process room before the OOM killer;
* /models: an emptyDir bounded by ``modelCacheSize`` and, for accelerator profiles, requested as
  ``ephemeral-storage``, so the scheduler places the pod on a node with room for the weights and
  the kubelet evicts it (instead of filling the node's disk) if a download outgrows it.

No CPU limit is set by default (throttling a GPU feeder costs more than it protects).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kuberl.api.common import AcceleratorSpec, Quantity, ResourceRequirements, quantity_value

GPU_RESOURCES = {"mi300x": "amd.com/gpu", "h100": "nvidia.com/gpu"}
CPU_PER_DEVICE = 8
MEMORY_PER_DEVICE_GI = 32
SHM_PER_DEVICE_GI = 8
SHM_MAX_GI = 64
CPU_PROFILE_MEMORY_GI = 2
CPU_PROFILE_SHM_GI = 1
GI = 2**30


@dataclass(frozen=True)
class PodSize:
    resources: dict[str, Any]  # the main container's requests/limits
    shm: str  # /dev/shm sizeLimit
    model_cache: str  # /models sizeLimit


def _gi(amount: Fraction) -> str:
    """A byte amount as a quantity: whole Gi where exact, else Mi (rounded down)."""
    if amount % GI == 0:
        return f"{int(amount // GI)}Gi"
    return f"{int(amount // 2**20)}Mi"


def size_pod(acc: AcceleratorSpec, user: ResourceRequirements, model_cache: Quantity) -> PodSize:
    gpu = GPU_RESOURCES.get(acc.profile)
    devices = acc.count
    requests = {k: str(v) for k, v in user.requests.items()}
    limits = {k: str(v) for k, v in user.limits.items()}
    if gpu:
        shm_bytes = Fraction(min(SHM_MAX_GI, SHM_PER_DEVICE_GI * devices) * GI)
        base_mem, cpu = MEMORY_PER_DEVICE_GI * devices * GI, CPU_PER_DEVICE * devices
    else:
        shm_bytes = Fraction(CPU_PROFILE_SHM_GI * GI)
        base_mem, cpu = CPU_PROFILE_MEMORY_GI * GI, devices
    user_mem = user.limits.get("memory", user.requests.get("memory"))
    if user_mem is None:
        memory = _gi(base_mem + shm_bytes)
        requests["memory"] = memory
        if gpu:  # a CPU run (a laptop cluster, a tiny model) gets no limit it might outgrow
            limits.setdefault("memory", memory)
    else:
        shm_bytes = min(shm_bytes, quantity_value(user_mem) / 2)
    # (a limit without a request makes the API server use the limit: leave that alone)
    if "cpu" not in limits:
        requests.setdefault("cpu", str(cpu))
    if gpu and "ephemeral-storage" not in limits:
        requests.setdefault("ephemeral-storage", str(model_cache))
    if gpu:
        requests[gpu] = limits[gpu] = str(devices)
    return PodSize(resources={"requests": requests, "limits": limits}, shm=_gi(shm_bytes), model_cache=str(model_cache))
