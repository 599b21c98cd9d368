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
from kuberl.operator.handlers import OperatorConfig, OperatorContext, stale_loops
from kuberl.operator.main import operate
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
