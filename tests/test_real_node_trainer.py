"""examples/quickstart.yaml trains in real pods, queued by Kueue (issue 38 item 3d; issue 39's
preemption and resume in a real pod): the operator as a pod (tests/test_real_node_operator.py's
install, with the chart's ``kueue.enabled``) renders the trainer Job, whose pod runs
``ghcr.io/kuberl/trainer:0.1.0-cpu`` on the real node in a PodSecurity-restricted namespace and
calls the job's SandboxPool pods through their Service. The run is the quickstart with its stages
shortened (SFT 20 steps, RL 8, a checkpoint every 2 steps), labelled for a LocalQueue whose
ClusterQueue holds one such job's CPUs.

It is interrupted twice. Its first trainer pod is deleted once an RL checkpoint is on the claim:
it stops at a step boundary with a checkpoint (exit 143), the Job replaces it, and the new pod
resumes there. After that pod's own first checkpoint a higher-priority job is queued: Kueue
preempts the quickstart, whose trainer pod ends the same way and whose pool goes to zero; once
the urgent job is deleted, Kueue admits the quickstart again and a third pod resumes it. The job
reaches Succeeded, ``kuberl status`` follows it, the checkpoints and step records are on the
claim's host folder (each step once, none missing), and a real Prometheus that finds the trainer
pods as the chart's PodMonitor does scraped all three pods' steps. Needs what the real node needs,
buildah and debootstrap (the images are built the first time) and Debian's ``prometheus``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fixtures import wait_for
from kueue_queues import LOCAL_QUEUE, make_queues, priority_class
from node_fixtures import RealNode, load_images, require_or_skip, restricted_namespace, start
from operator_pod import install_operator, operator_logs
from trainer_pod import (
    JOB,
    LogFollower,
    claim_folder,
    job_status,
    prometheus,
    query_range,
    quickstart,
    records,
    running_trainer,
    trainer_pods,
    wait_phase,
)

from kuberl.api.job import PRIORITY_LABEL, QUEUE_LABEL
from kuberl.cluster.pki import NODE_NAME

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parent.parent
SFT, RL, EVERY = 20, 8, 2
STEPS = SFT + RL
URGENT = "urgent"


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    yield from start(tmp_path_factory.mktemp("trainernode"))


def urgent_job(ns: str, priority: str) -> dict:
    """A higher-priority job for the same queue whose trainer is one MI300X pod on kwok's GPU node
    (it needs the queue's CPUs, not the real node's): admitting it preempts the quickstart."""
    doc = quickstart(ns)
    doc["metadata"] = {"name": URGENT, "namespace": ns, "labels": {QUEUE_LABEL: LOCAL_QUEUE, PRIORITY_LABEL: priority}}
    doc["spec"]["trainer"]["accelerator"] = {"profile": "mi300x", "count": 8}
    doc["spec"]["trainer"].pop("device")
    return doc


def _last_step(folder: Path) -> int:
    return max((r["step"] for r in records(folder)), default=0)


@pytest.fixture(scope="module")
def run(node: RealNode, tmp_path_factory) -> dict:
    """The shortened quickstart in a Kueue queue, applied and trained to the end. Its first trainer
    pod is deleted after the first RL checkpoint (the Job replaces it); after the second pod's first
    checkpoint a higher-priority job is queued, Kueue preempts the quickstart (suspended: its
    trainer pod ends with a checkpoint, its pool goes to zero), the urgent job is deleted and Kueue
    admits the quickstart again (a third pod). What each step saw."""
    if shutil.which("prometheus") is None:
        require_or_skip("Debian's prometheus is not installed (apt-get install prometheus)")
    for name in ("sandbox", "operator", "trainer-cpu"):
        t = time.monotonic()
        load_images(node, [name], REPO)  # built or reused, loaded unless the node's root has it
        print(f"{name}: built or reused and in the node's containerd in {time.monotonic() - t:.1f} s")
    install_operator(node, kueue=True)
    tmp = tmp_path_factory.mktemp("trainerrun")
    ns = restricted_namespace(node.kube, "qs")
    kube = node.kube
    # one job's CPUs fit (trainer 1 + pool 250m), two jobs' do not; the GPUs fit the urgent one
    queues = make_queues(kube, ns, gpus=8, cpu="2", preemption=True)
    high = f"high-{ns}"
    priority_class(kube, high, 1000)
    job = quickstart(ns, SFT, RL, EVERY)
    job["metadata"]["labels"] = {QUEUE_LABEL: LOCAL_QUEUE}
    out: dict = {"ns": ns}
    with prometheus(node, ns, tmp / "prometheus") as prom:
        t0 = time.time()
        kube.apply([job])
        first = running_trainer(kube, ns, 600)
        first_log = LogFollower(kube, ns, first["metadata"]["name"], tmp / "first.log")
        folder = claim_folder(kube, ns)
        # the first RL step's checkpoint on the claim (the step records are kept with each)
        wait_for(lambda: any(r.get("type") == "rl" for r in records(folder)), 900,
                 lambda: first_log.text()[-2000:] + operator_logs(node),
                 interval=1.0)
        deleted = kube.run("delete", "pod", first["metadata"]["name"], "-n", ns, "--wait=false", check=False)
        assert deleted.returncode == 0, (deleted.stderr, kube.run("get", "pods,jobs", "-n", ns, "-o", "wide").stdout,
                                         job_status(kube, ns), first_log.text()[-3000:])
        out["stopped"] = first_log.wait(330)  # the trainer's grace: it ends its step and checkpoints
        second = running_trainer(kube, ns, 300, not_named=first["metadata"]["name"])
        second_log = LogFollower(kube, ns, second["metadata"]["name"], tmp / "second.log")
        # the second pod's own first checkpoint, then the urgent job: Kueue preempts the quickstart
        resumed_at = _last_step(folder)
        wait_for(lambda: _last_step(folder) > resumed_at, 600, lambda: second_log.text()[-2000:], interval=1.0)
        kube.apply([urgent_job(ns, high)])
        out["preempted"] = wait_for(lambda: (s if (s := job_status(kube, ns)).get("phase") == "Suspended" else None),
                                    300, lambda: json.dumps(job_status(kube, ns)) + operator_logs(node), interval=1.0)
        out["second_stopped"] = second_log.wait(330)
        wait_for(lambda: trainer_pods(kube, ns) == [], 120, "the preempted job's trainer pods gone")
        # the pool served the preempted pod's last step; once that pod is gone it goes to zero
        wait_for(lambda: kube.json("get", "sandboxpool", f"{JOB}-sandbox", "-n", ns)["spec"]["replicas"] == 0, 120,
                 "the preempted job's pool at zero")
        out["suspended_table"] = kube.run("get", "arj", "-n", ns).stdout
        out["workload"] = kube.json("get", "workloads.kueue.x-k8s.io", f"agenticrljob-{JOB}", "-n", ns)
        out["suspended_trainer"] = kube.json("get", "job", f"{JOB}-trainer", "-n", ns)
        # the quota frees: Kueue admits the quickstart again, and a third pod resumes it
        kube.run("delete", "agenticrljob", URGENT, "-n", ns)
        third = running_trainer(kube, ns, 600)
        third_log = LogFollower(kube, ns, third["metadata"]["name"], tmp / "third.log")
        out["status"] = wait_phase(kube, ns, {"Succeeded", "Failed"}, 900)
        out["resumed_again"] = third_log.wait(60)
        t1 = time.time()
        time.sleep(4)  # the last scrape of the finished pod is in
        out["steps"] = query_range(prom, f'kuberl_train_step{{job="{JOB}",stage="rl"}}', t0, time.time())
    queues.drop(kube)
    env = dict(os.environ, KUBECONFIG=str(kube.kubeconfig))
    out["shown"] = subprocess.run([sys.executable, "-m", "kuberl", "status", JOB, "-n", ns], capture_output=True,
                                  text=True, env=env, timeout=120)
    print(f"trained in {t1 - t0:.0f} s; pods {first['metadata']['name']}, {second['metadata']['name']}, "
          f"{third['metadata']['name']}")
    return {**out, "first": first, "second": second, "third": third, "folder": folder, "seconds": t1 - t0}


def test_a_claim_of_a_pod_on_a_simulated_gpu_node_gets_a_host_path_volume(node: RealNode):
    """The real node's local volumes are in the default class, which binds a claim once its pod
    is scheduled: a pod on kwok's GPU node gets a hostPath volume, not one it cannot reach."""
    ns = "gpuclaim"
    node.kube.run("create", "namespace", ns)
    node.kube.apply([
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c", "namespace": ns},
         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
         "spec": {"nodeSelector": {"kubernetes.io/hostname": "mi300x-0"}, "tolerations": [{"operator": "Exists"}],
                  "containers": [{"name": "c", "image": "x", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                  "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]}},
    ])  # fmt: skip
    volume = wait_for(lambda: node.kube.json("get", "pvc", "c", "-n", ns)["spec"].get("volumeName"), 120,
                      lambda: node.kube.run("describe", "pvc", "c", "-n", ns, check=False).stdout[-1500:])
    assert "hostPath" in node.kube.json("get", "pv", volume)["spec"]
    # the scheduler binds the pod once its claim is bound
    wait_for(lambda: node.kube.json("get", "pod", "p", "-n", ns)["spec"].get("nodeName") == "mi300x-0", 60,
             "the pod bound to the GPU node")


def test_the_quickstart_reaches_succeeded_in_a_trainer_pod_on_the_real_node(run: dict):
    assert run["status"]["phase"] == "Succeeded", run["status"]
    for pod in (run["first"], run["second"], run["third"]):
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert pod["spec"]["containers"][0]["image"] == "ghcr.io/kuberl/trainer:0.1.0-cpu"
    # the trainer called the pool's pods through their Service: its RL steps made tool calls
    rl = [r for r in records(run["folder"]) if r["type"] == "rl"]
    assert rl and all(sum(v for k, v in r.items() if k.startswith("tool_calls_")) > 0 for r in rl), rl


def test_kuberl_status_follows_the_job_on_the_cluster(run: dict):
    shown = run["shown"]
    assert shown.returncode == 0, shown.stderr
    assert "Succeeded" in shown.stdout and JOB in shown.stdout, shown.stdout


def test_the_checkpoints_are_on_the_jobs_claim(run: dict):
    folder = run["folder"]
    names = sorted(p.name for p in folder.iterdir())
    assert "metrics.jsonl" in names and "events.jsonl" in names, names
    assert any(n.startswith("step") or "ckpt" in n for n in names), names
    owner = {p.stat().st_gid for p in folder.iterdir()}
    assert owner == {65532}, owner  # written by the trainer's fsGroup, not root


def _stopped_at(log: str) -> int:
    return int(log.rsplit("stopped by SIGTERM after global step ", 1)[1].split(";")[0])


def _resumed(run: dict, stopped: str, resumed: str, after: int) -> int:
    """The global step at which the pod whose log is ``run[stopped]`` stopped with a checkpoint
    (after ``after``, before the end), where the next pod (``run[resumed]``) resumed."""
    at = _stopped_at(run[stopped])
    assert after < at < STEPS, run[stopped][-1500:]
    assert f"at global step {at}" in run[resumed], run[resumed][:3000]
    events = records(run["folder"], "events.jsonl")
    assert any(e["kind"] == "resume" and f"resumed at global step {at}" in e["text"] for e in events), events[-5:]
    return at


def test_a_deleted_trainer_pod_is_replaced_and_resumes_from_its_checkpoint(run: dict):
    _resumed(run, "stopped", "second_stopped", SFT)


def test_kueue_preempts_the_job_and_readmits_it_where_its_checkpoint_left_off(run: dict):
    st = run["preempted"]
    suspended = next(c for c in st["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True" and suspended["reason"] == "Preempted", suspended
    conditions = {c["type"]: c for c in run["workload"]["status"]["conditions"]}
    assert conditions.get("Evicted", {}).get("reason") == "Preempted", conditions
    assert conditions["QuotaReserved"]["status"] == "False", conditions
    row = next(line.split() for line in run["suspended_table"].splitlines() if line.startswith(JOB))
    assert row[1:4] == ["Suspended", LOCAL_QUEUE, "Preempted"], run["suspended_table"]
    assert run["suspended_trainer"]["spec"]["suspend"] is True
    # the preempted pod checkpointed at its step boundary; the re-admitted one resumed there
    _resumed(run, "second_stopped", "resumed_again", _stopped_at(run["stopped"]))


def test_every_step_is_trained_once_across_both_interruptions(run: dict):
    steps = [r["step"] for r in records(run["folder"]) if r["type"] in ("sft", "rl")]
    assert steps == list(range(1, STEPS + 1)), steps  # no step twice, none missing


def test_prometheus_scraped_the_trainer_pods(run: dict):
    by_pod: dict[str, list[float]] = {}
    for series in run["steps"]:
        by_pod.setdefault(series["metric"].get("pod", "?"), []).extend(float(v) for _, v in series["values"])
    pods = [run[k]["metadata"]["name"] for k in ("first", "second", "third")]
    assert set(by_pod) == set(pods), by_pod.keys()
    assert max(by_pod[pods[2]]) == STEPS, by_pod
    assert min(by_pod[pods[1]]) >= max(by_pod[pods[0]]) and min(by_pod[pods[2]]) >= max(by_pod[pods[1]]), by_pod
