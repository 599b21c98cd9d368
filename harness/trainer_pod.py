"""examples/quickstart.yaml in real pods (harness/node_fixtures.py's node, harness/operator_pod.py's
operator): the manifest applied as it is or shortened, the trainer pod's log followed across
pods, what the run left on the job's checkpoint volume read on the host, and a real Prometheus
that finds the trainer pod as the chart's PodMonitor would. Shared by
tests/test_real_node_trainer.py and bench/quickstart_pods.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml
from k8s_fixtures import Kube, wait_for
from node_fixtures import RealNode
from prometheus_proc import prometheus_process

from kuberl.operator.render.trainer_runs import checkpoint_claim_name

REPO = Path(__file__).resolve().parent.parent
JOB = "quickstart"
TRAINER_SELECTOR = f"app.kubernetes.io/component=trainer,app.kubernetes.io/instance={JOB}"


def quickstart(namespace: str, sft_steps: int | None = None, rl_steps: int | None = None,
               every: int | None = None) -> dict:
    """examples/quickstart.yaml in ``namespace``; with step counts, its stages and checkpoint
    interval shortened (nothing else changes)."""
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    stages = {s["type"]: s for s in doc["spec"]["stages"]}
    if sft_steps is not None:
        stages["sft"]["steps"] = sft_steps
    if rl_steps is not None:
        stages["rl"]["steps"] = rl_steps
    if every is not None:
        doc["spec"]["checkpoint"]["everySteps"] = every
    return doc


def job_status(kube: Kube, namespace: str) -> dict:
    return kube.json("get", "agenticrljob", JOB, "-n", namespace).get("status") or {}


def trainer_pods(kube: Kube, namespace: str) -> list[dict]:
    return kube.items("pods", namespace, TRAINER_SELECTOR)


def claim_folder(kube: Kube, namespace: str) -> Path:
    """The host folder behind the job's checkpoint claim (the node's local volume)."""
    claim = kube.json("get", "pvc", checkpoint_claim_name(JOB), "-n", namespace)
    pv = kube.json("get", "pv", claim["spec"]["volumeName"])
    return Path(pv["spec"]["local"]["path"])


def records(folder: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The run's step records (or events) kept beside its checkpoints; a last line being written
    as this reads is left out."""
    path = folder / name
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


class LogFollower:
    """``kubectl logs -f`` of one pod into a file, from before anything happens to it."""

    def __init__(self, kube: Kube, namespace: str, pod: str, path: Path):
        self.path = path
        self._out = path.open("w")
        self._proc = subprocess.Popen([kube.binary, f"--kubeconfig={kube.kubeconfig}", "logs", "-f", pod,
                                       "-n", namespace], stdout=self._out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def wait(self, timeout: float) -> str:
        """The whole log once the pod's container has ended (kubectl returns then)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)
        self._out.close()
        return self.text()


def running_trainer(kube: Kube, namespace: str, timeout: float, not_named: str | None = None) -> dict:
    """The trainer pod once its container runs (another than ``not_named``, a deleted one)."""
    def probe() -> dict | None:
        for pod in trainer_pods(kube, namespace):
            state = ((pod.get("status", {}).get("containerStatuses") or [{}])[0]).get("state", {})
            if pod["metadata"]["name"] != not_named and ("running" in state or "terminated" in state):
                return pod
        return None

    return wait_for(probe, timeout, lambda: kube.run("describe", "pods", "-n", namespace, "-l", TRAINER_SELECTOR,
                                                     check=False).stdout[-3000:], interval=1.0)


# The chart's trainer PodMonitor's selector (charts/kuberl/templates/monitors.yaml): rank 0 of
# kuberl's trainer Jobs, scraped at its `metrics` port.
POD_MONITOR = "app.kubernetes.io/managed-by=kuberl,app.kubernetes.io/component=trainer,batch.kubernetes.io/job-completion-index=0"


def scrape_targets(pods: list[dict]) -> list[dict]:
    """Prometheus file_sd targets of the running pods' `metrics` ports, labelled with the pod."""
    out = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip or pod["status"].get("phase") != "Running":
            continue
        for c in pod["spec"]["containers"]:
            for port in c.get("ports") or []:
                if port.get("name") == "metrics":
                    out.append({"targets": [f"{ip}:{port['containerPort']}"],
                                "labels": {"pod": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"]}})
    return out


def _discover(kube: Kube, namespace: str, path: Path, stop: threading.Event) -> None:
    """What Prometheus' Kubernetes discovery would do (Debian's build leaves it out): the pods the
    PodMonitor selects, written as file_sd targets whenever they change."""
    last = None
    while not stop.wait(1.0):
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired, ValueError):
            targets = scrape_targets(kube.items("pods", namespace, POD_MONITOR))
            if targets != last:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(targets))
                tmp.rename(path)  # Prometheus reads whole files only
                last = targets


@contextlib.contextmanager
def prometheus(node: RealNode, namespace: str, folder: Path) -> Iterator[str]:
    """Debian's Prometheus on the host scraping the trainer pods every 2 s, found through the API
    server as the chart's trainer PodMonitor selects them; its base URL."""
    folder.mkdir(parents=True, exist_ok=True)
    targets = folder / "trainers.json"
    targets.write_text("[]")
    config = {"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
              "scrape_configs": [{"job_name": "kuberl-trainer", "honor_labels": True,
                                  "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "2s"}]}]}
    stop = threading.Event()
    finder = threading.Thread(target=_discover, args=(node.kube, namespace, targets, stop), daemon=True)
    finder.start()
    try:
        with prometheus_process(folder, config, ready_timeout=60) as base:
            yield base
    finally:
        stop.set()
        finder.join(10)


def query_range(base: str, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_phase(kube: Kube, namespace: str, phases: set[str], timeout: float) -> dict:
    return wait_for(lambda: (s := job_status(kube, namespace)).get("phase") in phases and s, timeout,
                    lambda: json.dumps(job_status(kube, namespace))[-1500:], interval=2.0)


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.0f} s"
