"""Who may talk to a pool's sandboxes and a fleet's engines (pure builders).

Both serve dangerous endpoints: a sandbox runs any Python it is sent (``/v1/execute``), an
engine reloads weights from any path it is told and vLLM's dev-mode routes run RPCs. So:

* **NetworkPolicies.** Ingress on the serving port only from the trainer pods that use them
  (a job's inline pool or fleet: that job's trainer pods; a standalone one: the kuberl trainer
  pods of its namespace, since any job there may reference it) and from the monitoring
  namespace (Prometheus scrapes ``/metrics`` on the same port). Engine pods also admit each
  other (a LeaderWorkerSet group's NCCL and ``--dist-init-addr`` traffic uses any port). The
  sandbox policy also denies all egress; engines keep theirs (model downloads).
* **A per-pool token.** The NetworkPolicy is enforced only by CNIs that implement it and still
  admits the monitoring namespace, so ``/v1/*`` also needs the pool's bearer token
  (``kuberl.sandbox.service.auth``). The operator generates it once into the Secret
  ``<pool>-token`` (``fill_token``, at apply time: a pure builder cannot make a secret) and
  keeps it; pool pods and the trainer pods of jobs using the pool get it from there (as env,
  read at pod start: to rotate, delete the Secret, then restart the pool's and the trainers'
  pods; a Secret volume re-read per request would rotate without restarts, not done yet).

The monitoring namespace is ``monitoring`` (kube-prometheus-stack's usual one), or the value
of the annotation ``kuberl.io/monitoring-namespace`` on the pool/fleet/job.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from kuberl.sandbox.service.auth import TOKEN_ENV

MONITORING_NAMESPACE = "monitoring"
ANNOTATION_MONITORING_NAMESPACE = "kuberl.io/monitoring-namespace"
TOKEN_KEY = "token"
TOKEN_BYTES = 32


def token_secret_name(pool: str) -> str:
    return f"{pool}-token"


def token_env(pool: str) -> dict[str, Any]:
    """The container env entry that carries ``pool``'s token (sandbox server and its clients)."""
    return {
        "name": TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": token_secret_name(pool), "key": TOKEN_KEY}},
    }


def token_secret(pool: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """The pool's token Secret as built (no data: ``fill_token`` adds it when applying)."""
    meta = {"name": token_secret_name(pool), "namespace": namespace, "labels": dict(labels)}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def fill_token(desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """``desired`` (a token Secret) with the live token kept, or a fresh one when there is none."""
    current = ((live or {}).get("data") or {}).get(TOKEN_KEY)
    if not current:
        current = base64.b64encode(new_token().encode()).decode()
    return {**desired, "data": {TOKEN_KEY: current}}


def monitoring_namespace(annotations: dict[str, str]) -> str:
    return annotations.get(ANNOTATION_MONITORING_NAMESPACE) or MONITORING_NAMESPACE


def _from_monitoring(namespace: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}


def _api_ingress(port: int, trainers: dict[str, str], annotations: dict[str, str]) -> list[dict[str, Any]]:
    """Ingress on ``port`` (TCP) from the trainers selected by ``trainers`` and from the
    monitoring namespace: what a pool's and a fleet's policies both admit."""
    ports = [{"port": port, "protocol": "TCP"}]
    return [
        {"from": [{"podSelector": {"matchLabels": trainers}}], "ports": ports},
        {"from": [_from_monitoring(monitoring_namespace(annotations))], "ports": ports},
    ]


def sandbox_policy(
    meta: dict[str, Any],
    pods: dict[str, str],
    port: int,
    *,
    trainers: dict[str, str],
    annotations: dict[str, str],
) -> dict[str, Any]:
    """No egress at all (DNS included: model code is offline); ingress on ``port`` only from
    the trainers that use the pool and from the monitoring namespace."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": _api_ingress(port, trainers, annotations),
            "egress": [],
        },
    }


def fleet_policy(
    meta: dict[str, Any],
    pods: dict[str, str],
    port: int,
    *,
    trainers: dict[str, str],
    annotations: dict[str, str],
) -> dict[str, Any]:
    """Engines: the HTTP port (generation, weight updates, metrics) for the job's trainers and
    the monitoring namespace; anything between the fleet's own pods (multi-node engines)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": [*_api_ingress(port, trainers, annotations), {"from": [{"podSelector": {"matchLabels": pods}}]}],
        },
    }
