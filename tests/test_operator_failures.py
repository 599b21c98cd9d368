"""Issue 14 item 1: a child the API server refuses is visible on its owner, and what can be known
from the manifest alone is refused by `kuberl validate` and the operator's pre-flight.

The emulator (``ClusterEmulator``) answers as a real API server for these cases: 422 for names,
labels and quantities its Go validation refuses, 404 for a kind whose CRD is not installed, and
a Deployment that a ResourceQuota keeps from creating pods reports ``ReplicaFailure``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import builders
import pytest
import yaml

from kuberl.api import AgenticRLJob, parse_resource
from kuberl.cli import main
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.apirules import children_problems, object_problems
from kuberl.operator.validate.checks import rendered_problems
from tests.test_operator_e2e import (
    API,
    NS,
    _status,
    cluster_and_operator,
    emulated_cluster,
    eventually,
    pool,
    running_operator,
)

pytestmark = pytest.mark.timeout(60)


def _svc(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": {}}


def _deploy(resources: dict[str, Any], name: str = "d") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "template": {"spec": {"containers": [{"name": "c", "image": "i", "resources": resources}]}}
        },
    }


def _pod_with(pod: dict[str, Any] | None = None, image: str = "i", **container: Any) -> dict[str, Any]:
    dep = _deploy({})
    spec = dep["spec"]["template"]["spec"]
    spec.update(pod or {})
    spec["containers"][0].update(container, image=image)
    return dep


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        (_svc("7b-fleet"), "not an RFC 1035 label"),
        (_svc("a" * 64), "no more than 63 characters"),
        (_deploy({"requests": {"memory": "lots"}}), "'lots' is not a quantity"),
        (_deploy({"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}), "less than or equal"),
        (_deploy({"requests": {"amd.com/gpu": "1"}, "limits": {"amd.com/gpu": "2"}}), "must be equal"),
        (_deploy({"requests": {"gpu": "1"}}), "not a standard resource"),
        (_deploy({}, name="Bad_Name"), "not a DNS subdomain"),
        (_pod_with(env=[{"name": "A=B", "value": "1"}]), "environment variable name"),
        (_pod_with(ports=[{"name": "prometheus-metrics", "containerPort": 9090}]), "IANA service name"),
        (_pod_with(ports=[{"containerPort": 70000}]), "between 1 and 65535"),
        (_pod_with(image="ghcr.io/x:1 "), "trailing whitespace"),
        (_pod_with(pod={"tolerations": [{"key": "gpu", "operator": "In"}]}), "must be Exists or Equal"),
        (_pod_with(pod={"nodeSelector": {"pool": "mi300x gpu"}}), "label value 'mi300x gpu'"),
        (_pod_with(pod={"priorityClassName": "High"}), "priorityClassName: 'High' is not a DNS subdomain"),
        (
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "c"},
                "spec": {"resources": {"requests": {"storage": "100GB!"}}, "storageClassName": "Fast_SSD"},
            },
            "storage: '100GB!' is not a quantity",
        ),
        (
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "j" * 60},
                "spec": {
                    "completionMode": "Indexed",
                    "completions": 1000,
                    "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}},
                },
            },
            "hostnames <job>-<index> pass 63",
        ),
    ],
)
def test_api_server_rules_refuse_what_a_real_server_refuses(obj: dict[str, Any], fragment: str) -> None:
    problems = object_problems(obj)
    assert any(fragment in p for p in problems), problems


def test_what_kuberl_renders_passes_the_api_server_rules() -> None:
    job = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "AgenticRLJob",
            "metadata": {"name": "train"},
            "spec": {
                "model": {"base": "m"},
                "data": {"train": "builtin:arith"},
                "rollout": {
                    "fleet": {"replicas": 2, "engine": {"tensorParallel": 16}, "accelerator": {"count": 8}}
                },
                "sandbox": {"pool": {}},
            },
        }
    )
    assert rendered_problems(job) == []
    assert children_problems(build_for(job)) == []


def _multi_node_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"base": "m"},
            "data": {"train": "builtin:arith"},
            "rollout": {"fleet": {"engine": {"tensorParallel": 16}, "accelerator": {"count": 8}}},
        },
    }


LONG = "qwen3-14b-rstar2-agent-grpo-roc-math-stage-two"  # 46: fine alone, too long for its LWS


def test_validate_renders_children_and_refuses_names_they_derive(tmp_path: Any, capsys: Any) -> None:
    """The job's own name fits, but its inline fleet's LeaderWorkerSet groups (StatefulSets
    ``<job>-rollout-<group>``) pass the 52 characters a StatefulSet name may have."""
    job = AgenticRLJob.model_validate(_multi_node_job(LONG))
    problems = rendered_problems(job)
    assert any(f"LeaderWorkerSet/{LONG}-rollout" in p and "shorten the name" in p for p in problems), problems
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_multi_node_job(LONG)))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"LeaderWorkerSet/{LONG}-rollout" in err


async def test_emulator_refuses_what_the_api_server_refuses() -> None:
    async with emulated_cluster() as k:
        async with k.session.post(f"{k.url}/api/v1/namespaces/{NS}/services", json=_svc("7b-fleet")) as rsp:
            body = await rsp.json()
        assert rsp.status == 422 and "RFC 1035" in body["message"]
        # OpenAPI of a built-in kind (strict: unknown fields) and of the CRDs (types, CEL)
        dep = _deploy({}, name="d")
        dep["spec"].update(replica=2, selector={"matchLabels": {"a": "b"}})
        dep["spec"]["template"]["metadata"] = {"labels": {"a": "b"}}
        async with k.session.post(f"{k.url}/apis/apps/v1/namespaces/{NS}/deployments", json=dep) as rsp:
            assert rsp.status == 422 and "replica" in (await rsp.json())["message"]
        bad = pool("tools", replicas="3")
        async with k.session.post(f"{k.url}{API}/sandboxpools", json=bad) as rsp:
            assert rsp.status == 422 and "'3' is not of type 'integer'" in (await rsp.json())["message"]
        # and CRD defaults are stored, as the API server stores them
        created = await k.create(f"{API}/sandboxpools", pool("tools"))
        assert created["spec"]["workersPerPod"] == 2


async def test_operator_preflight_creates_nothing_when_a_child_would_be_refused() -> None:
    async with cluster_and_operator() as k:
        await k.create(f"{API}/agenticrljobs", _multi_node_job(LONG))

        async def invalid() -> Any:
            st = await _status(k, f"{API}/agenticrljobs/{LONG}")
            return st if st.get("phase") == "Invalid" else None

        st = await eventually(invalid, what="job Invalid")
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert f"LeaderWorkerSet/{LONG}-rollout" in ready["message"]
        # Nothing was created: no ConfigMap, no trainer, no fleet holding GPUs.
        assert await k.get(f"/api/v1/namespaces/{NS}/configmaps/{LONG}-config") is None
        assert await k.get(f"{API}/rolloutfleets/{LONG}-rollout") is None
        assert any(e["type"] == "Warning" and "LeaderWorkerSet" in e["message"] for e in await k.events(LONG))


async def test_missing_crd_lands_in_status_conditions_and_one_event() -> None:
    async with emulated_cluster(absent_kinds={"LeaderWorkerSet"}) as k, running_operator(k):
        fleet = builders.fleet_manifest("big", NS, engine={"tensorParallel": 16}, accelerator={"count": 8})
        await k.create(f"{API}/rolloutfleets", fleet)

        async def degraded() -> Any:
            st = await _status(k, f"{API}/rolloutfleets/big")
            return st if st.get("phase") == "Degraded" else None

        st = await eventually(degraded, what="fleet Degraded")
        applied = next(c for c in st["conditions"] if c["type"] == "Applied")
        assert applied["status"] == "False" and applied["reason"] == "KindNotInstalled"
        assert "LeaderWorkerSet/big" in applied["message"] and "CRD installed" in applied["message"]
        # The Service was still applied; the failure is retried at every resync but reported once.
        assert await k.get(f"/api/v1/namespaces/{NS}/services/big") is not None
        await asyncio.sleep(1.5)
        warnings = [e for e in await k.events("big") if e["reason"] == "ChildKindNotInstalled"]
        assert len(warnings) == 1, warnings


async def test_resource_quota_refusal_lands_in_status() -> None:
    async with emulated_cluster() as k, running_operator(k):
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "team", "namespace": NS},
            "spec": {"hard": {"requests.memory": "16Gi"}},
        }
        await k.create(f"/api/v1/namespaces/{NS}/resourcequotas", quota)
        await k.create(f"{API}/sandboxpools", pool("tools", replicas=8))  # 8 x 8Gi requested (the default, a Guaranteed pod): 2 fit 16Gi

        async def refused() -> Any:
            st = await _status(k, f"{API}/sandboxpools/tools")
            return st if st.get("phase") == "Degraded" else None

        st = await eventually(refused, what="pool Degraded by the quota")
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and "exceeded quota: team" in ready["message"]
        assert st["readyReplicas"] == 2


async def test_trainer_pods_refused_by_a_gpu_quota_land_in_status() -> None:
    """A Job has no condition for pods it cannot create: its FailedCreate events say why."""
    from tests.test_operator_e2e import job

    async with emulated_cluster() as k, running_operator(k):
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "gpus", "namespace": NS},
            "spec": {"hard": {"requests.nvidia.com/gpu": "8"}},
        }
        await k.create(f"/api/v1/namespaces/{NS}/resourcequotas", quota)
        await k.create(f"{API}/agenticrljobs", job("big"))  # 2 pods x 8 GPUs

        async def degraded() -> Any:
            st = await _status(k, f"{API}/agenticrljobs/big")
            return st if st.get("phase") == "Degraded" else None

        st = await eventually(degraded, what="job Degraded by the GPU quota")
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "QuotaExceeded"
        assert "Job/big-trainer cannot create its pods" in ready["message"] and "exceeded quota: gpus" in ready["message"]
        applied = next(c for c in st["conditions"] if c["type"] == "Applied")
        assert applied["status"] == "True"  # the Job itself was accepted
        assert any(e["reason"] == "ChildQuotaExceeded" for e in await k.events("big"))


async def test_owner_reference_permission_refusal_is_reported() -> None:
    """Where OwnerReferencesPermissionEnforcement runs (OpenShift), children with
    blockOwnerDeletion need update on <owner>/finalizers; without it every child is refused."""
    from kuberl.operator.render.rbac import operator_rbac_rules

    without = [
        {**r, "resources": [x for x in r["resources"] if not x.endswith("/finalizers")]}
        for r in operator_rbac_rules()
    ]
    async with emulated_cluster(owner_reference_rules=without) as k, running_operator(k):
        await k.create(f"{API}/sandboxpools", pool("tools"))

        async def refused() -> Any:
            st = await _status(k, f"{API}/sandboxpools/tools")
            applied = next((c for c in st.get("conditions") or [] if c["type"] == "Applied"), None)
            return applied if applied and applied["status"] == "False" else None

        applied = await eventually(refused, what="Applied=False")
        assert applied["reason"] == "Forbidden" and "sandboxpools/finalizers" in applied["message"]
    granted = [*without, {"apiGroups": ["kuberl.io"], "resources": ["sandboxpools/finalizers"], "verbs": ["update"]}]
    async with emulated_cluster(owner_reference_rules=granted) as k, running_operator(k):
        await k.create(f"{API}/sandboxpools", pool("tools"))

        async def ready() -> bool:
            return (await _status(k, f"{API}/sandboxpools/tools")).get("phase") == "Ready"

        await eventually(ready, what="pool Ready with the finalizers permission")


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"name": "tools", "namespace": "Team_A"}, "metadata.namespace: must be a lowercase RFC 1123 label"),
        ({"name": "tools", "labels": {"team": "rl team"}}, "label team='rl team'"),
        ({"name": "tools", "labels": {"-bad": "x"}}, "label key '-bad'"),
        ({"name": "tools", "annotations": {"not a key": "x"}}, "not qualified names"),
    ],
)
def test_the_resources_own_metadata_is_checked_as_the_api_server_would(meta: dict[str, Any], fragment: str) -> None:
    from kuberl.api import ManifestError

    with pytest.raises(ManifestError, match=re.escape(fragment)):
        parse_resource({"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": meta})


def test_extended_resources_are_whole_numbers() -> None:
    problems = object_problems(_deploy({"requests": {"nvidia.com/gpu": "0.5"}, "limits": {"nvidia.com/gpu": "0.5"}}))
    assert any("whole number" in p for p in problems), problems
