"""The emulator's kubelet: a workload is Ready only once its probes would pass.

A real kubelet calls each HTTP probe and gives up after ``timeoutSeconds`` (default 1 s);
SGLang's /health takes over a second (a one-token generation, polled once a second). The
emulator answers probes with those latencies, so a fleet rendered with Kubernetes' default
probe timeout would never become Ready here either (issue 14, item 2 and "What to build").
"""

from __future__ import annotations

import copy

import pytest
from kube_emulator import SGLANG_HEALTH_SECONDS, ClusterEmulator, endpoint_seconds
from test_operator_e2e import NS, emulated_cluster

from kuberl.api import RolloutFleet
from kuberl.operator.render.builders import build_for


def _fleet_deployment(engine: str = "sglang") -> dict:
    fleet = RolloutFleet.model_validate(
        {"metadata": {"name": "fleet", "namespace": NS}, "spec": {"model": {"uri": "Qwen/Qwen2.5-0.5B-Instruct"}, "engine": {"type": engine}, "replicas": 2}}
    )
    return next(o for o in build_for(fleet, NS) if o["kind"] == "Deployment")


def _without_probe_timeouts(dep: dict) -> dict:
    dep = copy.deepcopy(dep)
    for c in dep["spec"]["template"]["spec"]["containers"]:
        for kind in ("readinessProbe", "startupProbe", "livenessProbe"):
            (c.get(kind) or {}).pop("timeoutSeconds", None)
    return dep


def test_sglang_health_is_slower_than_the_default_probe_timeout():
    sglang = _fleet_deployment("sglang")["spec"]["template"]["spec"]["containers"][0]
    vllm = _fleet_deployment("vllm")["spec"]["template"]["spec"]["containers"][0]
    assert endpoint_seconds(sglang, "/health") == SGLANG_HEALTH_SECONDS > 1
    assert endpoint_seconds(vllm, "/health") < 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_rendered_fleets_become_ready_and_default_timeouts_would_not(engine):
    emu = ClusterEmulator(namespaces={NS})
    dep = _fleet_deployment(engine)
    assert emu._probes_fail(dep) is None  # noqa: SLF001 - the kubelet stand-in itself
    st = copy.deepcopy(dep)
    emu._controller(st)  # noqa: SLF001
    assert st["status"]["readyReplicas"] == 2
    bare = _without_probe_timeouts(dep)
    emu._controller(bare)  # noqa: SLF001
    if engine == "sglang":
        assert bare["status"]["readyReplicas"] == 0
        (cond,) = [c for c in bare["status"]["conditions"] if c["type"] == "Available"]
        assert cond["status"] == "False" and "timeoutSeconds is 1" in cond["message"], cond
    else:  # vLLM's /health answers fast: the default would do
        assert bare["status"]["readyReplicas"] == 2


async def test_a_deployment_written_to_the_emulator_is_ready_only_when_its_probes_pass():
    async with emulated_cluster() as k:
        for name, dep, ready in (
            ("good", _fleet_deployment("sglang"), 2),
            ("bare", _without_probe_timeouts(_fleet_deployment("sglang")), 0),
        ):
            dep["metadata"]["name"] = name
            url = f"{k.url}/apis/apps/v1/namespaces/{NS}/deployments"
            async with k.session.post(url, json=dep) as rsp:
                assert rsp.status in (200, 201), await rsp.text()
            async with k.session.get(f"{url}/{name}") as rsp:
                got = await rsp.json()
            assert got["status"]["readyReplicas"] == ready, got["status"]
