"""Unit tests of the operator's pure parts: status rules, admission rules, diffing, emulator."""

from __future__ import annotations

import aiohttp
import kmock
import kopf
import pytest
from kube_emulator import ClusterEmulator, matches_selector, merge_patch

from kuberl.operator.decide import children, status
from kuberl.operator.runtime import main
from kuberl.operator.runtime.context import OperatorConfig
from kuberl.operator.runtime.kube import KubeClient, is_subset, kind_of
from kuberl.operator.runtime.pods import train_progress
from kuberl.operator.runtime.registry import build_registry
from kuberl.operator.validate import admission


def test_is_subset_ignores_server_defaults_but_not_changes() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "args": ["x"]}]}}}
    live = {
        "spec": {
            "replicas": 2,
            "progressDeadlineSeconds": 600,
            "template": {"containers": [{"name": "a", "args": ["x"], "terminationMessagePath": "/dev/t"}]},
        }
    }
    assert is_subset(desired, live)
    assert not is_subset({"spec": {"replicas": 3}}, live)
    assert not is_subset({"spec": {"template": {"containers": [{"name": "a", "args": ["x", "y"]}]}}}, live)
    assert not is_subset({"a": True}, {"a": 1}) and is_subset({"a": 1}, {"a": 1.0})


def test_scaled_status_phases_and_transition_time() -> None:
    dep = {"status": {"replicas": 3, "readyReplicas": 1}}
    st = status.scaled_status(
        desired=3, workload=dep, selector="a=b", generation=4, previous={}, noun="sandbox"
    )
    assert st["phase"] == "Progressing" and st["readyReplicas"] == 1 and st["observedGeneration"] == 4
    assert st["conditions"][0]["status"] == "False" and "1/3" in st["conditions"][0]["message"]
    first = dict(st["conditions"][0], lastTransitionTime="2020-01-01T00:00:00Z")
    again = status.scaled_status(
        desired=3,
        workload=dep,
        selector="a=b",
        generation=4,
        previous={"conditions": [first]},
        noun="sandbox",
    )
    assert again["conditions"][0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"  # no flip, no new time
    ready = status.scaled_status(
        desired=3,
        workload={"status": {"replicas": 3, "readyReplicas": 3}},
        selector="a=b",
        generation=4,
        previous={"conditions": [first]},
        noun="sandbox",
    )
    assert (
        ready["phase"] == "Ready" and ready["conditions"][0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    )
    assert (
        status.scaled_status(desired=1, workload=None, selector="", generation=1, previous={}, noun="x")[
            "phase"
        ]
        == "Pending"
    )


def test_job_status_phases() -> None:
    def js(**kw):
        args = {
            "trainer": {"status": {}},
            "pods": [],
            "suspended": False,
            "waiting_for": [],
            "generation": 1,
            "previous": {},
        }
        return status.job_status(**{**args, **kw})

    assert js(trainer=None)["phase"] == "Pending"
    # active pods may still be Pending: Running once one is Ready, Ready once all of them are
    assert js(trainer={"spec": {"parallelism": 2}, "status": {"active": 2}})["phase"] == "Pending"
    running = js(trainer={"spec": {"parallelism": 2}, "status": {"active": 2, "ready": 1}})
    assert running["phase"] == "Running"
    assert next(c for c in running["conditions"] if c["type"] == "Ready")["status"] == "False"
    ready = js(trainer={"spec": {"parallelism": 2}, "status": {"active": 2, "ready": 2}})
    assert next(c for c in ready["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert js(suspended=True)["phase"] == "Suspended"
    assert js(waiting_for=["RolloutFleet ns/x"])["phase"] == "Waiting"
    done = js(trainer={"status": {"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}})
    assert done["phase"] == "Succeeded"
    pods = [
        {
            "metadata": {"name": "p0"},
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "state": {
                            "terminated": {
                                "reason": "Error",
                                "exitCode": 3,
                                "message": "Traceback ... ValueError: bad",
                            }
                        }
                    }
                ],
            },
        }
    ]
    failed = js(
        trainer={
            "status": {
                "conditions": [
                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "m"}
                ]
            }
        },
        pods=pods,
    )
    assert failed["phase"] == "Failed"
    assert "pod p0: Error (exit 3): Traceback ... ValueError: bad" in failed["conditions"][0]["message"]
    progress = js(trainer={"status": {"active": 1}}, progress={"step": 5, "stage": "rl"})
    assert progress["step"] == 5 and progress["stage"] == "rl"


def test_transition_events() -> None:
    st = {"phase": "Invalid", "conditions": [{"type": "Ready", "message": "spec.x: bad"}]}
    (ev,) = status.transition_events("SandboxPool", None, st)
    assert ev.type == "Warning" and ev.reason == "Invalid" and "spec.x: bad" in ev.message
    assert status.transition_events("SandboxPool", "Invalid", st) == []
    (ok,) = status.transition_events("SandboxPool", "Progressing", {"phase": "Ready", "conditions": []})
    assert ok.type == "Normal"


def test_train_progress_from_trainer_metrics() -> None:
    text = (
        "# TYPE kuberl_train_step gauge\n"
        'kuberl_train_step{job="j",stage="sft"} 400\n'
        'kuberl_train_step{job="j",stage="stage-1"} 412\n'
        'kuberl_train_step{job="other",stage="x"} 9999\n'
        "# TYPE kuberl_train_reward_mean gauge\n"
        'kuberl_train_reward_mean{job="j"} 0.625\n'
    )
    assert train_progress(text, "j") == {"step": 412, "stage": "stage-1", "summary": {"rewardMean": 0.625}}


async def test_admission_validation_rules() -> None:
    existing = {
        ("RolloutFleet", "ns", "f"): {"spec": {"engine": {}}},
        ("RolloutFleet", "ns", "short"): {"spec": {"engine": {"contextLength": 8192}}},
        ("RolloutFleet", "ns", "long"): {"spec": {"engine": {"contextLength": 16384}}},
        ("SandboxPool", "ns", "p"): {"spec": {}},
    }

    async def lookup(kind: str, ns: str, name: str) -> dict | None:
        return existing.get((kind, ns, name))

    def job(**spec):
        return {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "AgenticRLJob",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {"model": {"base": "m"}, "data": {"train": "d"}, **spec},
        }

    assert (
        await admission.validation_errors(job(rollout={"fleetRef": "f"}, sandbox={"poolRef": "p"}), lookup)
        == []
    )
    errs = await admission.validation_errors(job(rollout={"fleetRef": "g"}), lookup)
    assert errs == ["spec.rollout.fleetRef: RolloutFleet ns/g does not exist"]
    # engine: local never talks to a fleet, so a dangling ref is harmless there.
    assert await admission.validation_errors(job(rollout={"fleetRef": "g", "engine": "local"}), lookup) == []
    (err,) = await admission.validation_errors(
        job(stages=[{"name": "a", "type": "rl", "steps": 1}] * 2), lookup
    )
    assert "stage names must be unique" in err
    # SGLang rejects prompt + max_new_tokens >= context length: the fleet must leave room for a
    # prompt beyond every RL stage's maxResponseTokens (8192 by default; sft stages generate nothing).
    stages = [
        {"name": "sft", "type": "sft", "steps": 1, "maxResponseTokens": 99999},
        {"name": "s1", "type": "rl", "steps": 1},
        {"name": "s2", "type": "rl", "steps": 1, "maxResponseTokens": 12288},
    ]
    errs = await admission.validation_errors(job(rollout={"fleetRef": "short"}, stages=stages), lookup)
    assert len(errs) == 2, errs  # s1 (the rollout default, 8192) and s2 (12288); not sft
    assert errs[0].startswith("spec.rollout.fleetRef: RolloutFleet ns/short has engine.contextLength 8192")
    assert "stage 's1' maxResponseTokens 8192" in errs[0] and "HTTP 400" in errs[0]
    assert "stage 's2' maxResponseTokens 12288" in errs[1]
    errs = await admission.validation_errors(job(rollout={"fleetRef": "long"}, stages=stages), lookup)
    assert errs == []
    errs = await admission.validation_errors(
        job(rollout={"fleetRef": "long", "maxResponseTokens": 16384}, stages=stages[:2]), lookup
    )
    assert len(errs) == 1 and "stage 's1' maxResponseTokens 16384" in errs[0]
    # Without contextLength the model's own limit applies, which admission cannot know.
    assert await admission.validation_errors(job(rollout={"fleetRef": "f"}, stages=stages), lookup) == []
    pool = {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": "p", "annotations": {"kuberl.io/autoscaler": "keda"}},
        "spec": {},
    }
    (err,) = await admission.validation_errors(pool, None)
    assert "needs spec.autoscaling" in err


def test_admission_mutation() -> None:
    body = {
        "kind": "AgenticRLJob",
        "metadata": {"name": "j"},
        "spec": {"model": {"base": "Qwen/X"}, "rollout": {"fleet": {"replicas": 1}}},
    }
    patch = admission.mutation(body)
    assert patch["spec"]["rollout"]["fleet"]["model"] == {"uri": "Qwen/X", "servedName": "policy"}
    assert patch["metadata"]["labels"] == {"app.kubernetes.io/name": "kuberl"}
    done = {"kind": "SandboxPool", "metadata": {"labels": {"app.kubernetes.io/name": "kuberl"}}, "spec": {}}
    assert admission.mutation(done) == {}


def test_registry_has_no_finalizer_requiring_handlers() -> None:
    reg, _ = build_registry(OperatorConfig(admission=True))
    handlers = reg._changing.get_all_handlers() + reg._spawning.get_all_handlers()
    ids = {h.id for h in handlers}
    assert {"SandboxPool-create", "RolloutFleet-update", "AgenticRLJob-resume"} <= ids
    assert not any(h.requires_finalizer for h in handlers)
    assert {h.id for h in reg._webhooks.get_all_handlers()} >= {
        "validate-sandboxpools",
        "mutate-agenticrljobs",
    }


def test_emulator_helpers() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": None, "e": 3}, "d": [2]}) == {
        "a": {"c": 2, "e": 3},
        "d": [2],
    }
    labels = {"app": "x", "tier": "web"}
    assert matches_selector(labels, "app=x,tier=web") and matches_selector(labels, "app==x,!missing,tier")
    assert not matches_selector(labels, "app!=x") and not matches_selector(labels, "app=y")
    assert matches_selector(labels, "")


async def test_client_apply_is_idempotent_against_the_emulator() -> None:
    async with ClusterEmulator(simulate_controllers=True) as emu, kmock.Server(emu) as srv:
        client = KubeClient(kopf.ConnectionInfo(server=str(srv.url)))
        try:
            cm = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "c", "namespace": "default"},
                "data": {"k": "1"},
            }
            action, live = await client.apply(cm)
            assert action == "created" and live["metadata"]["resourceVersion"]
            action, again = await client.apply(cm)
            assert (
                action == "unchanged"
                and again["metadata"]["resourceVersion"] == live["metadata"]["resourceVersion"]
            )
            action, changed = await client.apply({**cm, "data": {"k": "2"}})
            assert action == "updated" and changed["data"] == {"k": "2"}
            assert [
                o["metadata"]["name"] for o in await client.list(kind_of("v1", "ConfigMap"), "default")
            ] == ["c"]
            assert await client.delete(kind_of("v1", "ConfigMap"), "default", "c") is True
            assert await client.delete(kind_of("v1", "ConfigMap"), "default", "c") is False
            assert await client.get(kind_of("v1", "ConfigMap"), "default", "c") is None
            with pytest.raises(ValueError, match="does not manage"):
                kind_of("v1", "Node")
        finally:
            await client.close()


async def test_emulator_generation_status_subresource_and_gc() -> None:
    async with ClusterEmulator() as emu, kmock.Server(emu) as srv, aiohttp.ClientSession(str(srv.url)) as s:
        base = "/apis/kuberl.io/v1alpha1/namespaces/default/sandboxpools"
        owner = await (
            await s.post(
                base,
                json={
                    "apiVersion": "kuberl.io/v1alpha1",
                    "kind": "SandboxPool",
                    "metadata": {"name": "p"},
                    "spec": {"replicas": 1},
                },
            )
        ).json()
        merge = {"Content-Type": "application/merge-patch+json"}
        st = await (
            await s.patch(
                f"{base}/p/status",
                json={"status": {"phase": "Ready"}, "spec": {"replicas": 9}},
                headers=merge,
            )
        ).json()
        assert (
            st["status"] == {"phase": "Ready"}
            and st["spec"]["replicas"] == 1
            and st["metadata"]["generation"] == 1
        )
        main = await (
            await s.patch(
                f"{base}/p", json={"spec": {"replicas": 2}, "status": {"phase": "X"}}, headers=merge
            )
        ).json()
        assert main["metadata"]["generation"] == 2 and main["status"] == {"phase": "Ready"}
        stale = [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": owner["metadata"]["resourceVersion"],
            },
            {"op": "add", "path": "/metadata/finalizers", "value": ["f"]},
        ]
        rsp = await s.patch(f"{base}/p", json=stale, headers={"Content-Type": "application/json-patch+json"})
        assert rsp.status == 422
        ref = {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "SandboxPool",
            "name": "p",
            "uid": owner["metadata"]["uid"],
        }
        child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "ownerReferences": [ref]}}
        assert (await s.post("/api/v1/namespaces/default/configmaps", json=child)).status == 200
        await s.delete(f"{base}/p")
        assert (await s.get("/api/v1/namespaces/default/configmaps/c")).status == 404
        # An object created for an owner that is already gone is collected at once.
        assert (await s.post("/api/v1/namespaces/default/configmaps", json=child)).status == 200
        assert (await s.get("/api/v1/namespaces/default/configmaps/c")).status == 404


def test_orphans_are_owned_children_no_longer_built() -> None:
    def obj(kind: str, name: str, uid: str) -> dict:
        return {"kind": kind, "metadata": {"name": name, "ownerReferences": [{"uid": uid}]}}

    live = [
        obj("Deployment", "big", "u1"),
        obj("LeaderWorkerSet", "big", "u1"),
        obj("Deployment", "big", "u2"),
    ]
    wanted = {("LeaderWorkerSet", "big"), ("Service", "big")}
    assert children.orphans(live, wanted, "u1") == [live[0]]  # not another owner's object
    assert children.orphans(live, wanted, "") == []  # no uid, no certainty: delete nothing
    assert children.orphans([{"kind": "Deployment", "metadata": {"name": "x"}}], set(), "u1") == []


def test_inline_replicas_belong_to_the_autoscaler_between_create_and_suspend() -> None:
    auto = {"minReplicas": 1, "maxReplicas": 4}
    wanted = {"replicas": 2, "autoscaling": auto}
    assert children.inline_replicas(wanted, None) == 2  # create
    assert children.inline_replicas(wanted, {"replicas": 3, "autoscaling": auto}) == 3  # the autoscaler's
    assert children.inline_replicas(wanted, {"replicas": 9, "autoscaling": {"maxReplicas": 9}}) == 4  # bounds
    assert children.inline_replicas(wanted, {"replicas": 0}) == 2  # resume: suspended children have none
    suspended = {"replicas": 0}
    assert children.inline_replicas(suspended, {"replicas": 3, "autoscaling": auto}) == 0  # suspend
    assert children.inline_replicas({"replicas": 5}, {"replicas": 3}) == 5  # not autoscaled: the job's


def test_a_held_jobs_children_keep_their_size_until_its_trainer_pods_have_ended() -> None:
    held, auto = {"replicas": 0}, {"minReplicas": 1, "maxReplicas": 4}
    live = {"replicas": 3, "autoscaling": auto}
    assert children.held_spec(held, live, True) == {"replicas": 3, "autoscaling": auto}  # stopping
    assert children.held_spec(held, live, False) == held  # ended: zero
    assert children.held_spec(held, None, True) == held  # no child yet: none to keep
    running = {"status": {"phase": "Running"}}
    deleted = {"metadata": {"deletionTimestamp": "t"}, "status": {"phase": "Running"}}
    assert children.trainers_stopping([running]) and children.trainers_stopping([deleted, {"status": {}}])
    assert not children.trainers_stopping([{"status": {"phase": "Failed"}}, {"status": {"phase": "Succeeded"}}])
    assert not children.trainers_stopping([])


def test_webhook_server_from_env() -> None:
    assert main.webhook_server_from_env({}) is None
    url = main.webhook_server_from_env({"KUBERL_WEBHOOK_PORT": "9443", "KUBERL_WEBHOOK_HOST": "op.example"})
    assert type(url) is kopf.WebhookServer and (url.port, url.host) == (9443, "op.example")
    env = {
        "KUBERL_WEBHOOK_PORT": "9443",
        "KUBERL_WEBHOOK_SERVICE": "kuberl-webhook",
        "KUBERL_WEBHOOK_NAMESPACE": "kuberl-system",
        "KUBERL_WEBHOOK_CERT": "/etc/kuberl/webhook/tls.crt",
        "KUBERL_WEBHOOK_KEY": "/etc/kuberl/webhook/tls.key",
        "KUBERL_WEBHOOK_CA": "/etc/kuberl/webhook/ca.crt",
    }
    svc = main.webhook_server_from_env(env)
    assert isinstance(svc, main.ServiceWebhookServer)
    assert (svc.service, svc.namespace, svc.service_port, svc.port) == (
        "kuberl-webhook",
        "kuberl-system",
        443,
        9443,
    )
    assert svc.host == "kuberl-webhook.kuberl-system.svc" and svc.cafile == env["KUBERL_WEBHOOK_CA"]
    for bad, message in [
        ({"KUBERL_WEBHOOK_PORT": "https"}, "must be a port number"),
        ({"KUBERL_WEBHOOK_PORT": "70000"}, "0-65535"),
        ({"KUBERL_WEBHOOK_PORT": "1", "KUBERL_WEBHOOK_SERVICE": "s"}, "needs KUBERL_WEBHOOK_NAMESPACE"),
        ({"KUBERL_WEBHOOK_PORT": "1", "KUBERL_WEBHOOK_CERT": "c"}, "must be set together"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main.webhook_server_from_env(bad)


def test_service_client_config_keeps_the_ca_bundle() -> None:
    cfg = main.service_client_config(
        {"url": "https://x:9443", "caBundle": "Q0E="}, service="s", namespace="n", port=443
    )
    assert cfg == {"service": {"name": "s", "namespace": "n", "port": 443, "path": ""}, "caBundle": "Q0E="}


def test_an_unschedulable_pod_says_why_in_the_ready_condition() -> None:
    from kuberl.operator.decide import status

    def pod(name: str, scheduled: dict | None) -> dict:
        conds = [{"type": "PodScheduled", **scheduled}] if scheduled else []
        return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": conds}}

    stuck = {"status": "False", "reason": "Unschedulable", "message": '0/12 nodes are available: persistentvolumeclaim "w" not found.'}
    pods = [pod("b", stuck), pod("a", {"status": "True"}), pod("c", None)]
    why = status.unschedulable(pods)
    assert why == 'pod b cannot be scheduled: 0/12 nodes are available: persistentvolumeclaim "w" not found.'
    assert status.unschedulable([pod("a", {"status": "False", "reason": "SchedulingGated"})]) is None
    workload = {"kind": "Deployment", "metadata": {"name": "f"}, "status": {"replicas": 2, "readyReplicas": 0}}
    st = status.scaled_status(desired=2, workload=workload, selector="x=y", generation=1, previous={}, noun="engine",
                              unschedulable=why)
    ready = st["conditions"][0]
    assert (ready["reason"], ready["status"]) == ("Unschedulable", "False")
    assert ready["message"] == f"0/2 engine replicas ready; {why}"
    job = status.job_status(trainer={"spec": {"parallelism": 1}, "status": {"active": 1}}, pods=pods, suspended=False,
                            waiting_for=[], generation=1, previous={})
    assert next(c for c in job["conditions"] if c["type"] == "Ready")["reason"] == "Unschedulable"


def test_kopfs_peer_identity_needs_no_passwd_entry(monkeypatch):
    """In the chart's pod the operator's uid (65532) has no passwd entry, where kopf's default
    identity (getpass.getuser()) raises KeyError: the pod's name, else the host's, is used."""
    import getpass
    import socket

    def no_entry() -> str:
        raise KeyError("getpwuid(): uid not found: 65532")

    monkeypatch.setattr(getpass, "getuser", no_entry)
    assert main.kopf_identity({"KUBERL_POD_NAME": "kuberl-operator-abc"}) == "kuberl-operator-abc"
    assert main.kopf_identity({}) == socket.gethostname()
