"""Issue 14 (part B), items 9 and 2: who can reach a pool's sandboxes and a fleet's engines
(NetworkPolicies, the pool's bearer token), and the SGLang probes against a stand-in whose
/health is as slow as SGLang's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.test_operator_e2e import NS

pytestmark = pytest.mark.timeout(120)


# --- item 9: who can run code in a sandbox, who can reach an engine --------------------------------


def test_sandbox_service_needs_the_pools_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real service started as a SandboxPool pod starts it (token in KUBERL_SANDBOX_TOKEN):
    code runs only for a client with the token; probes and /metrics stay open."""
    import urllib.error
    import urllib.request

    from kuberl.sandbox.service.client import SandboxClient, SandboxError
    from kuberl.sandbox.service.local import running_sandbox

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
    from kuberl.operator.render.builders import build_for

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
    from kuberl.operator.render.builders import build_for

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
        # pool and trainer pods to rotate, see operator/render/isolation.py)
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
    from kuberl.operator.render.builders import build_for
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
