"""Leader election on a coordination.k8s.io/v1 Lease, so the chart can run standby replicas.

Only the leader runs kopf (handlers, resync and autoscale loops, admission webhooks); a
standby waits for the Lease, then starts. Rules, as client-go's leaderelection:

* the Lease names its holder and when it last renewed (``renewTime``) for how long
  (``leaseDurationSeconds``); a holder renews every ``renew`` seconds;
* a candidate takes the Lease when it is free (no holder) or expired (no renewal for the
  duration), bumping ``leaseTransitions``; writes carry the read ``resourceVersion`` (a JSON
  patch ``test`` op, answered 409/422 when someone wrote in between), so two candidates cannot
  both win;
* a leader that cannot renew before its own lease would expire stops (the process exits and
  restarts as a standby): two leaders never run at once for longer than clock skew;
* a leader that stops cleanly releases the Lease (holder removed), so a standby takes over at
  once instead of after the duration.

``decide`` is the pure rule; ``LeaderElector`` the I/O around it (``KubeClient``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kuberl.operator.runtime.kube import ApiError, KubeClient, kind_of

log = logging.getLogger("kuberl.operator.runtime.leader")
LEASE = kind_of("coordination.k8s.io/v1", "Lease")
Action = Literal["create", "take", "renew", "wait"]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def micro_time(when: datetime.datetime) -> str:
    """metav1.MicroTime as the API server writes it."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def decide(lease: dict[str, Any] | None, identity: str, now: datetime.datetime) -> Action:
    """What ``identity`` should do with the Lease as read (None: it does not exist)."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return "renew"
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = float(spec.get("leaseDurationSeconds") or 0)
    if not holder or renewed is None or now >= renewed + datetime.timedelta(seconds=duration):
        return "take"
    return "wait"


@dataclass
class ElectionConfig:
    namespace: str
    name: str
    identity: str
    duration: float = 15.0  # seconds a lease is valid without renewal
    renew: float = 5.0  # how often the leader renews
    retry: float = 2.0  # how often a standby looks again


class LeaderElector:
    def __init__(
        self, client: KubeClient, config: ElectionConfig, clock: Callable[[], datetime.datetime] = _now
    ) -> None:
        self.client, self.config, self.clock = client, config, clock
        self.leading = False
        self.lost = asyncio.Event()

    def _spec(self, now: datetime.datetime, acquired: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, round(self.config.duration)),
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = micro_time(now)
        return spec

    async def try_once(self) -> bool:
        """One round: read the Lease and create/take/renew it if the rules allow. True: leading."""
        cfg = self.config
        lease = await self.client.get(LEASE, cfg.namespace, cfg.name, fresh=True)
        now = self.clock()
        action = decide(lease, cfg.identity, now)
        try:
            if action == "create":
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                    "spec": self._spec(now, True, 0),
                }
                await self.client.create(body)
            elif action in ("take", "renew"):
                assert lease is not None
                transitions = int((lease.get("spec") or {}).get("leaseTransitions") or 0)
                spec = self._spec(now, action == "take", transitions + (action == "take"))
                await self.client.json_patch(
                    LEASE,
                    cfg.namespace,
                    cfg.name,
                    [
                        {
                            "op": "test",
                            "path": "/metadata/resourceVersion",
                            "value": lease["metadata"]["resourceVersion"],
                        },
                        {
                            "op": "replace" if "spec" in lease else "add",
                            "path": "/spec",
                            "value": {**(lease.get("spec") or {}), **spec},
                        },
                    ],
                )
            else:
                return False
        except ApiError as err:
            if err.status in (409, 422):  # someone else wrote first
                return False
            raise
        if action != "renew":
            log.info("%s leads via Lease %s/%s (%s)", cfg.identity, cfg.namespace, cfg.name, action)
        return True

    async def acquire(self) -> None:
        """Wait until this candidate leads."""
        while True:
            try:
                if await self.try_once():
                    self.leading = True
                    return
            except (ApiError, OSError, TimeoutError) as err:
                log.warning("leader election: %s", err)
            await asyncio.sleep(self.config.retry)

    async def hold(self) -> None:
        """Renew until the lease cannot be kept; then set ``lost`` and return."""
        last_ok = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.config.renew)
            try:
                if await self.try_once():
                    last_ok = asyncio.get_running_loop().time()
                    continue
                reason = "another candidate holds the Lease"
            except (ApiError, OSError, TimeoutError) as err:
                reason = str(err)
                if asyncio.get_running_loop().time() - last_ok < self.config.duration - self.config.renew:
                    log.warning("leader election: renewal failed (%s); retrying", err)
                    continue
            log.error("leader election: lost the Lease (%s); stopping", reason)
            self.leading = False
            self.lost.set()
            return

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so a standby need not wait for it to expire."""
        if not self.leading:
            return
        cfg = self.config
        self.leading = False
        lease = await self.client.get(LEASE, cfg.namespace, cfg.name, fresh=True)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
            return
        try:
            await self.client.json_patch(
                LEASE,
                cfg.namespace,
                cfg.name,
                [
                    {
                        "op": "test",
                        "path": "/metadata/resourceVersion",
                        "value": lease["metadata"]["resourceVersion"],
                    },
                    {"op": "remove", "path": "/spec/holderIdentity"},
                ],
            )
        except ApiError as err:
            log.warning("leader election: could not release the Lease: %s", err)
