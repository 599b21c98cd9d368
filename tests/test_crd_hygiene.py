"""Issue 14 item 13: what a cluster admin notices in the CRDs and rendered objects."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl.api import SandboxPool
from kuberl.api.crdgen import all_crds, render
from kuberl.cli import main
from kuberl.operator.decide.status import scaled_status
from tests.apiserver_emulation import admission_errors
from tests.test_operator_e2e import API, NS, cluster_and_operator, eventually

CRDS = list(all_crds().values())


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("crd", CRDS, ids=lambda c: c["spec"]["names"]["kind"])
def test_status_conditions_are_a_list_map_and_timestamps_are_date_times(crd: dict[str, Any]) -> None:
    conds = _schema(crd)["properties"]["status"]["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map" and conds["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conds["items"]["required"]
    assert conds["items"]["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert "&id0" not in render(crd) and "*id0" not in render(crd)


def test_quantities_carry_the_kubernetes_pattern() -> None:
    pool = next(c for c in CRDS if c["spec"]["names"]["kind"] == "SandboxPool")
    memory = _schema(pool)["properties"]["spec"]["properties"]["resources"]["properties"]["limits"]
    assert memory["additionalProperties"]["x-kubernetes-int-or-string"] is True
    assert "pattern" in memory["additionalProperties"]


def test_render_has_no_yaml_anchors(capsys: Any) -> None:
    assert main(["render", "examples/rstar2-mi300x.yaml"]) == 0
    out = capsys.readouterr().out
    assert "&id0" not in out and "*id0" not in out


AUTOSCALED_WITHOUT_REPLICAS = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "SandboxPool",
    "metadata": {"name": "tools", "namespace": NS},
    "spec": {"autoscaling": {"minReplicas": 4, "maxReplicas": 8}},
}


def test_replicas_default_to_min_replicas_for_kubectl_and_kuberl() -> None:
    assert admission_errors(CRDS, AUTOSCALED_WITHOUT_REPLICAS) == []
    assert SandboxPool.model_validate(AUTOSCALED_WITHOUT_REPLICAS).spec.replicas == 4
    plain = {**AUTOSCALED_WITHOUT_REPLICAS, "spec": {}}
    assert SandboxPool.model_validate(plain).spec.replicas == 1


async def test_operator_writes_the_defaulted_replicas_for_the_scale_subresource() -> None:
    async with cluster_and_operator() as k:
        await k.create(f"{API}/sandboxpools", AUTOSCALED_WITHOUT_REPLICAS)

        async def replicas() -> Any:
            obj = await k.get(f"{API}/sandboxpools/tools")
            return obj["spec"].get("replicas")

        assert await eventually(replicas, what="spec.replicas written") == 4
        scale = await k.get(f"{API}/sandboxpools/tools/scale")
        assert scale["spec"]["replicas"] == 4
        dep = await eventually(lambda: k.get(f"/apis/apps/v1/namespaces/{NS}/deployments/tools"), what="pods")
        assert dep["spec"]["replicas"] == 4


def test_ready_waits_for_the_workload_to_observe_its_generation() -> None:
    old = {
        "kind": "Deployment",
        "metadata": {"name": "tools", "generation": 3},
        "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2},
    }
    st = scaled_status(desired=2, workload=old, selector="", generation=5, previous={}, noun="sandbox")
    assert st["phase"] == "Progressing" and st["conditions"][0]["reason"] == "RolloutPending"
    old["status"]["observedGeneration"] = 3
    st = scaled_status(desired=2, workload=old, selector="", generation=5, previous={}, noun="sandbox")
    assert st["phase"] == "Ready"


def test_engines_and_sandboxes_have_disruption_budgets_and_spread_over_nodes() -> None:
    from kuberl.api import parse_resource
    from kuberl.operator.render.builders import build_for

    fleet = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "big"},
            "spec": {"model": {"uri": "m"}, "engine": {"tensorParallel": 16}, "accelerator": {"count": 8}},
        }
    )
    objs = {o["kind"]: o for o in build_for(fleet)}
    assert objs["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 2  # one 2-node engine group
    leader = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    assert leader["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    pool = parse_resource({"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": "t"}, "spec": {}})
    objs = {o["kind"]: o for o in build_for(pool)}
    sel = objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert objs["PodDisruptionBudget"]["spec"] == {"maxUnavailable": "25%", "selector": {"matchLabels": sel}}
    spread = objs["Deployment"]["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"


def test_engines_using_part_of_a_gpu_node_are_packed_whole_node_ones_spread() -> None:
    """Eight 1-GPU engines spread one per node would leave no node with the 8 GPUs a trainer rank
    asks for (seen on the real scheduler: tests/test_k8s_operator.py, rstar2-mi300x)."""
    from kuberl.api import parse_resource
    from kuberl.operator.render.builders import build_for

    def pod(count: int, profile: str = "mi300x") -> dict:
        fleet = parse_resource({"apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": "f"},
                                "spec": {"model": {"uri": "m"}, "accelerator": {"profile": profile, "count": count}}})
        return next(o for o in build_for(fleet) if o["kind"] == "Deployment")["spec"]["template"]["spec"]

    packed = pod(1)
    term = packed["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "f"
    assert "nodeAffinity" in packed["affinity"] and "topologySpreadConstraints" not in packed
    for whole in (pod(8), pod(1, "cpu")):
        assert "podAffinity" not in whole.get("affinity", {})
        assert whole["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
