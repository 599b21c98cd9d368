"""The operator's configuration and its memory of the objects it reconciles.

:class:`OperatorConfig` is what the CLI and tests choose (intervals, login, scraper, admission,
metrics); :class:`OperatorContext` is one running operator's state: the API client, a lock per
object, the last phase reported, and what it keeps per object until the object is deleted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kuberl.api import AgenticRLJob, Resource, RolloutFleet, SandboxPool
from kuberl.operator.runtime import metrics
from kuberl.operator.runtime.kube import KubeClient, operator_cache
from kuberl.operator.runtime.pods import http_scrape

Scraper = Callable[[str], Awaitable[str]]
KINDS: dict[str, type[Resource]] = {
    "SandboxPool": SandboxPool,
    "RolloutFleet": RolloutFleet,
    "AgenticRLJob": AgenticRLJob,
}
PLURALS = {cls.KIND: cls.PLURAL for cls in KINDS.values()}
SCALED = ("SandboxPool", "RolloutFleet")
TERMINAL = ("Succeeded", "Failed")


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@dataclass
class OperatorConfig:
    reconcile_interval: float = 30.0
    autoscale_interval: float = 15.0
    scrape_timeout: float = 2.0
    login: Callable[..., kopf.ConnectionInfo | None] = default_login
    scraper: Scraper | None = None
    clock: Callable[[], float] = time.time
    # Register the validating/mutating webhooks; kopf then requires settings.admission.server.
    admission: bool = False
    # Serve the operator's /metrics on this port (0: any free port; None: not at all).
    metrics_port: int | None = None
    # Watch Kueue's Workloads (the chart's kueue.enabled): an admission or an eviction reaches
    # the owning job at once rather than at the next resync.
    kueue: bool = False


@dataclass
class OperatorContext:
    config: OperatorConfig
    namespaces: list[str] | None = None
    connection: kopf.ConnectionInfo | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    phases: dict[str, str] = field(default_factory=dict)  # uid -> last phase reported (events)
    known: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # uid -> (ns, kind, name)
    refusals: dict[str, set[str]] = field(default_factory=dict)  # uid -> child refusals reported
    restarts: dict[str, int] = field(default_factory=dict)  # uid -> trainer restarts (until status has it)
    finished: dict[str, int | None] = field(default_factory=dict)  # uid -> generation found terminal
    heartbeats: dict[str, float] = field(default_factory=dict)  # loop -> monotonic end of its last pass
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)
    _client: KubeClient | None = field(default=None, repr=False)

    def lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def remember(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        if meta.get("uid"):
            self.known[meta["uid"]] = (meta.get("namespace", ""), body.get("kind", ""), meta.get("name", ""))

    def forget(self, uid: str) -> None:
        """Drop everything kept about a deleted object (phase, lock, metric series)."""
        self.phases.pop(uid, None)
        self.refusals.pop(uid, None)
        self.restarts.pop(uid, None)
        self.finished.pop(uid, None)
        lock = self._locks.get(uid)
        if lock is not None and not lock.locked():
            del self._locks[uid]
        where = self.known.pop(uid, None)
        if where is not None:
            metrics.forget(*where)

    def client(self) -> KubeClient:
        if self._client is None:
            if self.connection is None:
                raise RuntimeError("not logged in to the Kubernetes API yet")
            self._client = KubeClient(self.connection, cache=operator_cache())
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def scrape(self, url: str) -> str:
        if self.config.scraper is not None:
            return await self.config.scraper(url)
        return await http_scrape(url, self.config.scrape_timeout)
