"""How the sandbox is configured: the types every room of the sandbox imports.

:class:`ServiceConfig` is the service's (``kuberl sandbox serve``). The service builds a
:class:`WorkerConfig` per worker and passes it as one JSON argument; the worker, its zygotes
and every call's parent and child side read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker and its zygotes import this module: pydantic stays out of them
    from kuberl.api.sandbox_pool import SandboxLimits

DEFAULT_UID_BASE = 61000


@dataclass
class WorkerConfig:
    """Everything a worker needs; passed as one JSON argument by the server."""

    slot: int
    pool: str = "local"
    timeout_seconds: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 16384
    max_processes: int = 32
    max_file_mb: int = 64
    disk_mb: int = 256
    verify_timeout_seconds: float = 5.0
    in_namespace: bool = False
    isolation: str = "full"  # "basic": no slot uid, no cgroups (see ServiceConfig.isolation)
    uid_base: int = DEFAULT_UID_BASE  # the server draws a random block so services never share uids
    protections: dict[str, bool] = field(default_factory=dict)
    cpu: int | None = None  # the CPU this worker, its zygotes and its calls keep to (service.workers.worker_cpus)


@dataclass
class ServiceConfig:
    workers: int
    pool: str = "local"
    limits: SandboxLimits | None = None
    batch_size: int = 4
    flush_ms: float = 0.0
    queue_limit: int = 4096
    remember: int = 200_000
    remember_bytes: int = 256 * 2**20
    remember_ttl_s: float = 1800.0
    verify_timeout_seconds: float = 5.0
    # beyond a call's own deadline, what a worker may take to kill, sweep and clean a slot
    # before the server gives up on it, kills it and starts another
    run_margin_s: float = 15.0
    # kill this process's non-worker children after a worker died: only where the service owns
    # its process (``kuberl sandbox serve``), never inside someone else's
    sweep_orphans: bool = False
    # "full": namespaces, slot uids and cgroups where this process may create them (root);
    # "basic": only what an unprivileged container allows (rlimits, setsid, seccomp, the
    # subreaper sweep) - what a SandboxPool pod running as non-root gets anyway.
    isolation: str = "full"
    # per-service block of slot uids (RLIMIT_NPROC and kill(-1) are per uid host-wide)
    uid_base: int = field(default_factory=lambda: _random_uid_base())
    # bearer token required on /v1/* (``kuberl.sandbox.service.auth``); None: no check (loopback use)
    token: str | None = field(default=None, repr=False)
    # one CPU per worker where this process may run on no more CPUs than there are workers
    # (a laptop's cores, a pod's exclusive cpuset; see worker_cpus)
    pin_workers: bool = True
    # The HTTP front's bounds: a connection that sends no complete request head within
    # idle_timeout_s (a new one, or one kept alive between requests) is closed, a request whose
    # body does not arrive within body_timeout_s gets 408 and its connection is closed, and
    # connections beyond max_connections are closed as they arrive (the open-file limit is raised
    # at start to what the cap needs).
    idle_timeout_s: float = 15.0
    body_timeout_s: float = 10.0
    max_connections: int = 4096

    @property
    def lim(self) -> SandboxLimits:
        from kuberl.api.sandbox_pool import SandboxLimits

        return self.limits or SandboxLimits()


def _random_uid_base() -> int:
    import secrets  # here, not at the top: the worker and its zygotes import this module

    return 100_000 + secrets.randbelow(1_000_000) * 256
