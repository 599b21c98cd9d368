"""How the operator applies children: the API server's stored form, and the three-way merge.

Pure functions first (quantity canonicalization, ``three_way_patch``), then the same rules
against the emulator over HTTP: what a cluster stores, and that a second apply is a no-op.
"""

from __future__ import annotations

import json

import aiohttp
import kmock
import kopf
import pytest
from kube_emulator import ClusterEmulator, merge_patch

from kuberl.operator.runtime.kube import (
    LAST_APPLIED,
    KubeClient,
    kind_of,
    last_applied,
    needs_patch,
    three_way_patch,
    with_last_applied,
)
from kuberl.operator.validate.canonical import canonical_quantity, parse_quantity, server_form


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        # resource.Quantity.String() of k8s.io/apimachinery for these inputs
        ("0.5", "500m"),
        ("1.5", "1500m"),
        ("2000m", "2"),
        ("1000", "1k"),
        ("1500", "1500"),
        ("1500000k", "1500M"),
        (4, "4"),
        ("100m", "100m"),
        ("0", "0"),
        ("-1.5", "-1500m"),
        ("0.0000000001", "1n"),  # below nano precision: rounded up
        ("1024Mi", "1Gi"),
        ("2048Ki", "2Mi"),
        ("100Mi", "100Mi"),
        ("1.5Gi", "1536Mi"),
        ("0.5Gi", "512Mi"),
        ("1023Ki", "1023Ki"),
        ("512", "512"),
        ("1E", "1E"),  # exa, not an exponent
        ("1e3", "1e3"),  # exponent notation keeps its format
        ("12e-3", "12e-3"),
    ],
)
def test_canonical_quantities(given, stored) -> None:
    assert canonical_quantity(given) == stored
    assert canonical_quantity(stored) == stored  # idempotent: what the server returns is stable


def test_quantity_syntax_errors_are_clear() -> None:
    for bad in ("1.2.3", "ten", "1Kb", "", "1 Gi"):
        with pytest.raises(ValueError, match="Kubernetes quantity syntax"):
            parse_quantity(bad)


def test_server_form_only_touches_quantity_positions_and_empty_lists() -> None:
    pod = {
        "containers": [
            {"name": "c", "args": [], "resources": {"limits": {"cpu": "0.5", "memory": "1024Mi"}}}
        ],
        "volumes": [{"name": "t", "emptyDir": {"sizeLimit": "1024Mi"}}, {"name": "e", "emptyDir": {}}],
        "overhead": {"cpu": "0.25"},
    }
    assert server_form(pod) == {
        "containers": [{"name": "c", "resources": {"limits": {"cpu": "500m", "memory": "1Gi"}}}],
        "volumes": [{"name": "t", "emptyDir": {"sizeLimit": "1Gi"}}, {"name": "e", "emptyDir": {}}],
        "overhead": {"cpu": "250m"},
    }
    # A SandboxPool's spec.limits holds plain numbers, and ConfigMap values are strings: untouched.
    assert server_form({"limits": {"memoryMB": 1024}, "data": {"n": "1000"}}) == {
        "limits": {"memoryMB": 1024},
        "data": {"n": "1000"},
    }


def test_three_way_patch_prunes_only_what_kuberl_set_before() -> None:
    last = {"spec": {"affinity": {"x": 1}, "tolerations": [{"key": "gpu"}], "image": "a"}}
    live = {
        "spec": {
            "affinity": {"x": 1},
            "tolerations": [{"key": "gpu"}],
            "image": "a",
            "schedulerName": "default-scheduler",  # server default: not ours, never pruned
        }
    }
    desired = {"spec": {"image": "b"}}
    patch = three_way_patch(desired, last, live)
    assert patch == {"spec": {"affinity": None, "tolerations": None, "image": "b"}}
    assert merge_patch(live, patch) == {"spec": {"image": "b", "schedulerName": "default-scheduler"}}
    # Without a record (objects from before this operator version) nothing is pruned.
    assert three_way_patch(desired, {}, live) == {"spec": {"image": "b"}}


def test_three_way_patch_resends_a_list_whose_items_lost_keys() -> None:
    gpu = {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    cpu = {"name": "c", "resources": {}}
    live = {"containers": [{**gpu, "terminationMessagePath": "/dev/termination-log"}]}
    # The live list "contains" the new one (live items carry server-added keys too) ...
    assert three_way_patch({"containers": [cpu]}, {}, live) == {}
    # ... so only the record of what was sent before shows that the GPU limit must go.
    assert three_way_patch({"containers": [cpu]}, {"containers": [gpu]}, live) == {"containers": [cpu]}


def test_three_way_patch_compares_in_the_servers_stored_form() -> None:
    desired = {"spec": {"egress": [], "resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}}}}
    live = {"spec": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}}
    assert three_way_patch(desired, desired, live) == {}
    live_with_egress = {**live, "spec": {**live["spec"], "egress": [{"to": []}]}}
    assert three_way_patch(desired, desired, live_with_egress) == {"spec": {"egress": []}}
    assert three_way_patch({"a": {"b": 1}}, {}, {"a": "not a dict"}) == {"a": {"b": 1}}


def test_last_applied_record_round_trip() -> None:
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c"},
        "data": {"k": "v"},
        "status": {},
    }
    out = with_last_applied(obj)
    assert "status" not in out and "annotations" not in obj["metadata"]  # the input is not mutated
    record = last_applied(out)
    assert record == {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    assert last_applied({"metadata": {"annotations": {LAST_APPLIED: "{broken"}}}) == {}
    # Own annotations are recorded (so they can be pruned later), the record itself is not.
    out = with_last_applied({**obj, "metadata": {"name": "c", "annotations": {"a": "1"}}})
    assert last_applied(out)["metadata"]["annotations"] == {"a": "1"}


def test_needs_patch_skips_record_only_rewrites_of_scalars() -> None:
    before = {"spec": {"replicas": 2, "args": ["a"]}}
    record_only = {"metadata": {"annotations": {LAST_APPLIED: "{}"}}}
    assert not needs_patch(record_only, before, {"spec": {"replicas": 5, "args": ["a"]}})
    assert needs_patch(record_only, before, {"spec": {"replicas": 5, "args": ["b"]}})  # a list changed
    assert needs_patch(record_only, before, {"spec": {"args": ["a"]}})  # a key went away
    assert needs_patch({"spec": {"replicas": 5}}, before, before)
    assert not needs_patch({}, before, before)


async def test_emulator_stores_builtin_kinds_like_the_api_server() -> None:
    async with ClusterEmulator() as emu, kmock.Server(emu) as srv, aiohttp.ClientSession(str(srv.url)) as s:
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": []},
        }
        stored = await (
            await s.post("/apis/networking.k8s.io/v1/namespaces/default/networkpolicies", json=policy)
        ).json()
        assert "egress" not in stored["spec"] and stored["spec"]["policyTypes"] == ["Egress"]
        pool = {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "SandboxPool",
            "metadata": {"name": "p"},
            "spec": {"resources": {"requests": {"cpu": "0.5"}}, "extraArgs": []},
        }
        stored = await (
            await s.post("/apis/kuberl.io/v1alpha1/namespaces/default/sandboxpools", json=pool)
        ).json()
        assert stored["spec"] == pool["spec"]  # custom resources are stored as sent
        cm_patch = {"metadata": {"annotations": {"x": "1"}}, "spec": {"egress": []}}
        merged = await (
            await s.patch(
                "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/p",
                json=cm_patch,
                headers={"Content-Type": "application/merge-patch+json"},
            )
        ).json()
        assert "egress" not in merged["spec"] and merged["metadata"]["annotations"] == {"x": "1"}


async def test_apply_is_a_no_op_once_live_holds_the_canonical_form() -> None:
    async with ClusterEmulator() as emu, kmock.Server(emu) as srv:
        client = KubeClient(kopf.ConnectionInfo(server=str(srv.url)))
        try:
            dep = {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "d", "namespace": "default", "labels": {"a": "1", "b": "2"}},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"a": "1"}},
                    "template": {
                        "metadata": {"labels": {"a": "1"}},
                        "spec": {
                            "containers": [
                                {"name": "c", "image": "i", "resources": {"limits": {"cpu": "0.5"}}}
                            ],
                            "tolerations": [{"key": "gpu", "operator": "Exists"}],
                        },
                    },
                },
            }
            action, live = await client.apply(dep)
            assert action == "created"
            assert live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "500m"}
            assert json.loads(live["metadata"]["annotations"][LAST_APPLIED])["metadata"]["labels"] == {
                "a": "1",
                "b": "2",
            }
            action, again = await client.apply(dep)
            assert (
                action == "unchanged"
                and again["metadata"]["resourceVersion"] == live["metadata"]["resourceVersion"]
            )
            # Dropping a label and the tolerations removes them from the live object.
            smaller = json.loads(json.dumps(dep))
            del smaller["metadata"]["labels"]["b"]
            del smaller["spec"]["template"]["spec"]["tolerations"]
            action, pruned = await client.apply(smaller)
            assert action == "updated"
            assert pruned["metadata"]["labels"] == {"a": "1"}
            assert "tolerations" not in pruned["spec"]["template"]["spec"]
            # adjust() sees the live object and may hand a field over to someone else.
            action, _ = await client.apply(
                smaller,
                adjust=lambda d, cur: {**d, "spec": {**d["spec"], "replicas": cur["spec"]["replicas"]}},
            )
            assert action == "unchanged"
            assert (await client.get(kind_of("apps/v1", "Deployment"), "default", "d"))["spec"][
                "replicas"
            ] == 1
        finally:
            await client.close()
