"""End-to-end regressions of the operator's reconcile, pruning and autoscaling (issue 6 review).

Same set-up as test_operator_e2e.py: the real kopf runtime against the kmock-based API
emulator over HTTP, driven only through the API. Each test names the defect it pins down.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kuberl.operator.runtime import metrics
from kuberl.util.ports import free_port
from tests.test_operator_e2e import (
    API,
    NS,
    Cluster,
    add_ready_pod,
    cluster_and_operator,
    emulated_cluster,
    eventually,
    job,
    metrics_server,
    pool,
    running_operator,
)

pytestmark = pytest.mark.timeout(90)
DEP = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"


def fleet(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "model": {"uri": "m"}, **spec},
    }


def sandbox_load(pool_name: str, queue: float, busy: float) -> str:
    return (
        "# TYPE kuberl_sandbox_queue_depth gauge\n"
        f'kuberl_sandbox_queue_depth{{pool="{pool_name}"}} {queue}\n'
        "# TYPE kuberl_sandbox_workers_busy gauge\n"
        f'kuberl_sandbox_workers_busy{{pool="{pool_name}"}} {busy}\n'
    )


async def _reasons(k: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in await k.events(name)]


async def test_profile_change_removes_what_the_old_profile_set() -> None:
    """A: h100 -> cpu used to keep the NVIDIA affinity, toleration and GPU limits forever."""
    async with cluster_and_operator() as k:
        await k.create(f"{API}/rolloutfleets", fleet("gen", accelerator={"profile": "h100", "count": 1}))
        dep = await eventually(lambda: k.get(f"{DEP}/gen"), what="engines")
        pod = dep["spec"]["template"]["spec"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and "affinity" in pod
        await k.patch(f"{API}/rolloutfleets/gen", {"spec": {"accelerator": {"profile": "cpu", "count": 1}}})

        async def on_cpu() -> Any:
            d = await k.get(f"{DEP}/gen")
            return d if "--device" in d["spec"]["template"]["spec"]["containers"][0]["command"] else None

        pod = (await eventually(on_cpu, what="cpu engine"))["spec"]["template"]["spec"]
        assert "affinity" not in pod and "tolerations" not in pod
        assert "nvidia.com/gpu" not in str(pod["containers"][0].get("resources"))


async def test_engines_spanning_nodes_replace_the_deployment_with_a_leaderworkerset() -> None:
    """B: TP 8 -> 16 left the old 8-GPU Deployment running next to the new LeaderWorkerSet."""
    async with cluster_and_operator() as k:
        spec = {"accelerator": {"profile": "h100", "count": 8}, "engine": {"tensorParallel": 8}}
        await k.create(f"{API}/rolloutfleets", fleet("big", **spec))
        await eventually(lambda: k.get(f"{DEP}/big"), what="Deployment")
        await k.patch(f"{API}/rolloutfleets/big", {"spec": {"engine": {"tensorParallel": 16}}})
        lws = await eventually(lambda: k.get(f"{LWS}/big"), what="LeaderWorkerSet")

        async def deployment_gone() -> bool:
            return await k.get(f"{DEP}/big") is None

        await eventually(deployment_gone, what="old Deployment deleted")
        # The event is posted after the delete call returns: under load it lands a moment later.
        await eventually(lambda: _has_reason(k, "big", "ChildDeleted"), what="ChildDeleted event")
        # Only group leaders serve: the scale selector and the engine list skip worker pods,
        # which carry the same instance labels.
        leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
        worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        await add_ready_pod(k, "big-0", leader, 30000)
        await add_ready_pod(k, "big-0-1", worker, 30000)

        async def leaders_only() -> Any:
            st = (await k.get(f"{API}/rolloutfleets/big")).get("status") or {}
            return st if st.get("engines") else None

        st = await eventually(leaders_only, what="engines in status")
        assert st["engines"] == ["127.0.0.1:30000"]
        assert "kuberl.io/role=leader" in st["selector"].split(",")
        # A fleet of another owner with the same instance label is not touched.
        assert await k.get(f"/api/v1/namespaces/{NS}/services/big")


async def test_suspend_and_resume_a_job_with_an_autoscaled_inline_pool() -> None:
    """C: suspending left the inline pool with autoscaling but 0 replicas: Invalid, pods running."""
    async with cluster_and_operator() as k:
        spec = {
            "sandbox": {"pool": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}},
            "rollout": {"engine": "local"},
        }
        await k.create(f"{API}/agenticrljobs", job("sj", **spec))
        await eventually(lambda: k.get(f"{DEP}/sj-sandbox"), what="pool pods")
        await k.patch(f"{API}/agenticrljobs/sj", {"spec": {"suspend": True}})

        async def drained() -> Any:
            p = await k.get(f"{API}/sandboxpools/sj-sandbox")
            d = await k.get(f"{DEP}/sj-sandbox")
            ok = p["spec"]["replicas"] == 0 and "autoscaling" not in p["spec"] and d["spec"]["replicas"] == 0
            return p if ok else None

        p = await eventually(drained, what="inline pool scaled to zero without autoscaling")
        await eventually(
            lambda: _phase(k, "sandboxpools/sj-sandbox", "Ready"), what="suspended pool is valid and Ready"
        )
        assert p["status"].get("phase") != "Invalid"
        await k.patch(f"{API}/agenticrljobs/sj", {"spec": {"suspend": False}})

        async def resumed() -> bool:
            s = (await k.get(f"{API}/sandboxpools/sj-sandbox"))["spec"]
            return s["replicas"] == 2 and s.get("autoscaling", {}).get("maxReplicas") == 4

        await eventually(resumed, what="inline pool back with its autoscaling")


async def _phase(k: Cluster, path: str, phase: str) -> bool:
    return ((await k.get(f"{API}/{path}")).get("status") or {}).get("phase") == phase


async def test_job_leaves_an_autoscaled_inline_pool_to_its_autoscaler() -> None:
    """D: the job's reconcile wrote replicas back to 1 after every scale-up (1, 2, 1, 2, ...)."""
    async with (
        metrics_server(lambda: sandbox_load("j-sandbox", 64, 4)) as port,
        cluster_and_operator(autoscale_interval=0.3) as k,
    ):
        auto = {
            "minReplicas": 1,
            "maxReplicas": 8,
            "targetQueuePerWorker": 2,
            "scaleDownStabilizationSeconds": 0,
        }
        spec = {
            "sandbox": {"pool": {"replicas": 1, "workersPerPod": 4, "autoscaling": auto}},
            "rollout": {"engine": "local"},
        }
        await k.create(f"{API}/agenticrljobs", job("j", **spec))
        dep = await eventually(lambda: k.get(f"{DEP}/j-sandbox"), what="pool pods")
        await add_ready_pod(k, "j-sandbox-0", dep["spec"]["selector"]["matchLabels"], port)
        seen: list[int] = []
        deadline, top_since = time.monotonic() + 30, None
        # Watch through the scale-up to 8 and several job resyncs after it.
        while time.monotonic() < deadline and (top_since is None or time.monotonic() - top_since < 2.5):
            seen.append((await k.get(f"{API}/sandboxpools/j-sandbox"))["spec"]["replicas"])
            if seen[-1] == 8 and top_since is None:
                top_since = time.monotonic()
            await asyncio.sleep(0.1)
        assert seen[-1] == 8, seen
        assert all(a <= b for a, b in zip(seen, seen[1:], strict=False)), f"replicas went back down: {seen}"
        assert "ChildUpdated" not in await _reasons(k, "j"), "the job rewrote its pool"


async def test_new_objects_are_not_reported_as_recreated_drift() -> None:
    """E: the resync could reach a new object before kopf's create handler and call every
    child "missing and recreated"."""
    async with cluster_and_operator(reconcile_interval=0.05) as k:
        for i in range(4):
            await k.create(f"{API}/agenticrljobs", job(f"new-{i}", rollout={"engine": "local"}))
        for i in range(4):
            await eventually(lambda i=i: _phase(k, f"agenticrljobs/new-{i}", "Running"), what=f"job {i}")
        await asyncio.sleep(0.5)
        for i in range(4):
            assert "ChildRecreated" not in await _reasons(k, f"new-{i}")


async def test_unchanged_children_are_not_patched_at_every_resync() -> None:
    """F: the API server canonicalizes quantities and drops ``egress: []``; comparing with the
    raw desired object sent a patch (and a ChildUpdated event) at every resync."""
    async with cluster_and_operator(reconcile_interval=0.2) as k:
        resources = {
            "requests": {"cpu": "0.5", "memory": "1024Mi"},
            "limits": {"cpu": "1", "memory": "2048Mi"},
        }
        await k.create(f"{API}/sandboxpools", pool("calm", replicas=1, resources=resources))
        await eventually(lambda: _phase(k, "sandboxpools/calm", "Ready"), what="pool Ready")
        paths = [
            f"{DEP}/calm",
            f"/api/v1/namespaces/{NS}/services/calm",
            f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/calm-deny-egress",
        ]
        dep = await k.get(paths[0])
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {
            "cpu": "500m",
            "memory": "1Gi",
        }
        assert "egress" not in (await k.get(paths[2]))["spec"]  # stored without the empty list
        versions = [(await k.get(p))["metadata"]["resourceVersion"] for p in paths]
        await asyncio.sleep(1.5)  # several resync periods
        assert [(await k.get(p))["metadata"]["resourceVersion"] for p in paths] == versions
        assert "ChildUpdated" not in await _reasons(k, "calm")


def _samples(text: str, name: str) -> dict[tuple[str, str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["namespace"], s.labels["kind"], s.labels["name"]] = s.value
    return out


async def _scrape_operator() -> str:
    port = metrics.serving_port()
    assert port is not None
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as rsp:
        return await rsp.text()


async def test_operator_metrics_and_deletion_forgets_the_object() -> None:
    """M: the operator serves its autoscaler decisions; G: a deleted object is forgotten (its
    series disappear) and the deletion is reported, without any finalizer. The resync is slow
    here, so only the DELETED watch event can make the operator forget in time."""
    async with (
        metrics_server(lambda: sandbox_load("busy", 64, 4)) as port,
        cluster_and_operator(reconcile_interval=30, autoscale_interval=0.3, metrics_port=0) as k,
    ):
        auto = {
            "minReplicas": 1,
            "maxReplicas": 3,
            "targetQueuePerWorker": 2,
            "scaleDownStabilizationSeconds": 0,
        }
        await k.create(f"{API}/sandboxpools", pool("busy", replicas=1, workersPerPod=4, autoscaling=auto))
        await k.create(f"{API}/sandboxpools", pool("fixed", replicas=2))
        dep = await eventually(lambda: k.get(f"{DEP}/busy"), what="pool pods")
        await add_ready_pod(k, "busy-0", dep["spec"]["selector"]["matchLabels"], port)

        async def decided() -> Any:
            text = await _scrape_operator()
            desired = _samples(text, "kuberl_autoscaler_desired_replicas")
            ready = _samples(text, "kuberl_autoscaler_ready_replicas")
            ok = (
                desired.get((NS, "SandboxPool", "busy")) == 3 and ready.get((NS, "SandboxPool", "fixed")) == 2
            )
            return (desired, ready) if ok else None

        desired, ready = await eventually(decided, what="autoscaler decision in the operator's /metrics")
        assert desired[NS, "SandboxPool", "fixed"] == 2  # not autoscaled: spec.replicas
        assert (await k.get(f"{API}/sandboxpools/busy"))["spec"]["replicas"] == 3
        assert not (await k.get(f"{API}/sandboxpools/fixed"))["metadata"].get("finalizers")

        await k.delete(f"{API}/sandboxpools/fixed")

        async def forgotten() -> bool:
            text = await _scrape_operator()
            return (NS, "SandboxPool", "fixed") not in _samples(
                text, "kuberl_autoscaler_desired_replicas"
            ) and (
                NS,
                "SandboxPool",
                "fixed",
            ) not in _samples(text, "kuberl_autoscaler_ready_replicas")

        await eventually(forgotten, what="series of the deleted pool removed")
        await eventually(lambda: _has_reason(k, "fixed", "Deleted"), what="Deleted event")


async def _has_reason(k: Cluster, name: str, reason: str) -> bool:
    return reason in await _reasons(k, name)


async def test_autoscaling_runs_at_its_own_interval() -> None:
    """H: autoscaling only ran inside the resync, so a 30 s resync meant 30 s per decision."""
    async with (
        metrics_server(lambda: sandbox_load("quick", 64, 4)) as port,
        cluster_and_operator(reconcile_interval=30, autoscale_interval=0.2) as k,
    ):
        auto = {"minReplicas": 1, "maxReplicas": 4, "targetQueuePerWorker": 2}
        await k.create(f"{API}/sandboxpools", pool("quick", replicas=1, workersPerPod=4, autoscaling=auto))
        dep = await eventually(lambda: k.get(f"{DEP}/quick"), what="pool pods")
        await add_ready_pod(k, "quick-0", dep["spec"]["selector"]["matchLabels"], port)

        async def scaled() -> bool:
            return (await k.get(f"{DEP}/quick"))["spec"]["replicas"] >= 2

        await eventually(scaled, timeout=8, what="scale-up well before the next resync")


async def test_restarted_operator_keeps_the_scale_down_window() -> None:
    """H: the stabilization history lived in memory; a restarted operator scaled down at once."""
    load = {"queue": 64.0, "busy": 4.0}
    async with (
        metrics_server(lambda: sandbox_load("steady", load["queue"], load["busy"])) as port,
        emulated_cluster() as k,
    ):
        auto = {
            "minReplicas": 1,
            "maxReplicas": 4,
            "targetQueuePerWorker": 2,
            "scaleDownStabilizationSeconds": 60,
        }
        await k.create(f"{API}/sandboxpools", pool("steady", replicas=1, workersPerPod=4, autoscaling=auto))
        async with running_operator(k, autoscale_interval=0.2):
            dep = await eventually(lambda: k.get(f"{DEP}/steady"), what="pool pods")
            await add_ready_pod(k, "steady-0", dep["spec"]["selector"]["matchLabels"], port)

            async def scaled_up() -> bool:
                return (await k.get(f"{API}/sandboxpools/steady"))["spec"]["replicas"] == 4

            await eventually(scaled_up, what="scale-up to 4")
        st = (await k.get(f"{API}/sandboxpools/steady"))["status"]
        assert max(r["replicas"] for r in st["recommendations"]) >= 4
        load.update(queue=0.0, busy=0.0)  # idle: the load now asks for 0 pods
        async with running_operator(k, autoscale_interval=0.2):

            async def decided_again() -> Any:
                s = (await k.get(f"{API}/sandboxpools/steady"))["status"]
                return s if s.get("queueDepth") == 0.0 else None

            await eventually(decided_again, what="the new operator scraped the idle pool")
            await asyncio.sleep(1.0)  # several decisions
            assert (await k.get(f"{API}/sandboxpools/steady"))["spec"]["replicas"] == 4


async def test_job_waits_for_a_fleet_whose_context_is_too_short() -> None:
    """K: SGLang answers HTTP 400 when prompt + max_new_tokens reaches the context length."""
    async with cluster_and_operator() as k:
        await k.create(f"{API}/rolloutfleets", fleet("short", engine={"contextLength": 4096}))
        stages = [{"name": "rl", "type": "rl", "steps": 10, "maxResponseTokens": 8192}]
        await k.create(f"{API}/agenticrljobs", job("ctx", rollout={"fleetRef": "short"}, stages=stages))

        async def waiting() -> Any:
            st = (await k.get(f"{API}/agenticrljobs/ctx")).get("status") or {}
            return st if st.get("phase") == "Waiting" else None

        st = await eventually(waiting, what="job Waiting")
        msg = st["conditions"][0]["message"]
        assert "engine.contextLength 4096" in msg and "stage 'rl' maxResponseTokens 8192" in msg
        assert await k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/ctx-trainer") is None
        await k.patch(f"{API}/rolloutfleets/short", {"spec": {"engine": {"contextLength": 16384}}})
        await eventually(
            lambda: k.get(f"/apis/batch/v1/namespaces/{NS}/jobs/ctx-trainer"), what="trainer once it fits"
        )


def _tls_files(tmp_path: Any, dns: str) -> dict[str, str]:
    """A CA and a server certificate for ``dns`` and 127.0.0.1 (what the chart's Secret holds)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool, sans: list[Any]) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kuberl-webhook-ca", ca_key, "kuberl-webhook-ca", ca_key, True, [])
    sans = [x509.DNSName(dns), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = cert(dns, key, "kuberl-webhook-ca", ca_key, False, sans)
    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": ca.public_bytes(pem),
        "tls.crt": server.public_bytes(pem),
        "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: str(tmp_path / name) for name in files}


async def test_admission_in_cluster_is_reached_through_a_service_over_tls(tmp_path: Any) -> None:
    """J: deployable admission. With the chart's environment, kopf serves HTTPS with the
    mounted certificate (what the chart's caBundle trusts) and answers over TLS; it writes no
    webhook configuration of its own."""
    import ssl

    from kuberl.operator.runtime.main import webhook_server_from_env

    port = free_port()
    tls = _tls_files(tmp_path, f"kuberl-webhook.{NS}.svc")
    env = {
        "KUBERL_WEBHOOK_PORT": str(port),
        "KUBERL_WEBHOOK_SERVICE": "kuberl-webhook",
        "KUBERL_WEBHOOK_NAMESPACE": NS,
        "KUBERL_WEBHOOK_CERT": tls["tls.crt"],
        "KUBERL_WEBHOOK_KEY": tls["tls.key"],
        "KUBERL_WEBHOOK_CA": tls["ca.crt"],
    }
    async with emulated_cluster() as k, running_operator(k, webhook=webhook_server_from_env(env)):
        trust = ssl.create_default_context(cafile=tls["ca.crt"])  # as the API server, with caBundle
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": {"group": "kuberl.io", "version": "v1alpha1", "kind": "SandboxPool"},
                "resource": {"group": "kuberl.io", "version": "v1alpha1", "resource": "sandboxpools"},
                "operation": "CREATE",
                "namespace": NS,
                "name": "bad",
                "object": pool("bad", replicas=9, autoscaling={"minReplicas": 1, "maxReplicas": 4}),
                "userInfo": {"username": "tester"},
                "dryRun": False,
            },
        }
        answer: dict[str, Any] = {}
        for _ in range(100):  # the server starts once kopf has scanned the resources
            try:
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(f"https://127.0.0.1:{port}/validate-sandboxpools", json=review, ssl=trust) as rsp,
                ):
                    answer = (await rsp.json())["response"]
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
        assert answer["allowed"] is False and "outside the autoscaling bounds" in answer["status"]["message"]
        # The webhook configurations are the chart's (tests/test_chart.py): the operator writes
        # none, so nothing of it outlives `helm uninstall` to block writes of kuberl objects.
        for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
            listed = await k.get(f"/apis/admissionregistration.k8s.io/v1/{kind}")
            assert not (listed or {}).get("items"), listed
