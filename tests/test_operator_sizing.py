"""Issue 14 item 5: engine and trainer pods say what they use (cpu, memory including /dev/shm,
a bounded /models cache), so they are not BestEffort and a namespace quota admits them."""

from __future__ import annotations

from typing import Any

import builders
import pytest

from kuberl.api import parse_resource
from kuberl.api.common import quantity_value
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.apirules import children_problems
from tests.test_operator_e2e import API, NS, _status, emulated_cluster, eventually, job, running_operator


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in pod["volumes"] if v["name"] == name)


@pytest.mark.parametrize(
    "resource",
    [
        parse_resource(
            builders.fleet_manifest("gen", NS, accelerator={"profile": "mi300x", "count": 8}, engine={"tensorParallel": 8})
        ),
        parse_resource(builders.fleet_manifest("gen", NS, accelerator={"profile": "h100", "count": 1})),
        parse_resource(builders.fleet_manifest("gen", NS, accelerator={"profile": "cpu", "count": 2})),
        parse_resource(job("train")),
    ],
    ids=["mi300x-8", "h100-1", "cpu", "trainer"],
)
def test_pods_request_cpu_and_memory_that_covers_their_shm(resource: Any) -> None:
    objs = build_for(resource, NS)
    workload = next(o for o in objs if o["kind"] in ("Deployment", "Job"))
    pod = _pod(workload)
    res = pod["containers"][0]["resources"]
    gpu = resource.KIND == "AgenticRLJob" or resource.spec.accelerator.profile != "cpu"
    assert {"cpu", "memory"} <= set(res["requests"])
    shm = quantity_value(_volume(pod, "dshm")["emptyDir"]["sizeLimit"])
    assert shm < quantity_value(res["requests"]["memory"]) / 2 + 1
    cache = _volume(pod, "model-cache")["emptyDir"]
    assert cache["sizeLimit"] == "100Gi"
    if gpu:
        assert res["limits"]["memory"] == res["requests"]["memory"]
        assert res["requests"]["ephemeral-storage"] == "100Gi"
    else:
        assert "memory" not in res.get("limits", {}) and "ephemeral-storage" not in res["requests"]
    assert children_problems(objs) == []


def test_a_memory_limit_bounds_shm_and_user_values_win() -> None:
    fleet = parse_resource(
        builders.fleet_manifest(
            "gen",
            NS,
            accelerator={"profile": "mi300x", "count": 8},
            engine={"tensorParallel": 8},
            resources={"requests": {"cpu": "32"}, "limits": {"memory": "48Gi"}},
            modelCacheSize="400Gi",
        )
    )
    pod = _pod(build_for(fleet)[0])
    res = pod["containers"][0]["resources"]
    assert res["requests"]["cpu"] == "32" and res["limits"]["memory"] == "48Gi"
    assert "memory" not in res["requests"]  # the API server takes the limit
    assert _volume(pod, "dshm")["emptyDir"]["sizeLimit"] == "24Gi"
    assert _volume(pod, "model-cache")["emptyDir"]["sizeLimit"] == "400Gi"


async def test_namespace_with_a_cpu_memory_quota_admits_the_engines() -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "team", "namespace": NS},
        "spec": {"hard": {"requests.cpu": "64", "requests.memory": "512Gi", "limits.memory": "512Gi"}},
    }
    async with emulated_cluster() as k, running_operator(k):
        await k.create(f"/api/v1/namespaces/{NS}/resourcequotas", quota)
        fleet = {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "gen", "namespace": NS},
            "spec": {"model": {"uri": "m"}, "replicas": 2, "accelerator": {"profile": "h100", "count": 1}},
        }
        await k.create(f"{API}/rolloutfleets", fleet)

        async def ready() -> Any:
            st = await _status(k, f"{API}/rolloutfleets/gen")
            return st if st.get("phase") == "Ready" else None

        await eventually(ready, what="fleet Ready under the quota")


def test_mi300x_pods_only_go_to_mi300x_nodes() -> None:
    """Issue 14 item 6: the default images are MI30x-only, so "any AMD GPU" is not enough."""
    fleet = parse_resource(builders.fleet_manifest("gen", NS, accelerator={"profile": "mi300x", "count": 1}))
    pod = _pod(build_for(fleet)[0])
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        (expr,) = term["matchExpressions"]
        assert expr["operator"] == "In" and expr["values"] != ["true"], expr
        assert all("MI300X" in v or v in ("74a1", "74b5") for v in expr["values"]), expr


def test_tensor_parallel_across_one_gpu_pods_is_refused() -> None:
    from kuberl.api import ManifestError

    with pytest.raises(ManifestError, match="must use whole nodes: set accelerator.count: 8"):
        parse_resource(builders.fleet_manifest("gen", NS, engine={"tensorParallel": 8}))
    whole_nodes = builders.fleet_manifest("gen", NS, engine={"tensorParallel": 8}, accelerator={"count": 8})
    assert parse_resource(whole_nodes).spec.nodes_per_engine == 1
