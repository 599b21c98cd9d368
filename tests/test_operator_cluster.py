"""Issue 14 (part B): what a real cluster expects of the operator that the emulator hid.

Admission updates, kopf's liveness endpoint, sandbox authentication and network isolation,
the stand-in SGLang's slow /health against the rendered probes, and API load per resync.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import aiohttp
import kopf
import pytest

from kuberl.operator import admission
from kuberl.operator.handlers import OperatorConfig, OperatorContext
from kuberl.operator.loops import stale_loops
from kuberl.operator.main import operate
from kuberl.operator.testing import ClusterEmulator
from tests.test_operator_e2e import NS, emulated_cluster

pytestmark = pytest.mark.timeout(120)


def _job(**spec: Any) -> dict[str, Any]:
    base = {"model": {"base": "m"}, "data": {"train": "s3://d/t.jsonl"}}
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": "j", "namespace": "ns"},
        "spec": {**base, **spec},
    }


async def _nothing_exists(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return None


async def test_updates_are_judged_on_what_they_change() -> None:
    """Once a referenced fleet is gone, suspending the job, relabelling it, kopf's bookkeeping
    and its deletion must still go through; a create, or an update that points the reference
    somewhere new, is still checked."""
    old = _job(rollout={"fleetRef": "gone"}, sandbox={"poolRef": "gone-too"})
    assert await admission.validation_errors(old, _nothing_exists)  # CREATE: checked
    suspended = _job(rollout={"fleetRef": "gone"}, sandbox={"poolRef": "gone-too"}, suspend=True)
    assert await admission.validation_errors(suspended, _nothing_exists, old) == []
    relabelled = {**old, "metadata": {**old["metadata"], "labels": {"team": "a"}}}
    assert await admission.validation_errors(relabelled, _nothing_exists, old) == []
    deleting = {**old, "metadata": {**old["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert await admission.validation_errors(deleting, _nothing_exists, old) == []
    moved = _job(rollout={"fleetRef": "other"}, sandbox={"poolRef": "gone-too"})
    errors = await admission.validation_errors(moved, _nothing_exists, old)
    assert len(errors) == 1 and "RolloutFleet ns/other does not exist" in errors[0]
    # the spec rules themselves still apply to every update that changes the spec
    bad = _job(
        rollout={"fleetRef": "gone"},
        sandbox={"poolRef": "gone-too"},
        algorithm={"clip": {"low": 0.3, "high": 0.2}},
    )
    assert any("clip.high" in e for e in await admission.validation_errors(bad, _nothing_exists, old))


def test_stale_loops_fail_the_liveness_probe() -> None:
    ctx = OperatorContext(OperatorConfig(reconcile_interval=30, autoscale_interval=15))
    ctx.heartbeats = {"resync": 1000.0, "autoscale": 1000.0}
    assert stale_loops(ctx, 1100.0) == []
    stale = stale_loops(ctx, 1000.0 + 120 + 3 * 15 + 1)
    assert stale == ["autoscale loop: last pass 166 s ago"]


async def test_operator_serves_kopfs_liveness_endpoint() -> None:
    """The chart's probes hit /healthz on the health port: kopf answers it with the results of
    the operator's probe handlers (the periodic loops' ages)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with emulated_cluster() as k:
        cfg = OperatorConfig(
            reconcile_interval=0.3,
            autoscale_interval=0.3,
            login=lambda **_: kopf.ConnectionInfo(server=k.url, default_namespace=NS),
        )
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            operate(cfg, namespaces=[NS], stop_flag=stop, ready_flag=ready, fast=True, health_port=port)
        )
        try:
            await asyncio.wait_for(ready.wait(), 15)
            body: dict[str, Any] = {}
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/healthz") as rsp:
                            body = await rsp.json()
                            if rsp.status == 200 and body.get("loops"):
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.2)
            assert set(body["loops"]) == {"resync", "autoscale"}, body
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 10)


# --- item 9: who can run code in a sandbox, who can reach an engine --------------------------------


def test_sandbox_service_needs_the_pools_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real service started as a SandboxPool pod starts it (token in KUBERL_SANDBOX_TOKEN):
    code runs only for a client with the token; probes and /metrics stay open."""
    import urllib.error
    import urllib.request

    from kuberl.sandbox.client import SandboxClient, SandboxError
    from kuberl.sandbox.local import running_sandbox

    monkeypatch.setenv("KUBERL_SANDBOX_TOKEN", "pool-secret")
    with running_sandbox(workers=1) as url:

        async def run(token: str) -> str:
            async with SandboxClient(url, token=token, retries=0, request_timeout=20) as c:
                return (await c.execute("print(6 * 7)")).output

        assert asyncio.run(run("pool-secret")).strip() == "42"
        for wrong in ("", "guess"):
            with pytest.raises(SandboxError, match="401"):
                asyncio.run(run(wrong))
        with urllib.request.urlopen(url + "/metrics", timeout=5) as rsp:
            assert rsp.status == 200
        req = urllib.request.Request(url + "/v1/verify", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 401
        # the trainer's client picks the token up from the same variable
        assert SandboxClient(url).token == "pool-secret"


def _resource(kind: str, name: str, spec: dict[str, Any], labels: dict[str, str] | None = None) -> Any:
    from kuberl.api import parse_resource

    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if labels:
        meta["labels"] = labels
    return parse_resource({"apiVersion": "kuberl.io/v1alpha1", "kind": kind, "metadata": meta, "spec": spec})


def _allowed(policy: dict[str, Any], pod_labels: dict[str, str], namespace: str, port: int) -> bool:
    """Whether ``policy`` admits a connection from a pod (labels, namespace) to ``port``
    (NetworkPolicy semantics for the peers the builders use: podSelector = same namespace)."""
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and all(p["port"] != port for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "podSelector" in peer and namespace == policy["metadata"]["namespace"]:
                if peer["podSelector"].get("matchLabels", {}).items() <= pod_labels.items():
                    return True
            if "namespaceSelector" in peer:
                if peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}:
                    return True
    return False


def test_network_policies_admit_only_the_jobs_trainers_and_monitoring() -> None:
    """The sandbox admitted port 8080 from every namespace and fleets had no policy at all: any
    pod could run code or push weights. Now: the owning job's trainer pods (a standalone pool or
    fleet: the namespace's kuberl trainers), the monitoring namespace, and a fleet's own pods."""
    from kuberl.operator.builders import build_for

    job = _resource(
        "AgenticRLJob",
        "j",
        {
            "model": {"base": "m"},
            "data": {"train": "s3://d/t.jsonl"},
            "rollout": {"fleet": {"engine": {"tensorParallel": 16}, "accelerator": {"count": 8}}},
            "sandbox": {"pool": {"replicas": 1}},
        },
    )
    objs = build_for(job)
    trainer = next(o for o in objs if o["kind"] == "Job")["spec"]["template"]
    trainer_labels = trainer["metadata"]["labels"]
    other_job = {**trainer_labels, "app.kubernetes.io/instance": "someone-else"}
    stranger = {"app": "curl"}
    inline = {o["kind"]: o for o in objs if o["kind"] in ("RolloutFleet", "SandboxPool")}
    pool = _resource(
        "SandboxPool", "j-sandbox", inline["SandboxPool"]["spec"], inline["SandboxPool"]["metadata"]["labels"]
    )
    fleet = _resource(
        "RolloutFleet",
        "j-rollout",
        inline["RolloutFleet"]["spec"],
        inline["RolloutFleet"]["metadata"]["labels"],
    )
    pool_objs = {o["kind"]: o for o in build_for(pool)}
    sandbox_np = pool_objs["NetworkPolicy"]
    assert _allowed(sandbox_np, trainer_labels, "ns", 8080)
    assert _allowed(sandbox_np, {"whatever": "x"}, "monitoring", 8080)
    for labels, ns in ((other_job, "ns"), (stranger, "ns"), (trainer_labels, "other-ns")):
        assert not _allowed(sandbox_np, labels, ns, 8080), (labels, ns)
    assert sandbox_np["spec"]["egress"] == []
    fleet_objs = build_for(fleet)
    fleet_np = next(o for o in fleet_objs if o["kind"] == "NetworkPolicy")
    lws = next(o for o in fleet_objs if o["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    port = fleet.spec.engine.port
    assert _allowed(fleet_np, trainer_labels, "ns", port)
    assert _allowed(fleet_np, {}, "monitoring", port)
    assert not _allowed(fleet_np, other_job, "ns", port) and not _allowed(fleet_np, stranger, "ns", port)
    # leader and workers of one engine reach each other on any port (NCCL, --dist-init-addr)
    for tmpl in ("leaderTemplate", "workerTemplate"):
        labels = lws[tmpl]["metadata"]["labels"]
        assert fleet_np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert _allowed(fleet_np, labels, "ns", 20000)
    # a standalone pool: every kuberl trainer of its namespace, still nobody else
    alone = {o["kind"]: o for o in build_for(_resource("SandboxPool", "shared", {}))}["NetworkPolicy"]
    assert _allowed(alone, other_job, "ns", 8080) and not _allowed(alone, stranger, "ns", 8080)
    annotated = _resource("SandboxPool", "p", {})
    annotated.metadata.annotations["kuberl.io/monitoring-namespace"] = "observability"
    np = next(o for o in build_for(annotated) if o["kind"] == "NetworkPolicy")
    assert _allowed(np, {}, "observability", 8080) and not _allowed(np, {}, "monitoring", 8080)


def test_pool_pods_and_trainers_share_the_pools_token_secret() -> None:
    from kuberl.operator.builders import build_for

    job = _resource(
        "AgenticRLJob",
        "j",
        {
            "model": {"base": "m"},
            "data": {"train": "s3://d/t.jsonl"},
            "rollout": {"engine": "local"},
            "sandbox": {"poolRef": "tools"},
        },
    )
    trainer = next(o for o in build_for(job) if o["kind"] == "Job")
    env = {e["name"]: e for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["KUBERL_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"]
    pool = {o["kind"]: o for o in build_for(_resource("SandboxPool", "tools", {}))}
    assert ref == {"name": pool["Secret"]["metadata"]["name"], "key": "token"}
    penv = {e["name"]: e for e in pool["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert penv["KUBERL_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    assert "data" not in pool["Secret"] and "stringData" not in pool["Secret"]  # never in `kuberl render`


async def test_operator_generates_the_token_once_and_keeps_it() -> None:
    import base64

    from tests.test_operator_e2e import API, cluster_and_operator, eventually, pool

    async with cluster_and_operator() as k:
        path = f"/api/v1/namespaces/{NS}/secrets/tools-token"
        await k.create(f"{API}/sandboxpools", pool(replicas=1))
        secret = await eventually(lambda: k.get(path), what="token Secret")
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) >= 40
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "SandboxPool"
        await asyncio.sleep(1.5)  # several resync passes
        again = await k.get(path)
        assert again["data"] == secret["data"]
        assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
        # deleted by hand: a fresh one (env from a Secret is read at pod start: restart the
        # pool and trainer pods to rotate, see operator/isolation.py)
        await k.delete(path)
        fresh = await eventually(
            lambda: _with_other_token(k, path, secret["data"]["token"]), what="a new token Secret"
        )
        assert fresh["data"]["token"] != secret["data"]["token"]


async def _with_other_token(k: Any, path: str, old: str) -> Any:
    got = await k.get(path)
    return got if got and got.get("data", {}).get("token") not in (None, old) else None


# --- item 2: SGLang's /health is slow on purpose ------------------------------------------------------


def test_sglang_probes_outlast_a_health_check_as_slow_as_sglangs(tmp_path: Any) -> None:
    """The stand-in answers /health the way SGLang >= 0.4.10 does (a one-token generation, then a
    once-a-second poll for output): never under a second. The rendered probes wait long enough
    and the server's own health timeout (503) comes before the probe's; a probe with
    Kubernetes' default timeoutSeconds (1) would never pass."""
    import time

    from kuberl.api import parse_resource
    from kuberl.operator.builders import build_for
    from tests.hf_fixtures import make_tiny_hf_model
    from tests.test_cluster_path import Servers

    fleet = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "f", "namespace": "ns"},
            "spec": {"model": {"uri": "m"}},
        }
    )
    c = next(o for o in build_for(fleet) if o["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    probe_timeouts = {p: c[p]["timeoutSeconds"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(c[p]["httpGet"]["path"] == "/health" for p in probe_timeouts)
    assert float(env["SGLANG_HEALTH_CHECK_TIMEOUT"]) < min(probe_timeouts.values())

    servers = Servers(make_tiny_hf_model(tmp_path / "tiny"), 1, tmp_path)
    try:
        url = servers.urls[0] + "/health"

        async def probe(timeout: float) -> tuple[int | None, float]:
            start = time.perf_counter()
            try:
                async with (
                    aiohttp.ClientSession() as s,
                    s.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as rsp,
                ):
                    return rsp.status, time.perf_counter() - start
            except TimeoutError:
                return None, time.perf_counter() - start

        status, took = asyncio.run(probe(min(probe_timeouts.values())))
        assert status == 200 and 1.0 <= took < min(probe_timeouts.values()), (status, took)
        assert asyncio.run(probe(1.0))[0] is None  # Kubernetes' default timeoutSeconds
    finally:
        servers.close()


# --- item 12: API load per resync pass ------------------------------------------------------------


class CountingEmulator(ClusterEmulator):
    """The emulator, recording the path of every read (GET that is not a watch)."""

    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.method == "GET" and raw_request.query.get("watch") != "true":
            self.__dict__.setdefault("reads", []).append(raw_request.path)
        return await super().__call__(raw_request)


def _meta(kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": kind, "metadata": {"name": name, "namespace": NS}}


async def _reads_per_pass(groups: int) -> float:
    """Reads per resync pass once ``groups`` x (pool, fleet, job using both) have settled."""
    import kmock

    from tests.test_operator_e2e import API, Cluster, eventually, running_operator

    async with (
        CountingEmulator(namespaces={NS}) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        k = Cluster(emu, str(srv.url).rstrip("/"), session)
        async with running_operator(k, reconcile_interval=0.4, autoscale_interval=1000):
            for i in range(groups):
                await k.create(
                    f"{API}/sandboxpools", {**_meta("SandboxPool", f"p{i}"), "spec": {"replicas": 1}}
                )
                await k.create(
                    f"{API}/rolloutfleets",
                    {
                        **_meta("RolloutFleet", f"f{i}"),
                        "spec": {"model": {"uri": "m"}, "accelerator": {"profile": "cpu"}},
                    },
                )
                await k.create(
                    f"{API}/agenticrljobs",
                    {
                        **_meta("AgenticRLJob", f"j{i}"),
                        "spec": {
                            "model": {"base": "m"},
                            "data": {"train": "s3://d/t.jsonl"},
                            "rollout": {"fleetRef": f"f{i}"},
                            "sandbox": {"poolRef": f"p{i}"},
                        },
                    },
                )

            async def settled() -> bool:
                for plural in ("sandboxpools", "rolloutfleets", "agenticrljobs"):
                    items = (await k.get(f"{API}/{plural}"))["items"]
                    if len(items) != groups or not all((o.get("status") or {}).get("phase") for o in items):
                        return False
                return True

            await eventually(settled, timeout=30, what="every object reconciled")
            await asyncio.sleep(1.0)  # the passes that first saw the objects are over
            emu.__dict__["reads"] = []
            await asyncio.sleep(4.0)
            reads = list(emu.__dict__["reads"])
    marker = f"{API}/agenticrljobs"  # one LIST of jobs per pass
    passes = reads.count(marker)
    assert passes >= 3, reads
    return len(reads) / passes


async def test_resync_reads_do_not_grow_with_the_number_of_objects() -> None:
    """Issue 14 counted 32 GET/LIST per pass for 3 objects (a GET per child, a LIST per child
    kind per object). With the list cache a pass LISTs each kind once per namespace."""
    three = await _reads_per_pass(1)
    nine = await _reads_per_pass(3)
    assert three <= 16, three
    assert nine <= three + 3, (three, nine)  # was 35 and 104 (one pass may catch a straggler)


# --- item 11: leader election on a Lease ---------------------------------------------------------------


def test_lease_rules() -> None:
    import datetime

    from kuberl.operator.leader import decide, micro_time

    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)

    def lease(holder: str | None, renewed_ago: float, duration: int = 15) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "leaseDurationSeconds": duration,
            "renewTime": micro_time(now - datetime.timedelta(seconds=renewed_ago)),
        }
        if holder:
            spec["holderIdentity"] = holder
        return {"metadata": {"resourceVersion": "1"}, "spec": spec}

    assert decide(None, "a", now) == "create"
    assert decide(lease("a", 100), "a", now) == "renew"
    assert decide(lease("b", 5), "a", now) == "wait"
    assert decide(lease("b", 15), "a", now) == "take"  # expired
    assert decide(lease(None, 1), "a", now) == "take"  # released


async def test_only_the_lease_holder_runs_and_a_standby_takes_over() -> None:
    """Two replicas (each in its own thread and event loop, as two pods would be): only the
    leader reconciles; a standby is alive (/livez 200) but not ready (kopf does not run there);
    when the leader stops it releases the Lease and the standby takes over at once, without
    waiting for the 30 s lease to expire."""
    import threading

    from kuberl.operator.leader import ElectionConfig
    from kuberl.operator.main import operate_elected
    from tests.test_operator_e2e import API, eventually, pool

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    async with emulated_cluster() as k:
        login = lambda **_: kopf.ConnectionInfo(server=k.url, default_namespace=NS)  # noqa: E731
        runs: dict[str, dict[str, Any]] = {}
        for who in ("a", "b"):
            run: dict[str, Any] = {"stop": threading.Event(), "ready": threading.Event(), "live": free_port()}
            election = ElectionConfig(NS, "kuberl-operator", who, duration=30, renew=0.3, retry=0.2)
            cfg = OperatorConfig(reconcile_interval=0.3, autoscale_interval=0.3, login=login)

            def main(
                run: dict[str, Any] = run, cfg: OperatorConfig = cfg, election: ElectionConfig = election
            ) -> None:
                run["rc"] = asyncio.run(
                    operate_elected(
                        cfg,
                        election,
                        stop_flag=run["stop"],
                        ready_flag=run["ready"],
                        live_port=run["live"],
                        namespaces=[NS],
                        fast=True,
                    )
                )

            run["thread"] = threading.Thread(target=main, daemon=True)
            run["thread"].start()
            runs[who] = run
            if who == "a":
                await asyncio.to_thread(run["ready"].wait, 15)
        try:
            lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/kuberl-operator"
            assert (await k.get(lease_path))["spec"]["holderIdentity"] == "a"
            await k.create(f"{API}/sandboxpools", pool("first", replicas=1))
            await eventually(
                lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/first"), what="a reconciles"
            )
            await asyncio.sleep(1.0)
            assert not runs["b"]["ready"].is_set()  # b waits: kopf does not run there
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"http://127.0.0.1:{runs['b']['live']}/livez") as rsp,
            ):
                assert rsp.status == 200 and (await rsp.json())["role"] == "standby"
            runs["a"]["stop"].set()
            await asyncio.to_thread(runs["a"]["thread"].join, 20)
            assert runs["a"].get("rc") == 0
            assert await asyncio.to_thread(runs["b"]["ready"].wait, 10)
            lease = await k.get(lease_path)
            assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
            await k.create(f"{API}/sandboxpools", pool("second", replicas=1))
            await eventually(
                lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/second"), what="b reconciles"
            )
        finally:
            for run in runs.values():
                run["stop"].set()
            for run in runs.values():
                await asyncio.to_thread(run["thread"].join, 20)


async def test_a_leader_that_loses_its_lease_stops() -> None:
    """Someone else took the Lease (this leader could not renew in time, e.g. a partition):
    it must stop leading rather than run beside the new leader."""
    from kuberl.operator.kube import KubeClient
    from kuberl.operator.leader import LEASE, ElectionConfig, LeaderElector

    async with emulated_cluster() as k:
        client = KubeClient(kopf.ConnectionInfo(server=k.url))
        try:
            a = LeaderElector(client, ElectionConfig(NS, "l", "a", duration=30, renew=0.1, retry=0.1))
            await a.acquire()
            assert a.leading
            lease = await client.get(LEASE, NS, "l", fresh=True)
            await client.patch(LEASE, NS, "l", {"spec": {"holderIdentity": "b"}})
            await asyncio.wait_for(a.hold(), 5)
            assert a.lost.is_set() and not a.leading
            assert lease["spec"]["holderIdentity"] == "a"
        finally:
            await client.close()


# --- item 8: RBAC as a real API server enforces it -------------------------------------------------

# Granted, and used by code paths this scenario does not reach (each names the path).
GRANTED_NOT_EXERCISED = {
    # held only so the operator may grant them to trainers (RBAC forbids granting what one lacks)
    ("get", "discovery.k8s.io", "endpointslices"),
    ("list", "discovery.k8s.io", "endpointslices"),
    ("watch", "discovery.k8s.io", "endpointslices"),
    # admission's reference checks read fleets and pools fresh (admission is off here)
    ("get", "kuberl.io", "rolloutfleets"),
    ("get", "kuberl.io", "sandboxpools"),
    # the fleet autoscaler writes the scale subresource as the pool one does (autoscale_object)
    ("patch", "kuberl.io", "rolloutfleets/scale"),
    # kopf watches CRDs where the cluster serves apiextensions.k8s.io; the emulator does not
    ("list", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions"),
    # pruning a child kind the spec no longer builds (handlers._prune): only LeaderWorkerSets
    # and the trainer Job are reachable from a spec change; the others from children an older
    # operator version created
    ("delete", "", "services"),
    ("delete", "", "configmaps"),
    ("delete", "", "secrets"),
    ("delete", "", "serviceaccounts"),
    ("delete", "rbac.authorization.k8s.io", "roles"),
    ("delete", "rbac.authorization.k8s.io", "rolebindings"),
    ("delete", "networking.k8s.io", "networkpolicies"),
    ("delete", "apps", "deployments"),
}
TAMPERED = {"metadata": {"labels": {"app.kubernetes.io/component": "tampered"}}}


async def _restored(k: Any, path: str) -> bool:
    obj = await k.get(path)
    return bool(obj) and obj["metadata"]["labels"].get("app.kubernetes.io/component") != "tampered"


async def test_operator_needs_exactly_the_charts_rbac() -> None:
    """Every request the operator (kopf and its own client) sends through a lifecycle of all
    three kinds is authorized by the chart's rules, including the owner-reference permission
    check a real API server runs on children with blockOwnerDeletion (update on the owner's
    finalizers: missing before, so every child creation was refused there); and every granted
    permission is used (or listed above with the code path that uses it)."""
    import kmock

    from kuberl.operator.rbac import operator_rbac_rules
    from kuberl.operator.testing import RbacEmulator
    from tests.test_operator_e2e import (
        API,
        Cluster,
        add_ready_pod,
        eventually,
        job,
        metrics_server,
        pool,
        running_operator,
    )

    rules = operator_rbac_rules()
    load = {"queue": 0.0}

    def exporter() -> str:
        return f'kuberl_sandbox_queue_depth{{pool="auto"}} {load["queue"]}\nkuberl_sandbox_workers_busy{{pool="auto"}} 0\n'

    async with (
        metrics_server(exporter) as port,
        RbacEmulator(namespaces={NS}, rules=rules) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as session,
    ):
        k = Cluster(emu, str(srv.url).rstrip("/"), session)
        async with running_operator(k, autoscale_interval=0.3):
            # a pool the operator autoscales (scale subresource)
            auto = {
                "minReplicas": 1,
                "maxReplicas": 3,
                "targetQueuePerWorker": 1,
                "scaleDownStabilizationSeconds": 0,
            }
            await k.create(f"{API}/sandboxpools", pool("auto", replicas=1, workersPerPod=2, autoscaling=auto))
            dep = await eventually(
                lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/auto"), what="pool"
            )
            await add_ready_pod(k, "auto-0", dep["spec"]["selector"]["matchLabels"], port)
            load["queue"] = 8.0

            async def scaled() -> bool:
                return (await k.get(f"{API}/sandboxpools/auto"))["spec"]["replicas"] > 1

            await eventually(scaled, what="autoscaled pool")
            # a fleet whose engines span nodes, then fit one: the LeaderWorkerSet is pruned
            big = {"model": {"uri": "m"}, "engine": {"tensorParallel": 16}, "accelerator": {"count": 8}}
            await k.create(f"{API}/rolloutfleets", {**_meta("RolloutFleet", "big"), "spec": big})
            lws = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/big"
            await eventually(lambda: k.get(lws), what="LeaderWorkerSet")
            # drift repair patches hand-edited children back, one of each kind
            drifted = [
                lws,
                f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/auto-deny-egress",
                f"/api/v1/namespaces/{NS}/secrets/auto-token",
            ]
            for path in drifted:
                await k.patch(path, TAMPERED)
            for path in drifted:
                await eventually(lambda path=path: _restored(k, path), what=f"{path} patched back")
            await k.patch(f"{API}/rolloutfleets/big", {"spec": {"engine": {"tensorParallel": 8}}})
            await eventually(lambda: _gone(k, lws), what="LeaderWorkerSet pruned")
            # a job on references, and a job with inline children that is changed and finishes
            await k.create(
                f"{API}/agenticrljobs", job("refs", rollout={"fleetRef": "big"}, sandbox={"poolRef": "auto"})
            )
            sa = f"/api/v1/namespaces/{NS}/serviceaccounts/refs-trainer"
            await eventually(lambda: k.get(sa), what="trainer identity")
            drifted = [
                sa,
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/refs-trainer",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/refs-trainer",
            ]
            for path in drifted:
                await k.patch(path, TAMPERED)
            for path in drifted:
                await eventually(lambda path=path: _restored(k, path), what=f"{path} patched back")
            inline = {"rollout": {"fleet": {"replicas": 1}}, "sandbox": {"pool": {"replicas": 1}}}
            await k.create(f"{API}/agenticrljobs", job("inline", **inline))
            trainer = f"/apis/batch/v1/namespaces/{NS}/jobs/inline-trainer"
            first = await eventually(lambda: k.get(trainer), what="trainer")
            await k.patch(f"{API}/agenticrljobs/inline", {"spec": {"seed": 7}})

            async def replaced() -> Any:
                now = await k.get(trainer)
                return now if now and now["metadata"]["uid"] != first["metadata"]["uid"] else None

            await eventually(replaced, what="trainer replaced")
            done = {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            await k.patch(
                f"{trainer}/status", {"status": {"conditions": [done], "succeeded": 2, "active": 0}}
            )
            await eventually(
                lambda: _gone(k, f"{API}/rolloutfleets/inline-rollout"), what="inline fleet released"
            )
            await k.delete(f"{API}/agenticrljobs/refs")
            await asyncio.sleep(1.0)
    assert emu.denied == [], emu.denied
    granted = {
        (v, g, r)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert emu.used <= granted  # (denied would say so too)
    unused = granted - emu.used - GRANTED_NOT_EXERCISED
    assert unused == set(), sorted(unused)
    assert not (GRANTED_NOT_EXERCISED & emu.used), sorted(
        GRANTED_NOT_EXERCISED & emu.used
    )  # keep the list honest
    assert ("update", "kuberl.io", "agenticrljobs/finalizers") in emu.used


async def _gone(k: Any, path: str) -> bool:
    return await k.get(path) is None
