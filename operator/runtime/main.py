"""``kuberl operator``: run the kopf operator (``kopf run`` underneath, with kuberl's registry).

Environment (all optional):

* ``KUBERL_RECONCILE_INTERVAL`` / ``KUBERL_AUTOSCALE_INTERVAL`` -- loop periods in seconds
  (defaults 30 and 15; the two loops are independent).
* ``KUBERL_OPERATOR_METRICS_PORT`` -- where the operator serves its own /metrics (default
  8080; ``--metrics-port`` wins; 0 picks a free port).
* ``KUBERL_HEALTH_PORT`` -- kopf's liveness endpoint ``http://0.0.0.0:PORT/healthz`` (default
  8081; empty or 0: none): the pod's readiness probe (charts/kuberl). Only the leader serves it.
* ``KUBERL_LIVENESS_PORT`` -- ``/livez`` (default 8082; 0: none), the liveness probe, in every
  replica (``liveness.py``): 200 for a standby, kopf's answer for the leader.
* ``KUBERL_LEASE_NAME`` + ``KUBERL_LEASE_NAMESPACE`` (+ ``KUBERL_POD_NAME``, the identity) --
  leader election on that Lease (``leader.py``): only the holder runs kopf; the others wait.
  Unset: no election (run exactly one replica).
* ``KUBERL_KUEUE=1`` -- watch Kueue's Workloads (the chart sets it with ``kueue.enabled``): an
  admission, eviction or preemption reconciles the owning AgenticRLJob at once, not at the next
  resync.
* ``KUBERL_WEBHOOK_PORT`` -- serve the validating/mutating admission webhooks on this port. The
  webhook configurations are the chart's objects (so they go with ``helm uninstall``), never
  written by the operator. TLS from
  ``KUBERL_WEBHOOK_CERT``/``KUBERL_WEBHOOK_KEY`` (+ ``KUBERL_WEBHOOK_CA``, the bundle the API
  server verifies with; the chart mounts a Secret), else kopf's self-signed certificate
  (needs the ``certbuilder`` package). How the API server reaches the webhooks:

  - in a cluster, ``KUBERL_WEBHOOK_SERVICE`` + ``KUBERL_WEBHOOK_NAMESPACE`` (+
    ``KUBERL_WEBHOOK_SERVICE_PORT``, default 443): the chart's configurations name that
    Service (``clientConfig.service``), which the API server resolves without cluster DNS;
  - elsewhere ``KUBERL_WEBHOOK_HOST``: the host kopf's server certificate is made for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf

from kuberl.operator.runtime import metrics
from kuberl.operator.runtime.context import OperatorConfig
from kuberl.operator.runtime.kube import KubeClient
from kuberl.operator.runtime.leader import ElectionConfig, LeaderElector
from kuberl.operator.runtime.liveness import serve_livez
from kuberl.operator.runtime.registry import build_registry, configure_settings

DEFAULT_METRICS_PORT = 8080
DEFAULT_HEALTH_PORT = 8081
DEFAULT_LIVENESS_PORT = 8082


def service_client_config(
    config: Mapping[str, Any], *, service: str, namespace: str, port: int
) -> dict[str, Any]:
    """kopf's URL-based client config turned into a Service reference (caBundle kept).

    kopf appends each handler's id to ``service.path`` itself, so the root path is empty.
    (kopf only uses it for configurations it manages, which kuberl does not ask for; it lets
    ``kopf.build_webhooks`` output be compared with the chart's.)
    """
    out: dict[str, Any] = {"service": {"name": service, "namespace": namespace, "port": port, "path": ""}}
    if config.get("caBundle"):
        out["caBundle"] = config["caBundle"]
    return out


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, announced to the API server through a Service.

    kopf's own server announces ``https://host:port``; an API server usually cannot resolve
    ``*.svc`` names (it does not use cluster DNS), while ``clientConfig.service`` it can.
    """

    def __init__(self, *, service: str, namespace: str, service_port: int = 443, **kwargs: Any) -> None:
        fqdn = f"{service}.{namespace}.svc"
        kwargs.setdefault("host", fqdn)
        kwargs.setdefault("extra_sans", [service, f"{service}.{namespace}", f"{fqdn}.cluster.local"])
        super().__init__(**kwargs)
        self.service, self.namespace, self.service_port = service, namespace, service_port

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        async for config in super().__call__(fn):
            yield service_client_config(
                config, service=self.service, namespace=self.namespace, port=self.service_port
            )


def _int_env(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a port number, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise SystemExit(f"{name} must be a port number (0-65535), got {value}")
    return value


def webhook_server_from_env(env: Mapping[str, str]) -> kopf.WebhookServer | None:
    """The admission webhook server the environment asks for (None: admission is off)."""
    port = _int_env(env, "KUBERL_WEBHOOK_PORT")
    if port is None:
        return None
    tls: dict[str, Any] = {
        "certfile": env.get("KUBERL_WEBHOOK_CERT") or None,
        "pkeyfile": env.get("KUBERL_WEBHOOK_KEY") or None,
        "cafile": env.get("KUBERL_WEBHOOK_CA") or None,
    }
    if bool(tls["certfile"]) != bool(tls["pkeyfile"]):
        raise SystemExit("KUBERL_WEBHOOK_CERT and KUBERL_WEBHOOK_KEY must be set together")
    service = env.get("KUBERL_WEBHOOK_SERVICE")
    if service:
        namespace = env.get("KUBERL_WEBHOOK_NAMESPACE")
        if not namespace:
            raise SystemExit(
                "KUBERL_WEBHOOK_SERVICE needs KUBERL_WEBHOOK_NAMESPACE (the Service's namespace)"
            )
        return ServiceWebhookServer(
            service=service,
            namespace=namespace,
            service_port=_int_env(env, "KUBERL_WEBHOOK_SERVICE_PORT", 443) or 443,
            port=port,
            **tls,
        )
    return kopf.WebhookServer(port=port, host=env.get("KUBERL_WEBHOOK_HOST"), **tls)


def _settings(
    verbose: bool, fast: bool = False, webhook: kopf.WebhookServer | None = None
) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    configure_settings(settings, fast=fast)
    if webhook is not None:
        # Serve only: settings.admission.managed stays None, so kopf writes no webhook
        # configuration (charts/kuberl/templates/webhook.yaml owns them).
        settings.admission.server = webhook
    return settings


def liveness_endpoint(port: int | None, host: str = "0.0.0.0") -> str | None:  # noqa: S104 - a pod's probe port
    """kopf's liveness endpoint URL for ``port`` (None or 0: none)."""
    return f"http://{host}:{port}/healthz" if port else None


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
    health_port: int | None = None,
    public_health: bool = False,
) -> None:
    """Run the operator in the current event loop until ``stop_flag`` is set (tests use this).

    ``webhook`` serves the admission handlers (``config.admission`` must be true);
    ``health_port`` serves kopf's liveness endpoint (``/healthz``) on localhost.
    """
    watched = None if clusterwide else (namespaces or ["default"])
    registry, ctx = build_registry(config, namespaces=watched)
    if ctx.config.metrics_port is not None:
        metrics.serve(ctx.config.metrics_port)
    kwargs: dict[str, Any] = {"clusterwide": True} if watched is None else {"namespaces": watched}
    await kopf.operator(
        registry=registry,
        settings=_settings(verbose, fast=fast, webhook=webhook),
        standalone=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        liveness_endpoint=liveness_endpoint(health_port, "0.0.0.0" if public_health else "127.0.0.1"),  # noqa: S104
        # kopf's own default is user@host, and its user lookup (getpass) raises KeyError in a
        # container whose uid has no passwd entry (the chart's 65532): name it here instead
        identity=kopf_identity(os.environ),
        **kwargs,
    )


def kopf_identity(env: Mapping[str, str]) -> str:
    """This operator's name among kopf's peers: the pod's name where the chart sets it, else the
    host's (never a passwd lookup: the operator's uid need not have an entry)."""
    return env.get("KUBERL_POD_NAME") or socket.gethostname()


def election_from_env(env: Mapping[str, str]) -> ElectionConfig | None:
    """The leader election the environment asks for (None: none, run a single replica)."""
    name, namespace = env.get("KUBERL_LEASE_NAME"), env.get("KUBERL_LEASE_NAMESPACE")
    if not name and not namespace:
        return None
    if not (name and namespace):
        raise SystemExit("KUBERL_LEASE_NAME and KUBERL_LEASE_NAMESPACE must be set together")
    identity = env.get("KUBERL_POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    return ElectionConfig(namespace=namespace, name=name, identity=identity)


async def _first(*flags: asyncio.Event | threading.Event) -> None:
    while True:
        for flag in flags:
            if flag.is_set():
                return
        await asyncio.sleep(0.1)


async def operate_elected(
    config: OperatorConfig,
    election: ElectionConfig,
    *,
    stop_flag: asyncio.Event | threading.Event,
    ready_flag: asyncio.Event | threading.Event | None = None,
    live_port: int | None = None,
    **operate_kwargs: Any,
) -> int:
    """``operate`` once this candidate holds the Lease; 1 when it lost it (the pod restarts as
    a standby), 0 on a clean stop (the Lease is released for the next one)."""
    # kopf's login handlers take its settings and a logger (kopf passes them; so must we)
    info = config.login(settings=kopf.OperatorSettings(), logger=logging.getLogger("kuberl.operator.runtime.leader"))
    if info is None:
        raise SystemExit("leader election needs Kubernetes credentials (service account or kubeconfig)")
    client = KubeClient(info)
    elector = LeaderElector(client, election)
    health_port = operate_kwargs.get("health_port")
    kopf_url = liveness_endpoint(health_port, "127.0.0.1")
    runner = await serve_livez(live_port, kopf_url, elector) if live_port else None
    tasks: list[asyncio.Task[Any]] = []
    try:
        acquire = asyncio.create_task(elector.acquire())
        stopped = asyncio.create_task(_first(stop_flag))
        await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():  # told to stop while waiting as a standby
            acquire.cancel()
            return 0
        stopped.cancel()
        acquire.result()  # an unexpected error while campaigning: raise it, never lead on it
        inner_stop = asyncio.Event()

        async def relay() -> None:
            await _first(stop_flag, elector.lost)
            inner_stop.set()

        tasks = [asyncio.create_task(elector.hold()), asyncio.create_task(relay())]
        await operate(config, stop_flag=inner_stop, ready_flag=ready_flag, **operate_kwargs)
        return 1 if elector.lost.is_set() else 0
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await elector.release()
        await client.close()
        if runner is not None:
            await runner.cleanup()


def run_operator(
    namespaces: list[str], all_namespaces: bool, verbose: bool, metrics_port: int | None = None
) -> int:
    """Entry point of ``kuberl operator``: blocks until interrupted; returns the exit code."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not all_namespaces and not namespaces:
        namespaces = [os.environ.get("KUBERL_NAMESPACE", "default")]
    webhook = webhook_server_from_env(os.environ)
    if metrics_port is None:
        metrics_port = _int_env(os.environ, "KUBERL_OPERATOR_METRICS_PORT", DEFAULT_METRICS_PORT)
    config = OperatorConfig(
        reconcile_interval=float(os.environ.get("KUBERL_RECONCILE_INTERVAL", "30")),
        autoscale_interval=float(os.environ.get("KUBERL_AUTOSCALE_INTERVAL", "15")),
        admission=webhook is not None,
        metrics_port=metrics_port,
        kueue=os.environ.get("KUBERL_KUEUE") == "1",
    )
    health = _int_env(os.environ, "KUBERL_HEALTH_PORT", DEFAULT_HEALTH_PORT)
    live = _int_env(os.environ, "KUBERL_LIVENESS_PORT", DEFAULT_LIVENESS_PORT)
    election = election_from_env(os.environ)
    if election is not None:
        return _run_elected(config, election, namespaces, all_namespaces, verbose, webhook, health, live)
    registry, _ctx = build_registry(config, namespaces=None if all_namespaces else namespaces)
    metrics.serve(config.metrics_port if config.metrics_port is not None else DEFAULT_METRICS_PORT)
    kwargs: dict[str, Any] = {"clusterwide": True} if all_namespaces else {"namespaces": namespaces}
    kopf.run(
        registry=registry,
        settings=_settings(verbose, webhook=webhook),
        standalone=True,
        liveness_endpoint=liveness_endpoint(health),
        **kwargs,
    )
    return 0


def _run_elected(
    config: OperatorConfig,
    election: ElectionConfig,
    namespaces: list[str],
    all_namespaces: bool,
    verbose: bool,
    webhook: kopf.WebhookServer | None,
    health: int | None,
    live: int | None,
) -> int:
    """``kuberl operator`` with leader election: a standby until it holds the Lease."""

    # standbys serve /metrics too (the operator's PodMonitor scrapes every replica)
    metrics.serve(config.metrics_port if config.metrics_port is not None else DEFAULT_METRICS_PORT)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # kopf installs its own once it runs
            loop.add_signal_handler(sig, stop.set)
        return await operate_elected(
            config,
            election,
            stop_flag=stop,
            live_port=live,
            namespaces=None if all_namespaces else namespaces,
            clusterwide=all_namespaces,
            verbose=verbose,
            webhook=webhook,
            health_port=health,
            public_health=True,
        )

    return asyncio.run(main())
