"""``kuberl operator``: run the kopf operator (``kopf run`` underneath, with kuberl's registry).

Environment (all optional):

* ``KUBERL_RECONCILE_INTERVAL`` / ``KUBERL_AUTOSCALE_INTERVAL`` -- timer periods in seconds
  (defaults 30 and 15).
* ``KUBERL_WEBHOOK_PORT`` -- serve the validating/mutating admission webhooks on this port
  (TLS from ``KUBERL_WEBHOOK_CERT``/``KUBERL_WEBHOOK_KEY`` if set, else kopf's self-signed
  certificate) and let kopf manage the webhook configurations named ``kuberl.io``;
  ``KUBERL_WEBHOOK_HOST`` is the address the API server calls back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import kopf

from .handlers import OperatorConfig, build_registry, configure_settings


def _settings(
    verbose: bool, fast: bool = False, webhook: kopf.WebhookServer | None = None
) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    configure_settings(settings, fast=fast)
    port = os.environ.get("KUBERL_WEBHOOK_PORT")
    if webhook is not None:
        settings.admission.server = webhook
    elif port:
        settings.admission.server = kopf.WebhookServer(
            port=int(port),
            host=os.environ.get("KUBERL_WEBHOOK_HOST"),
            certfile=os.environ.get("KUBERL_WEBHOOK_CERT"),
            pkeyfile=os.environ.get("KUBERL_WEBHOOK_KEY"),
        )
        settings.admission.managed = "kuberl.io"
    return settings


async def operate(
    config: OperatorConfig | None = None,
    *,
    namespaces: list[str] | None = None,
    clusterwide: bool = False,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
    fast: bool = False,
    verbose: bool = False,
    webhook: kopf.WebhookServer | None = None,
) -> None:
    """Run the operator in the current event loop until ``stop_flag`` is set (tests use this).

    ``webhook`` serves the admission handlers (``config.admission`` must be true).
    """
    watched = None if clusterwide else (namespaces or ["default"])
    registry, _ctx = build_registry(config, namespaces=watched)
    kwargs: dict[str, Any] = {"clusterwide": True} if watched is None else {"namespaces": watched}
    await kopf.operator(
        registry=registry,
        settings=_settings(verbose, fast=fast, webhook=webhook),
        standalone=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        **kwargs,
    )


def run_operator(namespaces: list[str], all_namespaces: bool, verbose: bool) -> int:
    """Entry point of ``kuberl operator``: blocks until interrupted; returns the exit code."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not all_namespaces and not namespaces:
        namespaces = [os.environ.get("KUBERL_NAMESPACE", "default")]
    config = OperatorConfig(
        reconcile_interval=float(os.environ.get("KUBERL_RECONCILE_INTERVAL", "30")),
        autoscale_interval=float(os.environ.get("KUBERL_AUTOSCALE_INTERVAL", "15")),
        admission=bool(os.environ.get("KUBERL_WEBHOOK_PORT")),
    )
    registry, _ctx = build_registry(config, namespaces=None if all_namespaces else namespaces)
    kwargs: dict[str, Any] = {"clusterwide": True} if all_namespaces else {"namespaces": namespaces}
    kopf.run(registry=registry, settings=_settings(verbose), standalone=True, **kwargs)
    return 0
