"""AgenticRLJobs on a shared cluster with Kueue (``kuberl cluster up`` starts it): quota, queueing,
priority preemption and re-admission, on kwok's MI300X nodes, with the operator under the chart's
RBAC (``kueue.enabled``).

Each test has a ClusterQueue of its own (16 ``amd.com/gpu`` on a flavor of the MI300X nodes,
CPUs, memory and disk on a default flavor) and a LocalQueue in its namespace. The jobs train on
2 pods x 8 MI300X, so one fills the quota. kwok's pods do not run programs: that a preempted
trainer writes a checkpoint and its successor resumes from it is tests/test_suspend_resume.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from k8s_fixtures import Kube, new_namespace, wait_for
from kueue_queues import KUEUE_API, make_queues, priority_class

from kuberl.api.job import PRIORITY_LABEL, QUEUE_LABEL
from kuberl.operator.render.render_common import AMD_PRODUCT_LABEL
from tests.test_k8s_operator import seen

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 90
QUICKSTART = next(d for d in yaml.safe_load_all((REPO / "examples" / "quickstart.yaml").read_text()) if d)


@pytest.fixture
def queued_ns(kube):
    """A fresh namespace, deleted with its pods after the test (their GPUs free for the next)."""
    made: list[str] = []

    def make(prefix: str) -> str:
        made.append(new_namespace(kube, prefix))
        return made[-1]

    yield make
    for ns in made:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)
        kube.run("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", "--wait=false", check=False)
    for ns in made:
        kube.run("wait", "--for=delete", "pods", "--all", "-n", ns, "--timeout=60s", check=False)


def _job(name: str, queue: str | None, priority: str | None = None) -> dict:
    doc = copy.deepcopy(QUICKSTART)
    doc["metadata"] = {"name": name, "labels": {k: v for k, v in ((QUEUE_LABEL, queue), (PRIORITY_LABEL, priority))
                                                if v}}
    doc["spec"]["trainer"] = {"replicas": 2, "accelerator": {"profile": "mi300x", "count": 8}}
    return doc


def _status(kube: Kube, ns: str, name: str) -> dict:
    return kube.json("get", "agenticrljob", name, "-n", ns).get("status") or {}


def _suspended(st: dict) -> dict:
    return next((c for c in st.get("conditions", []) if c["type"] == "Suspended"), {})


def _running_trainers(kube: Kube, ns: str, job: str) -> list[dict]:
    pods = kube.items("pods", ns, f"app.kubernetes.io/component=trainer,app.kubernetes.io/instance={job}")
    return [p for p in pods if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def _trainer_pods(kube: Kube, ns: str, job: str) -> list[dict]:
    return kube.items("pods", ns, f"app.kubernetes.io/component=trainer,app.kubernetes.io/instance={job}")


def _wait_running(kube: Kube, ns: str, job: str, op) -> list[dict]:
    return wait_for(lambda: (p if len(p := _running_trainers(kube, ns, job)) == 2 else None), TIMEOUT,
                    lambda: f"{job}'s 2 trainer pods running\n" + seen(kube, ns, op))


def _workload(kube: Kube, ns: str, job: str) -> dict:
    return kube.json("get", "workloads.kueue.x-k8s.io", f"agenticrljob-{job}", "-n", ns)


def test_two_jobs_share_a_16_gpu_quota_one_runs_the_other_waits_in_kueues_words(kube, kuberl_operator, queued_ns):
    ns = queued_ns("kq")
    queues = make_queues(kube, ns)
    try:
        kube.apply([_job("first", "lq")], "-n", ns)
        pods = _wait_running(kube, ns, "first", kuberl_operator)
        # the job's phase follows its pods at the operator's next pass over it
        wait_for(lambda: _status(kube, ns, "first").get("phase") == "Running", TIMEOUT,
                 lambda: "first Running\n" + seen(kube, ns, kuberl_operator))
        # the flavor Kueue assigned reaches the pods
        assert all(p["spec"]["nodeSelector"].get(AMD_PRODUCT_LABEL) == "AMD_Instinct_MI300X_OAM" for p in pods)
        wl = _workload(kube, ns, "first")
        assert wl["metadata"]["ownerReferences"][0]["kind"] == "AgenticRLJob"
        assert {ps["name"]: ps["count"] for ps in wl["spec"]["podSets"]} == {"trainer": 2, "sandbox": 1}
        kube.apply([_job("second", "lq")], "-n", ns)

        def queued() -> dict | None:
            st = _status(kube, ns, "second")
            return st if st.get("phase") == "Queued" and "insufficient" in _suspended(st).get("message", "") else None

        st = wait_for(queued, TIMEOUT, lambda: "second Queued with Kueue's reason\n" + seen(kube, ns, kuberl_operator))
        assert _suspended(st)["reason"] == "Queued" and "amd.com/gpu" in _suspended(st)["message"]
        assert _trainer_pods(kube, ns, "second") == []
        table = kube.run("get", "arj", "-n", ns).stdout
        assert "QUEUE" in table and "SUSPENDED" in table
        assert [line.split()[:4] for line in table.splitlines()[1:]] == [
            ["first", "Running", "lq", "Resumed"], ["second", "Queued", "lq", "Queued"]]
        # a job without the label runs as before: no Workload, no queue
        plain = _job("plain", None)
        plain["spec"]["trainer"] = {"accelerator": {"profile": "cpu", "count": 1}}
        kube.apply([plain], "-n", ns)
        wait_for(lambda: _running_trainers(kube, ns, "plain"), TIMEOUT, lambda: "plain running\n" + seen(kube, ns))
        assert kube.run("get", "workloads.kueue.x-k8s.io", "agenticrljob-plain", "-n", ns, check=False).returncode != 0
        # the first goes: its quota admits the second, which runs
        kube.run("delete", "agenticrljob", "first", "-n", ns)
        _wait_running(kube, ns, "second", kuberl_operator)
        # its Suspended condition follows the pods at the operator's next pass over the job
        wait_for(lambda: _suspended(_status(kube, ns, "second")).get("status") == "False", TIMEOUT,
                 lambda: "second's Suspended condition False\n" + seen(kube, ns, kuberl_operator))  # fmt: skip
    finally:
        queues.drop(kube)


def test_a_higher_priority_job_preempts_a_running_lower_one_which_resumes_later(kube, kuberl_operator, queued_ns):
    ns = queued_ns("kp")
    queues = make_queues(kube, ns, preemption=True)
    classes = {"low": f"low-{ns}", "high": f"high-{ns}"}
    for name, value in ((classes["low"], 100), (classes["high"], 1000)):
        priority_class(kube, name, value)
    try:
        kube.apply([_job("low", "lq", classes["low"])], "-n", ns)
        _wait_running(kube, ns, "low", kuberl_operator)
        assert _workload(kube, ns, "low")["spec"]["priority"] == 100
        trainer_uid = kube.json("get", "job", "low-trainer", "-n", ns)["metadata"]["uid"]
        kube.apply([_job("high", "lq", classes["high"])], "-n", ns)
        _wait_running(kube, ns, "high", kuberl_operator)
        # the lower one was evicted: suspended with Kueue's reason (its status follows at the
        # operator's next pass over it), its pods gone, queued again
        st = wait_for(lambda: (s if (s := _status(kube, ns, "low")).get("phase") == "Suspended" else None), TIMEOUT,
                      lambda: "low Suspended\n" + seen(kube, ns, kuberl_operator))  # fmt: skip
        assert _suspended(st)["reason"] == "Preempted", _suspended(st)
        assert wait_for(lambda: _trainer_pods(kube, ns, "low") == [], TIMEOUT, "low's trainer pods gone")
        low_job = kube.json("get", "job", "low-trainer", "-n", ns)
        # suspended in place (its template, flavor included, unchanged), not replaced
        assert low_job["spec"]["suspend"] is True and low_job["metadata"]["uid"] == trainer_uid
        wl = _workload(kube, ns, "low")
        conds = {c["type"]: c for c in wl["status"]["conditions"]}
        assert conds["Requeued"]["reason"] == "Preempted" and conds["QuotaReserved"]["status"] == "False"
        assert "Suspended" in kube.run("get", "arj", "low", "-n", ns).stdout
        events = kube.run("get", "events", "-n", ns, "--field-selector", "involvedObject.name=low").stdout
        assert "QuotaReleased" in events
        # quota frees: the lower one is admitted again and runs
        kube.run("delete", "agenticrljob", "high", "-n", ns)
        _wait_running(kube, ns, "low", kuberl_operator)
        st = wait_for(lambda: (s if (s := _status(kube, ns, "low")).get("phase") == "Running" else None), TIMEOUT,
                      lambda: "low Running again\n" + seen(kube, ns, kuberl_operator))
        assert _suspended(st)["status"] == "False"
    finally:
        queues.drop(kube)
        kube.run("delete", "workloadpriorityclass", *classes.values(), "--wait=false", check=False)


def test_spec_suspend_holds_a_queued_job_out_of_the_queue_and_resumes_it(kube, kuberl_operator, queued_ns):
    """batch/v1 Job semantics on the real control plane: created suspended, the job makes no trainer
    pods and asks no quota; resumed, it queues and runs; suspended again, its trainer pods end,
    its pool scales to zero and its Workload goes (the quota with it)."""
    ns = queued_ns("ks")
    queues = make_queues(kube, ns)
    try:
        held = _job("held", "lq")
        held["spec"]["suspend"] = True
        kube.apply([held], "-n", ns)
        st = wait_for(lambda: (s if (s := _status(kube, ns, "held")).get("phase") == "Suspended" else None), TIMEOUT,
                      lambda: "held Suspended\n" + seen(kube, ns, kuberl_operator))
        assert _suspended(st)["reason"] == "Suspended"
        assert _trainer_pods(kube, ns, "held") == []
        no_workload = kube.run("get", "workloads.kueue.x-k8s.io", "agenticrljob-held", "-n", ns, check=False)
        assert no_workload.returncode != 0
        kube.run("patch", "agenticrljob", "held", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
        _wait_running(kube, ns, "held", kuberl_operator)
        assert kube.json("get", "sandboxpool", "held-sandbox", "-n", ns)["spec"]["replicas"] == 1
        kube.run("patch", "agenticrljob", "held", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": true}}')
        wait_for(lambda: _trainer_pods(kube, ns, "held") == [], TIMEOUT,
                 lambda: "held's trainer pods gone\n" + seen(kube, ns, kuberl_operator))
        wait_for(lambda: kube.json("get", "sandboxpool", "held-sandbox", "-n", ns)["spec"]["replicas"] == 0, TIMEOUT,
                 "the inline pool at zero")
        wait_for(lambda: kube.run("get", "workloads.kueue.x-k8s.io", "agenticrljob-held", "-n", ns,
                                  check=False).returncode != 0, TIMEOUT, "the Workload deleted")
        assert kube.json("get", "job", "held-trainer", "-n", ns)["spec"]["suspend"] is True
        kube.run("patch", "agenticrljob", "held", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
        _wait_running(kube, ns, "held", kuberl_operator)
    finally:
        queues.drop(kube)


def test_validate_server_refuses_a_queue_label_naming_no_local_queue(kube, queued_ns, tmp_path):
    """Where it can know (--server), `kuberl validate` refuses a queue label naming no LocalQueue of
    the job's namespace, and admits one naming a LocalQueue that is there; offline it warns."""
    import os
    import subprocess
    import sys

    ns = queued_ns("kv")
    kube.apply([{"apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": ns},
                 "spec": {"clusterQueue": f"cq-{ns}"}}])  # fmt: skip
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}

    def validate(queue: str, *flags: str) -> subprocess.CompletedProcess:
        doc = _job("v", queue)
        doc["metadata"]["namespace"] = ns
        path = tmp_path / f"{queue}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return subprocess.run([sys.executable, "-P", "-m", "kuberl", "validate", *flags, str(path)],
                              capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)

    missing = validate("nope", "--server")
    assert missing.returncode != 0 and f"LocalQueue {ns}/nope does not exist" in missing.stderr, missing.stderr
    there = validate("lq", "--server")
    assert there.returncode == 0, there.stdout + there.stderr
    offline = validate("nope")
    assert offline.returncode == 0 and "cannot be checked offline" in offline.stderr, offline.stderr
