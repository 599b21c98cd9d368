"""End-to-end: the real kopf runtime against an in-memory Kubernetes API over HTTP (kmock).

Each test starts the kuberl operator (``kuberl.operator.runtime.main.operate`` = ``kopf.operator``
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
from kube_emulator import ClusterEmulator, write_kubeconfig

from kuberl.api.crdgen import all_crds
from kuberl.operator.runtime.context import OperatorConfig
from kuberl.operator.runtime.main import operate
from kuberl.util.ports import free_port
from tests.apiserver_emulation import strict_admission

STRICT = strict_admission(list(all_crds().values()))
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
async def emulated_cluster(**emulator: Any) -> AsyncIterator[Cluster]:
    """The API emulator serving over HTTP, with the test namespace; by default as strict as an API
    server about schemas (``admit=None`` lets through what the CRDs would refuse)."""
    emulator.setdefault("admit", STRICT)
    async with (
        ClusterEmulator(namespaces={NS}, **emulator) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        url = str(srv.url).rstrip("/")
        await session.post(
            url + "/api/v1/namespaces",
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        )
        yield Cluster(emu, url, session)


@contextlib.asynccontextmanager
async def running_operator(k: Cluster, **config: Any) -> AsyncIterator[Cluster]:
    """The kuberl operator (real kopf runtime) against ``k`` until the block ends."""
    webhook = config.pop("webhook", None)
    cfg = OperatorConfig(
        reconcile_interval=config.pop("reconcile_interval", 0.5),
        autoscale_interval=config.pop("autoscale_interval", 0.5),
        login=lambda **_: kopf.ConnectionInfo(server=k.url, default_namespace=NS),
        admission=webhook is not None,
        **config,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        operate(cfg, namespaces=[NS], stop_flag=stop, ready_flag=ready, fast=True, webhook=webhook)
    )
    try:
        await asyncio.wait_for(ready.wait(), 15)
        yield k
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def cluster_and_operator(**config: Any) -> AsyncIterator[Cluster]:
    async with emulated_cluster() as k, running_operator(k, **config):
        yield k


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
        # the children are applied one after another: the Deployment can exist before the others
        await eventually(lambda: k.get(f"/api/v1/namespaces/{NS}/services/tools"), what="Service")
        np_path = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/tools-deny-egress"
        await eventually(lambda: k.get(np_path), what="NetworkPolicy")

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

        # A new object is no drift: nothing was "missing" before the operator created it.
        assert not [e for e in await k.events("tools") if e["reason"] == "ChildRecreated"]

        # child deleted -> recreated (drift repair), and reported by an event posted after that
        old_uid = (await k.get(dep_path))["metadata"]["uid"]
        before = {e["metadata"]["name"] for e in await k.events("tools")}
        await k.delete(dep_path)

        async def recreated() -> bool:
            d = await k.get(dep_path)
            return bool(d) and d["metadata"]["uid"] != old_uid

        await eventually(recreated, what="Deployment recreated")

        async def reported() -> list[dict[str, Any]]:
            return [
                e
                for e in await k.events("tools")
                if e["metadata"]["name"] not in before and e["reason"] == "ChildRecreated"
            ]

        (event,) = await eventually(reported, what="ChildRecreated event after the deletion")
        assert event["message"] == "Deployment/tools was missing and has been recreated"

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


def job(name: str = "train", **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"base": "Qwen/Qwen2.5-1.5B-Instruct"},
        "data": {"train": "s3://d/train.jsonl"},
        "stages": [{"name": "rl", "type": "rl", "steps": 10}],
        "trainer": {"replicas": 2, "accelerator": {"profile": "h100", "count": 8}},
    }
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {**base, **spec},
    }


async def _status(k: Cluster, path: str) -> dict[str, Any]:
    return ((await k.get(path)) or {}).get("status") or {}


async def test_job_inline_children_suspend_resume_and_completion() -> None:
    async with cluster_and_operator() as k:
        spec = {
            "rollout": {"fleet": {"replicas": 2, "accelerator": {"profile": "h100", "count": 1}}},
            "sandbox": {"pool": {"replicas": 1, "workersPerPod": 4}},
        }
        await k.create(f"{API}/agenticrljobs", job(**spec))
        job_path = f"/apis/batch/v1/namespaces/{NS}/jobs/train-trainer"
        trainer = await eventually(lambda: k.get(job_path), what="trainer Job")
        assert trainer["spec"]["completionMode"] == "Indexed" and trainer["spec"]["parallelism"] == 2
        cm = await k.get(f"/api/v1/namespaces/{NS}/configmaps/train-config")
        assert "fleetRef: train-rollout" in cm["data"]["job.yaml"]
        # The job owns a fleet and a pool, which the operator reconciles in turn.
        await eventually(
            lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/train-rollout"), what="fleet engines"
        )
        await eventually(
            lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/train-sandbox"), what="sandbox pods"
        )

        async def phase(p: str) -> Callable[[], Awaitable[bool]]:
            async def probe() -> bool:
                return (await _status(k, f"{API}/agenticrljobs/train")).get("phase") == p

            return probe

        await eventually(await phase("Running"), what="job Running")

        # a trainer pod runs (the emulator has no Job controller: the test plays it)
        pod_path = f"/api/v1/namespaces/{NS}/pods/train-trainer-0-x"
        labels = trainer["spec"]["template"]["metadata"]["labels"]
        await k.create(f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-trainer-0-x", "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "trainer", "image": "i"}]}})  # fmt: skip
        await k.patch(f"{pod_path}/status", {"status": {"phase": "Running"}})

        # suspend: trainer Job suspended, phase Suspended; the fleet and pool keep their size
        # while the trainer pod finishes its step (it calls both) and checkpoints
        await k.patch(f"{API}/agenticrljobs/train", {"spec": {"suspend": True}})
        await eventually(await phase("Suspended"), what="job Suspended")
        assert (await k.get(job_path))["spec"]["suspend"] is True
        await asyncio.sleep(1.5)  # three resync passes
        assert (await k.get(f"{API}/rolloutfleets/train-rollout"))["spec"]["replicas"] == 2
        assert (await k.get(f"{API}/sandboxpools/train-sandbox"))["spec"]["replicas"] == 1
        # the trainer pod ends (exit 143 after its checkpoint): the fleet and pool go to zero
        await k.patch(f"{pod_path}/status", {"status": {"phase": "Failed"}})

        async def released() -> bool:
            fleet = await k.get(f"{API}/rolloutfleets/train-rollout")
            pool = await k.get(f"{API}/sandboxpools/train-sandbox")
            return fleet["spec"]["replicas"] == 0 and pool["spec"]["replicas"] == 0

        await eventually(released, what="the fleet and pool at zero once the trainer pod ended")
        await k.delete(pod_path)
        await k.patch(f"{API}/agenticrljobs/train", {"spec": {"suspend": False}})
        await eventually(await phase("Running"), what="job resumed")
        assert (await k.get(f"{API}/rolloutfleets/train-rollout"))["spec"]["replicas"] == 2

        # the trainer pods finish: the Job controller marks the Job Complete
        done = {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        await k.patch(
            f"/apis/batch/v1/namespaces/{NS}/jobs/train-trainer/status",
            {"status": {"conditions": [done], "succeeded": 2, "active": 0}},
        )
        await eventually(await phase("Succeeded"), what="job Succeeded")
        st = await _status(k, f"{API}/agenticrljobs/train")
        assert any(c["type"] == "Complete" and c["status"] == "True" for c in st["conditions"])
        # A finished job releases its accelerators: the inline fleet and pool are deleted.
        await eventually(lambda: _absent(k, f"{API}/rolloutfleets/train-rollout"), what="fleet released")
        await eventually(
            lambda: _absent(k, f"/apis/apps/v1/namespaces/{NS}/deployments/train-rollout"),
            what="engines gone",
        )
        reasons = [e["reason"] for e in await k.events("train")]
        assert "Running" in reasons and "Suspended" in reasons and "Succeeded" in reasons


async def _absent(k: Cluster, path: str) -> bool:
    return await k.get(path) is None


async def test_job_failure_is_reported_from_trainer_pods() -> None:
    async with cluster_and_operator() as k:
        no_retry = {"replicas": 2, "accelerator": {"profile": "h100", "count": 8}, "maxRestarts": 0}
        await k.create(f"{API}/agenticrljobs", job("boom", trainer=no_retry))
        await eventually(
            lambda: k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/boom-trainer"), what="trainer Job"
        )
        trainer = await k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/boom-trainer")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "boom-trainer-0-x",
                "namespace": NS,
                "labels": trainer["spec"]["template"]["metadata"]["labels"],
            },
            "spec": {"containers": [{"name": "trainer", "image": "i"}]},
        }
        await k.create(f"/api/v1/namespaces/{NS}/pods", pod)
        term = {"terminated": {"reason": "OOMKilled", "exitCode": 137, "message": "CUDA out of memory"}}
        await k.patch(
            f"/api/v1/namespaces/{NS}/pods/boom-trainer-0-x/status",
            {"status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": term}]}},
        )
        failed = {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "Job has reached the specified backoff limit",
        }
        await k.patch(
            f"/apis/batch/v1/namespaces/{NS}/jobs/boom-trainer/status",
            {"status": {"conditions": [failed], "active": 0, "failed": 1}},
        )

        async def failed_phase() -> Any:
            st = await _status(k, f"{API}/agenticrljobs/boom")
            return st if st.get("phase") == "Failed" else None

        st = await eventually(failed_phase, what="job Failed")
        cond = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert "BackoffLimitExceeded" in cond["message"] and "OOMKilled (exit 137)" in cond["message"]
        warnings = [e for e in await k.events("boom") if e["type"] == "Warning"]
        assert any("OOMKilled" in e["message"] for e in warnings)
        # Terminal: deleting the finished trainer does not start a new one.
        await k.delete(f"/apis/batch/v1/namespaces/{NS}/jobs/boom-trainer")
        await asyncio.sleep(1.2)
        assert await k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/boom-trainer") is None


async def test_invalid_objects_and_missing_references_are_reported() -> None:
    # admit=None: what the CRD would reject, reaching the operator anyway (e.g. an older CRD).
    async with emulated_cluster(admit=None) as k, running_operator(k):
        # What the CRD's CEL rule would reject, reaching the operator anyway (e.g. no webhook).
        bad = pool("bad", replicas=9, autoscaling={"minReplicas": 1, "maxReplicas": 4})
        await k.create(f"{API}/sandboxpools", bad)

        async def invalid() -> Any:
            st = await _status(k, f"{API}/sandboxpools/bad")
            return st if st.get("phase") == "Invalid" else None

        st = await eventually(invalid, what="phase Invalid")
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
        assert "replicas (9) is outside the autoscaling bounds" in ready["message"]
        assert await k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/bad") is None
        ev = [e for e in await k.events("bad") if e["type"] == "Warning"]
        assert ev and "outside the autoscaling bounds" in ev[0]["message"]

        # A job referencing a fleet that does not exist waits (no trainer), then proceeds.
        await k.create(f"{API}/agenticrljobs", job("refs", rollout={"fleetRef": "shared"}))

        async def waiting() -> Any:
            s = await _status(k, f"{API}/agenticrljobs/refs")
            return s if s.get("phase") == "Waiting" else None

        s = await eventually(waiting, what="job Waiting")
        assert "RolloutFleet e2e/shared" in s["conditions"][0]["message"]
        assert await k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/refs-trainer") is None
        fleet = {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "shared", "namespace": NS},
            "spec": {
                "model": {"uri": "m"},
                "accelerator": {"profile": "cpu", "count": 1},
                "scheduler": {"policy": "least-requests"},
                "weightSync": {"claimName": "rwx", "mountPath": "/w"},
            },
        }
        await k.create(f"{API}/rolloutfleets", fleet)
        trainer = await eventually(
            lambda: k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/refs-trainer"),
            what="trainer after fleet exists",
        )
        # The referenced fleet's scheduler policy and weight volume reach the trainer pods.
        pod = trainer["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["KUBERL_SCHEDULER_POLICY"] == "least-requests" and env["KUBERL_WEIGHTS_DIR"] == "/w"
        assert {"name": "policy-weights", "persistentVolumeClaim": {"claimName": "rwx"}} in pod["volumes"]

        # Fixing the invalid pool makes it reconcile normally.
        await k.patch(f"{API}/sandboxpools/bad", {"spec": {"replicas": 3}})
        await eventually(
            lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/bad"), what="fixed pool deployed"
        )


@contextlib.asynccontextmanager
async def metrics_server(render: Callable[[], str]) -> AsyncIterator[int]:
    """A real /metrics endpoint on 127.0.0.1 standing in for the pods' exporters."""
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def add_ready_pod(k: Cluster, name: str, labels: dict[str, str], port: int) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "containers": [{"name": "c", "image": "i", "ports": [{"name": "http", "containerPort": port}]}]
        },
    }
    await k.create(f"/api/v1/namespaces/{NS}/pods", pod)
    ready = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    await k.patch(f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": ready})


async def test_pool_autoscaling_from_scraped_queue_depth() -> None:
    load = {"queue": 0.0, "busy": 0.0}

    def render() -> str:
        return (
            "# TYPE kuberl_sandbox_queue_depth gauge\n"
            f'kuberl_sandbox_queue_depth{{pool="auto"}} {load["queue"]}\n'
            "# TYPE kuberl_sandbox_workers_busy gauge\n"
            f'kuberl_sandbox_workers_busy{{pool="auto"}} {load["busy"]}\n'
        )

    async with metrics_server(render) as port, cluster_and_operator(autoscale_interval=0.3) as k:
        auto = {
            "minReplicas": 1,
            "maxReplicas": 6,
            "targetQueuePerWorker": 2,
            "scaleDownStabilizationSeconds": 0,
        }
        await k.create(f"{API}/sandboxpools", pool("auto", replicas=1, workersPerPod=4, autoscaling=auto))
        dep_path = f"/apis/apps/v1/namespaces/{NS}/deployments/auto"
        dep = await eventually(lambda: k.get(dep_path), what="Deployment")
        await add_ready_pod(k, "auto-0", dep["spec"]["selector"]["matchLabels"], port)

        # 1 pod x 4 workers with 16 queued = 4/worker, target 2 -> 2 pods, then 4 as the
        # per-pod queue stays high (the exporter reports the same totals), capped at 6.
        load.update(queue=16.0, busy=4.0)

        async def replicas_at_least(n: int) -> Callable[[], Awaitable[bool]]:
            async def probe() -> bool:
                return (await k.get(f"{API}/sandboxpools/auto"))["spec"]["replicas"] >= n and (
                    await k.get(dep_path)
                )["spec"]["replicas"] >= n

            return probe

        await eventually(await replicas_at_least(2), what="scale-up")
        st = await _status(k, f"{API}/sandboxpools/auto")
        assert st.get("queueDepth") == 16.0 and st.get("workersBusy") == 4.0
        assert any(e["reason"] == "ScaledUp" for e in await k.events("auto"))

        # Load gone: scale down to minReplicas (no stabilization window in this test).
        load.update(queue=0.0, busy=0.0)

        async def at_min() -> bool:
            return (await k.get(f"{API}/sandboxpools/auto"))["spec"]["replicas"] == 1 and (
                await k.get(dep_path)
            )["spec"]["replicas"] == 1

        await eventually(at_min, what="scale-down to minReplicas")
        assert any(e["reason"] == "ScaledDown" for e in await k.events("auto"))


async def test_fleet_autoscaling_on_sglang_metrics_with_stabilization() -> None:
    load = {"usage": 0.95, "queued": 0.0}

    def render() -> str:
        return (
            "# TYPE sglang:token_usage gauge\n"
            f'sglang:token_usage{{model_name="policy"}} {load["usage"]}\n'
            "# TYPE sglang:num_queue_reqs gauge\n"
            f'sglang:num_queue_reqs{{model_name="policy"}} {load["queued"]}\n'
        )

    async with metrics_server(render) as port, cluster_and_operator(autoscale_interval=0.3) as k:
        fleet = {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "gen", "namespace": NS},
            "spec": {
                "replicas": 2,
                "model": {"uri": "m"},
                "accelerator": {"profile": "cpu", "count": 1},
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "targetKVCacheUtilization": 0.8,
                    "scaleDownStabilizationSeconds": 2,
                },
            },
        }
        await k.create(f"{API}/rolloutfleets", fleet)
        dep = await eventually(
            lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/gen"), what="engines"
        )
        for i in range(2):
            await add_ready_pod(k, f"gen-{i}", dep["spec"]["selector"]["matchLabels"], port)

        async def replicas(n: int) -> Callable[[], Awaitable[bool]]:
            async def probe() -> bool:
                return (await k.get(f"{API}/rolloutfleets/gen"))["spec"]["replicas"] == n

            return probe

        await eventually(await replicas(3), what="scale-up to maxReplicas")  # ceil(2*0.95/0.8) = 3

        async def reported() -> bool:
            # status is written right after the scale (autoscaler) and at the next resync (engines)
            st = await _status(k, f"{API}/rolloutfleets/gen")
            return st.get("kvCacheUtilization") == 0.95 and st.get("engines") == ["127.0.0.1:30000"] * 2

        await eventually(reported, what="load and engines in status")
        load.update(usage=0.1)
        t0 = time.monotonic()
        await eventually(await replicas(1), timeout=10, what="scale-down after the window")
        assert time.monotonic() - t0 >= 1.5, "scale-down must wait for the stabilization window"


async def test_admission_webhooks_through_kopf() -> None:
    """Validating and mutating admission, served by kopf's own webhook server (plain HTTP)."""
    import base64
    import json

    port = free_port()
    webhook = kopf.WebhookServer(host="127.0.0.1", port=port, insecure=True)
    async with (
        ClusterEmulator(namespaces={NS}) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        url = str(srv.url).rstrip("/")
        cfg = OperatorConfig(
            reconcile_interval=0.5,
            login=lambda **_: kopf.ConnectionInfo(server=url, default_namespace=NS),
            admission=True,
        )
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            operate(cfg, namespaces=[NS], stop_flag=stop, ready_flag=ready, fast=True, webhook=webhook)
        )
        try:
            await asyncio.wait_for(ready.wait(), 15)
            k = Cluster(emu, url, session)

            async def review(hook: str, obj: dict[str, Any], plural: str) -> dict[str, Any]:
                body = {
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "request": {
                        "uid": "u1",
                        "kind": {"group": "kuberl.io", "version": "v1alpha1", "kind": obj["kind"]},
                        "resource": {"group": "kuberl.io", "version": "v1alpha1", "resource": plural},
                        "operation": "CREATE",
                        "namespace": NS,
                        "name": obj["metadata"]["name"],
                        "object": obj,
                        "userInfo": {"username": "tester"},
                        "dryRun": False,
                    },
                }
                for _ in range(50):  # the server starts after the resources are scanned
                    try:
                        async with session.post(f"http://127.0.0.1:{port}/{hook}", json=body) as rsp:
                            return (await rsp.json())["response"]
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.1)
                pytest.fail("webhook server did not start")

            bad = job("bad-ref", rollout={"fleetRef": "nope"}, sandbox={"poolRef": "nada"})
            rsp = await review("validate-agenticrljobs", bad, "agenticrljobs")
            assert rsp["allowed"] is False
            assert "RolloutFleet e2e/nope does not exist" in rsp["status"]["message"]
            assert "SandboxPool e2e/nada does not exist" in rsp["status"]["message"]

            clip = job("clip", algorithm={"clip": {"low": 0.3, "high": 0.2}})
            rsp = await review("validate-agenticrljobs", clip, "agenticrljobs")
            assert (
                rsp["allowed"] is False
                and "clip.high (0.2) must be >= clip.low (0.3)" in rsp["status"]["message"]
            )

            await k.create(
                f"{API}/rolloutfleets",
                {
                    "apiVersion": "kuberl.io/v1alpha1",
                    "kind": "RolloutFleet",
                    "metadata": {"name": "nope", "namespace": NS},
                    "spec": {"model": {"uri": "Qwen/Qwen2.5-1.5B-Instruct"}, "accelerator": {"profile": "cpu"},
                             "weightSync": {"claimName": "w"}},  # serves the job's model
                },
            )
            await k.create(f"{API}/sandboxpools", pool("nada"))
            rsp = await review("validate-agenticrljobs", bad, "agenticrljobs")
            assert rsp["allowed"] is True

            # the rules `kuberl validate` applies to the fleet in the file, here to the live one
            await k.create(
                f"{API}/rolloutfleets",
                {
                    "apiVersion": "kuberl.io/v1alpha1",
                    "kind": "RolloutFleet",
                    "metadata": {"name": "frozen", "namespace": NS},
                    "spec": {"model": {"uri": "m"}, "accelerator": {"profile": "cpu"}},
                },
            )
            frozen = job("frozen", rollout={"fleetRef": "frozen"}, sandbox={"poolRef": "nada"})
            rsp = await review("validate-agenticrljobs", frozen, "agenticrljobs")
            assert rsp["allowed"] is False
            assert "RolloutFleet e2e/frozen (spec.rollout.fleetRef) spec.weightSync is not set" in rsp["status"]["message"]

            # warnings come back as the AdmissionReview's, which kubectl prints as `Warning:`
            busy = job("busy", rollout={"fleetRef": "nope"}, sandbox={"pool": {"replicas": 1, "workersPerPod": 1}})
            rsp = await review("validate-agenticrljobs", busy, "agenticrljobs")
            assert rsp["allowed"] is True
            assert any("spec.sandbox.pool: 1 sandbox workers" in w for w in rsp.get("warnings", [])), rsp

            inline = job("inline", rollout={"fleet": {"replicas": 1}})
            rsp = await review("mutate-agenticrljobs", inline, "agenticrljobs")
            assert rsp["allowed"] is True and rsp["patchType"] == "JSONPatch"
            ops = json.loads(base64.b64decode(rsp["patch"]))
            paths = {op["path"]: op.get("value") for op in ops}
            assert any("rollout/fleet/model" in p for p in paths), ops
            assert any("labels" in p for p in paths), ops
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 10)


async def test_job_spec_change_updates_config_and_replaces_trainer() -> None:
    async with cluster_and_operator() as k:
        await k.create(f"{API}/agenticrljobs", job("edit", seed=1))
        job_path = f"/apis/batch/v1/namespaces/{NS}/jobs/edit-trainer"
        first = await eventually(lambda: k.get(job_path), what="trainer Job")
        await k.patch(f"{API}/agenticrljobs/edit", {"spec": {"seed": 2}})

        async def config_updated() -> bool:
            cm = await k.get(f"/api/v1/namespaces/{NS}/configmaps/edit-config")
            return "seed: 2" in cm["data"]["job.yaml"]

        await eventually(config_updated, what="ConfigMap updated")

        async def replaced() -> bool:
            j = await k.get(job_path)
            return bool(j) and j["metadata"]["uid"] != first["metadata"]["uid"]

        # The pod template is immutable: the trainer is replaced (it resumes from its checkpoint).
        await eventually(replaced, what="trainer Job replaced")
        new = await k.get(job_path)
        h = "kuberl.io/config-hash"
        assert (
            new["spec"]["template"]["metadata"]["annotations"][h]
            != first["spec"]["template"]["metadata"]["annotations"][h]
        )
        assert any(e["reason"] == "TrainerReplaced" for e in await k.events("edit"))


async def test_kuberl_operator_cli_with_kubeconfig(tmp_path: Any) -> None:
    """`kuberl operator -n e2e` (kopf.run underneath) logs in from a kubeconfig and reconciles."""
    import os
    import signal
    import sys

    async with (
        ClusterEmulator(namespaces={NS}) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        url = str(srv.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        write_kubeconfig(kubeconfig, url, NS)
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "KUBERL_RECONCILE_INTERVAL": "0.5",
            "KUBERL_OPERATOR_METRICS_PORT": "0",  # any free port: the machine is shared
            "KUBERL_HEALTH_PORT": "0",  # no probe endpoints (fixed ports would collide)
            "KUBERL_LIVENESS_PORT": "0",
        }
        env.pop("KUBERL_WEBHOOK_PORT", None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kuberl",
            "operator",
            "-n",
            NS,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            k = Cluster(emu, url, session)
            await k.create(f"{API}/sandboxpools", pool("cli", replicas=1))
            await eventually(
                lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/cli"),
                timeout=20,
                what="Deployment from the CLI operator",
            )
            # It authenticated with the kubeconfig's token.
            assert any(r.headers.get("Authorization") == "Bearer test-token" for r in list(emu))
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        out = (await proc.stdout.read()).decode()  # type: ignore[union-attr]
        assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]


async def test_a_queued_job_on_a_cluster_without_kueue_waits_and_says_why() -> None:
    """The queue label on a cluster that does not serve Kueue's API: no trainer is made (the job
    would take GPUs outside the queue its owner named) and the status says what to do."""
    async with cluster_and_operator() as k:
        doc = job()
        doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
        await k.create(f"{API}/agenticrljobs", doc)

        async def queued() -> dict[str, Any] | None:
            st = await _status(k, f"{API}/agenticrljobs/train")
            return st if st.get("phase") == "Queued" else None

        st = await eventually(queued, what="job Queued")
        held = next(c for c in st["conditions"] if c["type"] == "Suspended")
        assert held["reason"] == "KueueUnavailable" and "install Kueue" in held["message"], held
        trainer = await k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/train-trainer")
        assert trainer is None or trainer["spec"]["suspend"] is True
