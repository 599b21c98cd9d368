"""End-to-end: the real kopf runtime against an in-memory Kubernetes API over HTTP (kmock).

Each test starts the kuberl operator (``kuberl.operator.main.operate`` = ``kopf.operator``
with kuberl's registry) against ``ClusterEmulator`` and drives it only through the API, the
way kubectl would: create, patch, scale via the scale subresource, delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import kmock
import kopf
import pytest

from kuberl.operator.handlers import OperatorConfig
from kuberl.operator.main import operate
from kuberl.operator.testing import ClusterEmulator

NS = "e2e"
API = "/apis/kuberl.io/v1alpha1/namespaces/e2e"
pytestmark = pytest.mark.timeout(60)


class Cluster:
    """kubectl-ish helpers over HTTP against the emulator."""

    def __init__(self, emulator: ClusterEmulator, url: str, session: aiohttp.ClientSession) -> None:
        self.emulator, self.url, self.session = emulator, url, session

    async def req(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        headers = {"Content-Type": ctype} if body is not None else {}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as rsp:
            data = await rsp.json()
            if rsp.status >= 400:
                return None if rsp.status == 404 else pytest.fail(f"{method} {path}: {rsp.status} {data}")
            return data

    async def get(self, path: str) -> Any:
        return await self.req("GET", path)

    async def create(self, path: str, obj: dict[str, Any]) -> Any:
        return await self.req("POST", path, obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> Any:
        return await self.req("PATCH", path, patch, "application/merge-patch+json")

    async def delete(self, path: str) -> Any:
        return await self.req("DELETE", path)

    async def events(self, name: str) -> list[dict[str, Any]]:
        items = (await self.get(f"/api/v1/namespaces/{NS}/events"))["items"]
        return [e for e in items if e["involvedObject"].get("name") == name]


async def eventually(probe: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "") -> Any:
    """Poll until ``probe`` returns something truthy (the reconcile loop is asynchronous)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what or probe}; last={last!r}")


@contextlib.asynccontextmanager
async def cluster_and_operator(**config: Any) -> AsyncIterator[Cluster]:
    async with (
        ClusterEmulator(namespaces={NS}) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        url = str(srv.url).rstrip("/")
        await session.post(
            url + "/api/v1/namespaces",
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        )
        cfg = OperatorConfig(
            reconcile_interval=config.pop("reconcile_interval", 0.5),
            autoscale_interval=config.pop("autoscale_interval", 0.5),
            login=lambda **_: kopf.ConnectionInfo(server=url, default_namespace=NS),
            admission=False,
            **config,
        )
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(operate(cfg, namespaces=[NS], stop_flag=stop, ready_flag=ready, fast=True))
        try:
            await asyncio.wait_for(ready.wait(), 15)
            yield Cluster(emu, url, session)
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 10)


def pool(name: str = "tools", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


async def test_pool_lifecycle_create_update_drift_scale_delete() -> None:
    async with cluster_and_operator() as k:
        dep_path = f"/apis/apps/v1/namespaces/{NS}/deployments/tools"
        await k.create(f"{API}/sandboxpools", pool(replicas=2, workersPerPod=4))

        # create -> children exist, owned by the pool -> status Ready
        dep = await eventually(lambda: k.get(dep_path), what="Deployment")
        owner = await k.get(f"{API}/sandboxpools/tools")
        assert dep["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        assert dep["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kuberl"
        assert await k.get(f"/api/v1/namespaces/{NS}/services/tools")
        assert await k.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/tools-deny-egress")

        async def ready() -> Any:
            st = ((await k.get(f"{API}/sandboxpools/tools")) or {}).get("status") or {}
            return st if st.get("phase") == "Ready" and st.get("readyReplicas") == 2 else None

        st = await eventually(ready, what="pool Ready")
        assert st["observedGeneration"] == owner["metadata"]["generation"]
        assert (
            st["selector"]
            == "app.kubernetes.io/component=sandbox,app.kubernetes.io/instance=tools,app.kubernetes.io/name=kuberl"
        )
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in st["conditions"])
        assert not (await k.get(f"{API}/sandboxpools/tools"))["metadata"].get("finalizers")  # none needed

        # spec change -> children updated
        await k.patch(f"{API}/sandboxpools/tools", {"spec": {"workersPerPod": 8}})

        async def workers_updated() -> bool:
            args = (await k.get(dep_path))["spec"]["template"]["spec"]["containers"][0]["args"]
            return args[args.index("--workers") + 1] == "8"

        await eventually(workers_updated, what="Deployment args updated")

        # child deleted -> recreated (drift repair)
        old_uid = (await k.get(dep_path))["metadata"]["uid"]
        await k.delete(dep_path)

        async def recreated() -> bool:
            d = await k.get(dep_path)
            return bool(d) and d["metadata"]["uid"] != old_uid

        await eventually(recreated, what="Deployment recreated")
        assert any(e["reason"] == "ChildRecreated" for e in await k.events("tools"))

        # scale subresource (kubectl scale sandboxpool/tools --replicas=5)
        scale = await k.patch(f"{API}/sandboxpools/tools/scale", {"spec": {"replicas": 5}})
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 5

        async def scaled() -> bool:
            s = await k.get(f"{API}/sandboxpools/tools/scale")
            return (await k.get(dep_path))["spec"]["replicas"] == 5 and s["status"]["replicas"] == 5

        await eventually(scaled, what="Deployment and status.replicas follow the scale")
        s = await k.get(f"{API}/sandboxpools/tools/scale")
        assert s["status"]["selector"].startswith("app.kubernetes.io/component=sandbox")

        # delete -> children cleaned up (ownerReferences + garbage collector)
        await k.delete(f"{API}/sandboxpools/tools")

        async def gone() -> bool:
            return (
                await k.get(dep_path) is None
                and await k.get(f"/api/v1/namespaces/{NS}/services/tools") is None
            )

        await eventually(gone, what="children removed")
        await asyncio.sleep(1.2)  # two timer periods: nothing comes back for a deleted owner
        assert await k.get(dep_path) is None
