"""An elastic RolloutFleet under a training run, end to end on a real control plane; run by
tests/test_elastic_fleet.py inside a network namespace of its own (``unshare -n``):

1. a control plane (``kuberl cluster up``) whose simulated pods take IPs from POD_RANGE, routed to
   this namespace's loopback, and ``kuberl operator`` under the chart's RBAC;
2. a RolloutFleet of one vLLM engine; each engine pod kwok runs gets a real vLLM server on its
   pod IP (tests/process_kubelet.py), so the trainer's discovery (EndpointSlices) reaches it;
3. per mode (synchronous, then asyncLevel 1): ``kuberl run`` trains on the fleet; after its
   first RL step ``kubectl scale rolloutfleet --replicas=2``; once the trainer has rolled out a
   step on two engines, ``--replicas=1`` while the next step generates; a step later the run
   is stopped by SIGTERM, as an eviction stops it (its step budget only bounds it: a new
   engine's start-up time decides how many steps the scenario takes).

Prints one JSON line: per mode the run's exit code, its RL step records, and what the stand-in
kubelet saw of each engine pod (serving, leaving, how long its drain hook held it).

    unshare -n python tests/elastic_fleet_driver.py --model DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "harness"))

from k8s_fixtures import Kube, Operator, install_chart_rbac, new_namespace, wait_for  # noqa: E402
from process_kubelet import ProcessKubelet  # noqa: E402

from kuberl.api.rollout_fleet import RolloutFleet  # noqa: E402
from kuberl.cluster.control_plane import down, up  # noqa: E402
from kuberl.cluster.nodes import default_pools  # noqa: E402
from kuberl.operator.render.builders import engine_selector  # noqa: E402
from kuberl.rollout.vllm_server import VLLMServer, VLLMServerConfig  # noqa: E402
from kuberl.util.lifetime import exit_on_signals, reap_on_exit  # noqa: E402

POD_RANGE = "198.18.0.0/16"  # RFC 2544's benchmarking range: never routed anywhere else
FLEET = "engines"
STEPS = 200  # a bound only: the driver stops the run once the scenario is done
STEPS_AFTER_SCALE_DOWN = 1
SCALE_UP_AFTER_STEP = 1
SIGTERM_EXIT = 128 + 15  # kuberl run stopped by SIGTERM (kuberl.util.lifetime.exit_on_signals)


def route_pod_range() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "route", "add", "local", POD_RANGE, "dev", "lo"], check=True)


def fleet_manifest(namespace: str, model: str) -> dict:
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": namespace},
        "spec": {"replicas": 1, "model": {"uri": model}, "engine": {"type": "vllm", "port": 8000},
                 "accelerator": {"profile": "cpu", "count": 1}},
    }  # fmt: skip


def job_manifest(name: str, model: str, async_level: int) -> dict:
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "AgenticRLJob", "metadata": {"name": name},
        "spec": {
            "model": {"base": model},
            "data": {"train": "builtin:arith"},
            "algorithm": {"groupSize": 2, "oversample": 2, "batchPrompts": 4, "learningRate": 1e-5,
                          "miniBatches": 1, "asyncLevel": async_level},
            "rollout": {"engine": "vllm", "maxTurns": 2, "maxResponseTokens": 96, "promptTemplate": "compact"},
            "sandbox": {"pool": {"replicas": 1, "workersPerPod": 1, "limits": {"timeoutSeconds": 5, "memoryMB": 512}}},
            "stages": [{"name": "rl", "type": "rl", "steps": STEPS}],
            "trainer": {"device": "cpu", "threads": 1},
            "checkpoint": {"uri": "checkpoints", "everySteps": 100, "keep": 1},
        },
    }  # fmt: skip


def rl_records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("type") == "rl":
            out.append(rec)
    return out


def train_while_scaling(kube: Kube, ns: str, kubelet: ProcessKubelet, model: str, out: Path, async_level: int,
                        env: dict[str, str]) -> dict:
    name = f"elastic-a{async_level}"
    folder = out / name
    folder.mkdir(parents=True)
    manifest = folder / "job.yaml"
    manifest.write_text(yaml.safe_dump(job_manifest(name, model, async_level)))
    metrics = folder / "run" / "metrics.jsonl"
    log = (folder / "run.log").open("w")
    run = subprocess.Popen([sys.executable, "-P", "-m", "kuberl", "run", str(manifest), "--out", str(folder / "run")],
                           cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    reap_on_exit([run.pid])  # this driver killed (a test timeout): the run goes too
    marks: dict[str, float | int] = {}

    def scale(replicas: int) -> None:
        kube.run("scale", f"rolloutfleet/{FLEET}", "-n", ns, f"--replicas={replicas}")

    def steps(n: int) -> bool:
        if run.poll() is not None:
            raise AssertionError(f"kuberl run ended ({run.returncode}) before step {n}: see {folder / 'run.log'}")
        return len(rl_records(metrics)) >= n

    try:
        wait_for(lambda: steps(SCALE_UP_AFTER_STEP), 900, "the run's first RL step", interval=0.5)
        scale(2)
        marks["scaled_up_after_step"] = SCALE_UP_AFTER_STEP
        marks["scaled_up_at"] = time.monotonic()

        def two_engines() -> bool:
            recs = rl_records(metrics)
            return steps(1) and any(r.get("engines_in_service") == 2 for r in recs)

        wait_for(two_engines, 900, "a step rolled out on two engines", interval=0.5)
        n = len(rl_records(metrics))
        wait_for(lambda: steps(n + 1), 600, "the step after the first on two engines", interval=0.2)
        time.sleep(2.0)  # into the next step's generation
        scale(1)
        marks["scaled_down_after_step"] = n + 1
        marks["scaled_down_at"] = time.monotonic()
        wait_for(lambda: steps(n + 1 + STEPS_AFTER_SCALE_DOWN), 900, "a step after the scale-down", interval=0.2)
        run.terminate()
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        log.close()
    return {"exit": run.returncode, "records": rl_records(metrics), "marks": marks,
            "log_tail": (folder / "run.log").read_text(errors="replace")[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="0,1", help="asyncLevels to run, in order")
    args = ap.parse_args()
    out = Path(args.out)
    route_pod_range()
    state = up(out / "cluster", pools=default_pools(mi300x=0, h100=0, cpu=1), pod_cidr=POD_RANGE)
    reap_on_exit(state.pids.values())  # the control plane outlives no driver, however it ends
    operator = None
    result: dict = {"modes": {}}
    try:
        kube = Kube(state)
        operator = Operator(kube, install_chart_rbac(kube), out)
        operator.start()
        reap_on_exit([operator.proc.pid])
        ns = new_namespace(kube, "elastic")
        fleet = fleet_manifest(ns, args.model)
        kube.apply([fleet])
        selector = ",".join(f"{k}={v}" for k, v in engine_selector(RolloutFleet.model_validate(fleet)).items())

        on_core: dict[int, list[VLLMServer]] = {c: [] for c in range(os.cpu_count() or 1)}

        def start_engine(pod: dict, ip: str, port: int) -> VLLMServer:
            # each engine's threads on a core of its own, as each pod has its CPUs: unbound (or
            # on the core a serving engine holds) a busy engine's spinning threads starve a new
            # one's start-up on a 2-core machine; which engine a scale-down removes is the
            # ReplicaSet's choice, so the new one takes the core fewest live engines hold
            core = min(on_core, key=lambda c: sum(s.proc is None or s.alive() for s in on_core[c]))
            server = VLLMServer(VLLMServerConfig(model=args.model, host=ip, port=port, dtype="float32",
                                                 max_model_len=1024, kv_cache_gib=0.5, cpus=str(core)),
                                log_path=out / f"{pod['metadata']['name']}.log")
            on_core[core].append(server)
            server.start(timeout=900)
            return server

        env = {**os.environ, "KUBECONFIG": str(state.kubeconfig), "KUBERL_ROLLOUT_FLEET": FLEET,
               "KUBERL_NAMESPACE": ns, "KUBERL_ROLLOUT_ENGINE": "vllm", "KUBERL_ROLLOUT_RESYNC_S": "2",
               "KUBERL_WEIGHTS_DIR": str(out / "weights"), "KUBERL_NO_RAY": "1"}
        with ProcessKubelet(lambda: kube.items("pods", ns, selector), start_engine) as kubelet:
            wait_for(lambda: kubelet.serving(), 900, "the fleet's first engine serving", interval=1)
            for level in (int(x) for x in args.modes.split(",")):
                first, mode_start = set(kubelet.pods), time.monotonic()
                mode = train_while_scaling(kube, ns, kubelet, args.model, out, level, env)
                wait_for(lambda: len(kubelet.serving()) == 1, 400, "the fleet back at one engine", interval=1)
                wait_for(lambda: all(p.stopped_at for p in kubelet.pods.values() if p.leaving_at), 400,
                         "the engine that left drained and stopped", interval=1)
                mode["pods"] = [
                    {"name": p.name, "ip": p.ip, "error": p.error, "new": p.name not in first,
                     "serving_s": None if p.serving_at is None else p.serving_at - p.started_at,
                     "left": p.leaving_at is not None, "drained_s": p.drained_s,
                     "stopped": p.stopped_at is not None,
                     "left_after_scale_down_s": None if p.leaving_at is None or "scaled_down_at" not in mode["marks"]
                     else p.leaving_at - mode["marks"]["scaled_down_at"]}
                    for p in kubelet.pods.values()
                    if p.name not in first or (p.leaving_at is not None and p.leaving_at >= mode_start)
                ]
                mode["marks"] = {k: v for k, v in mode["marks"].items() if not k.endswith("_at")}
                result["modes"][str(level)] = mode
    finally:
        if operator is not None:
            operator.stop()
        down(out / "cluster")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    with exit_on_signals():  # a timeout's SIGTERM still takes the cluster down (main's finally)
        raise SystemExit(main())
