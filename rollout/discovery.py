"""Finding the inference engines of a RolloutFleet.

Engines come either from an explicit list of URLs (``--engines http://a:30000,http://b:30000``,
local runs, tests) or from the EndpointSlices of the fleet's headless Service (the operator
names the Service after the fleet and its port ``http``). Each ready endpoint address is one
SGLang engine; the scheduler balances over them itself, so no load-balancing Service is needed.

The conversion from EndpointSlice objects to URLs is a pure function
(:func:`urls_from_endpoint_slices`); :func:`discover_fleet_urls` is the thin Kubernetes shell.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from kuberl.rollout.engines import make_engine as new_engine
from kuberl.rollout.http_engine import HTTPEngine
from kuberl.rollout.scheduler import Scheduler

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def parse_url_list(urls: str | Sequence[str]) -> list[str]:
    """Normalize a comma-separated string or a list of engine URLs (order kept, duplicates dropped)."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for raw in items:
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {raw!r} must start with http:// or https://")
        if url not in out:
            out.append(url)
    if not out:
        raise ValueError("no engine URLs given")
    return out


def _get(obj: Mapping[str, Any] | None, *keys: str) -> Any:
    """First present key: EndpointSlices arrive camelCase (raw API) or snake_case (client to_dict)."""
    if not obj:
        return None
    for k in keys:
        if k in obj and obj[k] is not None:
            return obj[k]
    return None


def urls_from_endpoint_slices(
    slices: Iterable[Mapping[str, Any]], port_name: str = "http", scheme: str = "http"
) -> list[str]:
    """Engine URLs of the ready endpoints in ``slices`` (sorted, unique).

    An endpoint counts when ``conditions.ready`` is true or unset (the API says consumers should
    treat an unknown state as ready) and it is not terminating. Slices without a port named
    ``port_name`` are skipped; IPv6 addresses are bracketed.
    """
    urls: set[str] = set()
    for s in slices:
        port = next((_get(p, "port") for p in (_get(s, "ports") or []) if _get(p, "name") == port_name), None)
        if port is None:
            continue
        ipv6 = _get(s, "addressType", "address_type") == "IPv6"
        for ep in _get(s, "endpoints") or []:
            cond = _get(ep, "conditions") or {}
            if _get(cond, "ready") is False or _get(cond, "terminating") is True:
                continue
            for addr in _get(ep, "addresses") or []:
                host = f"[{addr}]" if ipv6 or (":" in addr and not addr.startswith("[")) else addr
                urls.add(f"{scheme}://{host}:{int(port)}")
    return sorted(urls)


def discover_fleet_urls(fleet: str, namespace: str, *, port_name: str = "http", api: Any = None) -> list[str]:
    """URLs of the ready engines behind the RolloutFleet ``fleet``'s headless Service.

    Uses in-cluster config when running in a pod, else the local kubeconfig. ``api`` may be a
    ``kubernetes.client.DiscoveryV1Api`` (or a stand-in with the same method) for tests.
    """
    if api is None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.DiscoveryV1Api()
    resp = api.list_namespaced_endpoint_slice(namespace, label_selector=f"{SERVICE_NAME_LABEL}={fleet}")
    items = resp.get("items", []) if isinstance(resp, Mapping) else resp.items
    slices = [i if isinstance(i, Mapping) else i.to_dict() for i in items]
    return urls_from_endpoint_slices(slices, port_name=port_name)


def engines_from_urls(urls: str | Sequence[str], kind: str = "sglang", **kwargs: Any) -> list[HTTPEngine]:
    """One engine of type ``kind`` per URL; ``kwargs`` go to every engine (timeouts, retries)."""
    return [new_engine(kind, u, **kwargs) for u in parse_url_list(urls)]


async def sync_engines(
    scheduler: Scheduler,
    urls: str | Sequence[str],
    *,
    prepare: Callable[[str], Awaitable[HTTPEngine | None]] | None = None,
    kind: str = "sglang",
    **engine_kwargs: Any,
) -> tuple[list[str], list[str]]:
    """Make the scheduler's HTTP engines match ``urls`` (e.g. a fresh EndpointSlice listing).

    New URLs become engines at once (waiting rollouts may start on them); engines whose URL
    disappeared are drained (their running rollouts finish) and closed once idle; a draining
    engine whose URL comes back is put back into service, unless it was drained for a fault:
    that one rejoins as a new engine once it is gone. ``prepare(url)`` may prepare a new
    engine (health, current weights) or return None to try again on the next sync.
    Returns (added, drained) URLs.
    """
    wanted = parse_url_list(urls) if (urls if isinstance(urls, str) else list(urls)) else []
    current = {st.engine.base_url: st for st in scheduler.stats if isinstance(st.engine, HTTPEngine)}
    added = []
    for u in (u for u in wanted if u not in current):
        engine = await prepare(u) if prepare is not None else new_engine(kind, u, **engine_kwargs)
        if engine is not None:
            await scheduler.add_engine(engine)
            added.append(u)
    for u in wanted:
        if u in current and current[u].draining and not current[u].failed:
            scheduler.undrain_engine(current[u].name)
    drained = [u for u, st in current.items() if u not in wanted and not st.draining]
    for u in drained:
        scheduler.drain_engine(current[u].name)
    for engine in scheduler.remove_drained():
        await engine.close()
    return added, drained
