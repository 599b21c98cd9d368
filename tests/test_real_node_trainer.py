"""examples/quickstart.yaml trains in real pods (issue 38 item 3d; issue 39's resume in a real pod):
the operator as a pod (tests/test_real_node_operator.py's install) renders the trainer Job, whose
pod runs ``ghcr.io/kuberl/trainer:0.1.0-cpu`` on the real node in a PodSecurity-restricted
namespace and calls the job's SandboxPool pods through their Service. The run is the quickstart
with its stages shortened (SFT 20 steps, RL 4, a checkpoint every 2 steps). Its trainer pod is
deleted once an RL checkpoint is on the claim: it stops at a step boundary with a checkpoint
(exit 143), the Job replaces it, and the new pod resumes there. The job reaches Succeeded,
``kuberl status`` follows it, the checkpoints and step records are on the claim's host folder
(each step once, none missing), and a real Prometheus that finds the trainer pods as the chart's
PodMonitor does scraped both pods' steps. Needs what the real node needs, buildah and
debootstrap (the images are built the first time) and Debian's ``prometheus``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fixtures import wait_for
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
    wait_phase,
)

from kuberl.cluster.pki import NODE_NAME

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parent.parent
SFT, RL, EVERY = 20, 4, 2
STEPS = SFT + RL


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    yield from start(tmp_path_factory.mktemp("trainernode"))


@pytest.fixture(scope="module")
def run(node: RealNode, tmp_path_factory) -> dict:
    """The shortened quickstart applied and trained to the end, its first trainer pod deleted
    after the first RL checkpoint; what each step saw."""
    if shutil.which("prometheus") is None:
        require_or_skip("Debian's prometheus is not installed (apt-get install prometheus)")
    for name in ("sandbox", "operator", "trainer-cpu"):
        t = time.monotonic()
        load_images(node, [name], REPO)  # built or reused, loaded unless the node's root has it
        print(f"{name}: built or reused and in the node's containerd in {time.monotonic() - t:.1f} s")
    install_operator(node)
    tmp = tmp_path_factory.mktemp("trainerrun")
    ns = restricted_namespace(node.kube, "qs")
    kube = node.kube
    with prometheus(node, ns, tmp / "prometheus") as prom:
        t0 = time.time()
        kube.apply([quickstart(ns, SFT, RL, EVERY)])
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
        stopped = first_log.wait(330)  # the trainer's grace: it ends its step and checkpoints
        second = running_trainer(kube, ns, 300, not_named=first["metadata"]["name"])
        second_log = LogFollower(kube, ns, second["metadata"]["name"], tmp / "second.log")
        status = wait_phase(kube, ns, {"Succeeded", "Failed"}, 900)
        resumed = second_log.wait(60)
        t1 = time.time()
        time.sleep(4)  # the last scrape of the finished pod is in
        steps = query_range(prom, f'kuberl_train_step{{job="{JOB}",stage="rl"}}', t0, time.time())
    env = dict(os.environ, KUBECONFIG=str(kube.kubeconfig))
    shown = subprocess.run([sys.executable, "-m", "kuberl", "status", JOB, "-n", ns], capture_output=True,
                           text=True, env=env, timeout=120)
    print(f"trained in {t1 - t0:.0f} s; first pod {first['metadata']['name']}, second {second['metadata']['name']}")
    return {"ns": ns, "status": status, "first": first, "second": second, "stopped": stopped, "resumed": resumed,
            "folder": folder, "steps": steps, "shown": shown, "seconds": t1 - t0}


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
    for pod in (run["first"], run["second"]):
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


def test_a_deleted_trainer_pod_is_replaced_and_resumes_from_its_checkpoint(run: dict):
    stopped, resumed = run["stopped"], run["resumed"]
    at = int(stopped.rsplit("stopped by SIGTERM after global step ", 1)[1].split(";")[0])
    assert SFT < at < STEPS, stopped[-1500:]
    assert f"at global step {at}" in resumed, resumed[:3000]
    events = records(run["folder"], "events.jsonl")
    assert any(e["kind"] == "resume" and f"resumed at global step {at}" in e["text"]
               for e in events), events[-5:]
    steps = [r["step"] for r in records(run["folder"]) if r["type"] in ("sft", "rl")]
    assert steps == list(range(1, STEPS + 1)), steps  # no step twice, none missing


def test_prometheus_scraped_the_trainer_pods(run: dict):
    by_pod: dict[str, list[float]] = {}
    for series in run["steps"]:
        by_pod.setdefault(series["metric"].get("pod", "?"), []).extend(float(v) for _, v in series["values"])
    first, second = run["first"]["metadata"]["name"], run["second"]["metadata"]["name"]
    assert set(by_pod) == {first, second}, by_pod.keys()
    assert max(by_pod[second]) == STEPS and min(by_pod[second]) >= max(by_pod[first]), by_pod
