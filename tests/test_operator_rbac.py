"""Issue 14 (part B), item 8: the operator against an emulator that enforces RBAC and the
owner-reference permission check, with the chart's rules.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.test_operator_cluster import _meta
from tests.test_operator_e2e import NS

pytestmark = pytest.mark.timeout(120)


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
    ("delete", "policy", "poddisruptionbudgets"),
    # the Job controller's FailedCreate events are listed only while a trainer Job is short of
    # pods (a quota, Pod Security); tests/test_k8s_operator.py reaches it on the real server
    ("list", "", "events"),
    # apply patches a job's checkpoint claim only when its desired form changes (a larger
    # checkpoint.volumeSize); the lifecycle here never resizes it
    ("patch", "", "persistentvolumeclaims"),
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
    from kube_emulator import RbacEmulator

    from kuberl.operator.render.rbac import operator_rbac_rules
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
