"""The operator's own Prometheus metrics: what its autoscaler decided, next to what is ready.

``kuberl_autoscaler_desired_replicas`` is the replica count the operator wants for each
SandboxPool/RolloutFleet (the autoscaler's decision, or ``spec.replicas`` when the object is
not autoscaled here) and ``kuberl_autoscaler_ready_replicas`` what its workload reports ready;
a gap that persists is a fleet that cannot schedule. Both live in the default registry (one
operator per process) and are served by ``serve`` on ``--metrics-port``.
"""

from __future__ import annotations

import logging

from prometheus_client import Gauge, start_http_server

log = logging.getLogger("kuberl.operator")

LABELS = ("namespace", "kind", "name")
DESIRED = Gauge(
    "kuberl_autoscaler_desired_replicas",
    "Replicas the operator wants (autoscaler decision, else spec.replicas)",
    LABELS,
)
READY = Gauge("kuberl_autoscaler_ready_replicas", "Replicas the workload reports ready", LABELS)

_SERVER_PORT: int | None = None


def record(
    namespace: str, kind: str, name: str, *, desired: int | None = None, ready: int | None = None
) -> None:
    if desired is not None:
        DESIRED.labels(namespace, kind, name).set(desired)
    if ready is not None:
        READY.labels(namespace, kind, name).set(ready)


def forget(namespace: str, kind: str, name: str) -> None:
    """Drop a deleted object's series (a stale gauge would look like a fleet that never drains)."""
    for gauge in (DESIRED, READY):
        try:
            gauge.remove(namespace, kind, name)
        except KeyError:
            pass


def serve(port: int, addr: str = "0.0.0.0") -> int:  # noqa: S104 - scraped from other pods
    """Serve /metrics once per process (0 picks a free port); returns the bound port."""
    global _SERVER_PORT
    if _SERVER_PORT is None:
        try:
            server, _ = start_http_server(port, addr=addr)
        except OSError as err:
            raise SystemExit(f"cannot serve operator metrics on {addr}:{port}: {err}") from err
        _SERVER_PORT = int(server.server_port)
        log.info("operator metrics on http://%s:%d/metrics", addr, _SERVER_PORT)
    return _SERVER_PORT


def serving_port() -> int | None:
    return _SERVER_PORT
