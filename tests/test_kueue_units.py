"""The pure parts of the Kueue integration: the Workload a queued job asks with, the gate its
admission gives, the flavors' placement, the status writes of the external-framework contract,
and Kueue's own configuration and webhooks on the local control plane."""

from __future__ import annotations

import base64

import pytest

from kuberl.cluster import kueue
from kuberl.cluster.errors import ClusterError
from kuberl.operator.decide import queue, status
from kuberl.operator.render import builders, workload
from tests.builders import job

QUEUED = {workload.QUEUE_LABEL: "team-a"}
POOL = {"replicas": 2, "workersPerPod": 4, "resources": {"requests": {"cpu": "4", "memory": "8Gi"}},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}
FLEET = {"replicas": 2, "accelerator": {"profile": "mi300x", "count": 1}}


def _sets(**spec) -> dict[str, dict]:
    j = job("train", "ns", labels=QUEUED, **spec)
    return {s["name"]: s for s in workload.pod_sets(builders.build_for(j, "ns"), "ns")}


def test_pod_sets_count_the_trainer_ranks_engines_and_sandboxes_at_full_size():
    sets = _sets(trainer={"replicas": 2, "accelerator": {"profile": "mi300x", "count": 8}},
                 rollout={"engine": "sglang", "fleet": FLEET}, sandbox={"pool": POOL})
    assert sets["trainer"]["count"] == 2
    trainer = sets["trainer"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert trainer["amd.com/gpu"] in (8, "8")
    assert sets["rollout"]["count"] == 2
    assert sets["rollout"]["template"]["spec"]["containers"][0]["resources"]["requests"]["amd.com/gpu"] in (1, "1")
    # an autoscaled pool asks for what it may scale to, so scaling stays inside the admission
    assert sets["sandbox"]["count"] == 5
    assert sets["sandbox"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "4"


def test_a_local_engine_job_asks_for_its_trainer_only():
    assert set(_sets(rollout={"engine": "local"})) == {"trainer"}


def test_the_workload_names_queue_priority_and_shape():
    sets = list(_sets().values())
    wl = workload.build_workload("train", "ns", "team-a", sets, "high", 1000)
    assert wl["metadata"]["name"] == "agenticrljob-train"
    assert wl["spec"]["queueName"] == "team-a"
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                              "name": "high"}
    low = workload.build_workload("train", "ns", "team-a", sets, "low", 10)
    shape = workload.SHAPE_ANNOTATION
    assert wl["metadata"]["annotations"][shape] != low["metadata"]["annotations"][shape]  # asks again
    bigger = list(_sets(trainer={"replicas": 3}).values())
    assert workload.build_workload("train", "ns", "team-a", bigger)["metadata"]["annotations"][shape] != \
        workload.build_workload("train", "ns", "team-a", sets)["metadata"]["annotations"][shape]


def _wl(conds: list[tuple[str, str, str, str]], admission: dict | None = None) -> dict:
    st: dict = {"conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conds]}
    if admission is not None:
        st["admission"] = admission
    return {"metadata": {"name": "agenticrljob-train", "generation": 1, "resourceVersion": "7"},
            "spec": {"queueName": "team-a"}, "status": st}


ADMISSION = {"clusterQueue": "gpus", "podSetAssignments": [
    {"name": "trainer", "flavors": {"amd.com/gpu": "mi300x", "cpu": "default"}},
    {"name": "sandbox", "flavors": {"cpu": "default"}}]}


def test_the_gate_says_queued_admitted_evicted_and_preempted_in_kueues_words():
    assert not queue.gate(None).admitted and queue.gate(None).phase == "Queued"
    short = "couldn't assign flavors to pod set trainer: insufficient unused quota for amd.com/gpu in flavor mi300x"
    g = queue.gate(_wl([("QuotaReserved", "False", "Pending", short)]))
    assert (g.admitted, g.reason, g.phase) == (False, "Queued", "Queued") and short in g.message
    g = queue.gate(_wl([("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", "")],
                       ADMISSION))
    assert g.admitted and "gpus" in g.message
    g = queue.gate(_wl([("Admitted", "True", "Admitted", ""), ("Evicted", "True", "Preempted", "to admit ns/hi")],
                       ADMISSION))
    assert (g.admitted, g.evicted, g.reason, g.phase) == (False, True, "Preempted", "Suspended")
    g = queue.gate(_wl([("Requeued", "True", "Preempted", "x"), ("QuotaReserved", "False", "Pending", short)]))
    assert (g.admitted, g.evicted, g.reason, g.phase) == (False, False, "Preempted", "Suspended")
    assert short in g.message


def test_placement_brings_the_flavors_labels_and_tolerations_to_the_pods():
    flavors = {"mi300x": {"nodeLabels": {"pool": "mi300x"},
                          "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
               "default": {}}
    place = queue.placement(_wl([], ADMISSION), flavors)
    assert place == {"trainer": {"nodeSelector": {"pool": "mi300x"}, "tolerations": flavors["mi300x"]["tolerations"]}}
    j = job("train", "ns", labels=QUEUED, sandbox={"pool": POOL})
    placed = workload.with_flavors(builders.build_for(j, "ns"), place)
    trainer = next(o for o in placed if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert trainer["nodeSelector"]["pool"] == "mi300x"
    assert flavors["mi300x"]["tolerations"][0] in trainer["tolerations"]
    assert next(o for o in placed if o["kind"] == "SandboxPool")["spec"].get("podTemplate") is None


def test_release_gives_the_admission_back_and_finish_frees_the_quota():
    evicted = _wl([("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", ""),
                   ("Evicted", "True", "Preempted", "to admit ns/hi")], ADMISSION)
    patch = queue.release_patch(evicted)
    assert patch["status"]["admission"] is None and patch["metadata"]["resourceVersion"] == "7"
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Evicted"]["status"] == "True"  # Kueue's own, cleared when it admits again
    done = queue.finish_patch(evicted, True, "all 1 trainer pods completed")
    assert {c["type"]: c["status"] for c in done["status"]["conditions"]}["Finished"] == "True"
    finished = _wl([("Finished", "True", "Succeeded", "")])
    assert queue.finish_patch(finished, True, "") is None


def test_a_held_job_is_queued_or_suspended_with_kueues_reason():
    held = queue.gate(_wl([("QuotaReserved", "False", "Pending", "insufficient quota")]))
    out = status.job_status(trainer=None, pods=[], suspended=False, waiting_for=[], generation=1, previous={},
                            queue=held)
    assert out["phase"] == "Queued"
    cond = next(c for c in out["conditions"] if c["type"] == "Suspended")
    assert (cond["status"], cond["reason"]) == ("True", "Queued") and "insufficient quota" in cond["message"]
    user = status.job_status(trainer=None, pods=[], suspended=True, waiting_for=[], generation=1, previous={},
                             queue=held)
    assert user["phase"] == "Suspended"  # the user's suspend wins


def test_kueue_config_enables_the_external_framework_and_own_webhooks_only():
    cfg = kueue.config(9443, 8081, kueue.Path("/c"))
    assert cfg["integrations"]["externalFrameworks"] == ["AgenticRLJob.v1alpha1.kuberl.io"]
    assert cfg["internalCertManagement"] == {"enable": False}
    hook = {"name": "vworkload.kb.io", "clientConfig": {"service": {"name": "s", "path": "/validate-wl"}},
            "rules": [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"]}]}
    pods = {"name": "mpod.kb.io", "clientConfig": {"service": {"name": "s", "path": "/mutate-pod"}},
            "rules": [{"apiGroups": [""], "resources": ["pods"]}]}
    docs = [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
             "metadata": {"name": "validating-webhook-configuration"}, "webhooks": [hook, pods]}]
    (out,) = kueue.own_webhooks(docs, 9443, b"PEM")
    assert out["metadata"]["name"] == "kueue-validating-webhook-configuration"
    assert [h["name"] for h in out["webhooks"]] == ["vworkload.kb.io"]
    assert out["webhooks"][0]["clientConfig"] == {"url": "https://127.0.0.1:9443/validate-wl",
                                                  "caBundle": base64.b64encode(b"PEM").decode()}
    with pytest.raises(ClusterError, match="no webhook of kueue.x-k8s.io"):
        kueue.own_webhooks([{**docs[0], "webhooks": [pods]}], 9443, b"PEM")


async def test_admission_refuses_a_queue_label_naming_no_local_queue():
    from kuberl.operator.validate import admission

    body = job_manifest_with_queue("team-a")
    seen: list[tuple[str, str, str]] = []

    async def nothing(kind, ns, name):
        seen.append((kind, ns, name))
        return None

    async def queues(kind, ns, name):
        return {"metadata": {"name": name}} if kind == "LocalQueue" else None

    (err,) = await admission.validation_errors(body, nothing)
    assert ("LocalQueue", "ns", "team-a") in seen
    assert "LocalQueue ns/team-a does not exist" in err and "kueue.x-k8s.io/queue-name" in err
    assert await admission.validation_errors(body, queues) == []
    assert await admission.validation_errors(job_manifest_with_queue(None), nothing) == []


def test_offline_validate_warns_that_the_queue_is_not_checked():
    from kuberl.api import parse_resource
    from kuberl.operator.validate.checks import check_file

    (v,) = check_file([parse_resource(job_manifest_with_queue("team-a"), source="t")])
    assert not v.problems
    assert any("LocalQueue ns/team-a" in w and "offline" in w for w in v.warnings), v.warnings
    (v,) = check_file([parse_resource(job_manifest_with_queue(None), source="t")])
    assert not any("LocalQueue" in w for w in v.warnings)


def job_manifest_with_queue(queue: str | None) -> dict:
    from tests.builders import job_manifest

    return job_manifest("train", "ns", labels={workload.QUEUE_LABEL: queue} if queue else None,
                        rollout={"engine": "local"}, trainer={"accelerator": {"profile": "cpu", "count": 1}})
