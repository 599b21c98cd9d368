"""Benchmark: a real-model run whose vLLM server is killed, and what the kill costs.

Runs a small GRPO job on SmolLM2-135M-Instruct served by a local vLLM server (the path of
``kuberl run`` with ``spec.rollout.engine: vllm``), once undisturbed and once per kill point,
synchronous and asynchronous (asyncLevel 1). A kill is SIGKILL of the server's process group
(API process and engine core), as an OOM kill or a lost node would end it:

* ``between-steps``: as soon as step 2's record is written (the next push and rollouts find the
  server gone);
* ``mid-generation``: once step 2 is recorded and the server reports running requests.

Reported per run: steps trained, rollouts generated / aborted / stale, the engine fault
counters of the step records (reconnects, version mismatches, re-pushes) and the time lost:
the run's RL seconds minus the undisturbed run's.

``--trainer-kills``: the trainer itself SIGKILLed at a point of step 2 or 3 (harness/kill_during.py:
``generate``, ``reload`` (its weight push, the server reloading), ``publish`` (the weights
folder half written), ``update``, ``checkpoint`` (the file half written), ``step`` (between
steps 2 and 3)), its server and sandbox ending with it, then the same command run again,
resuming from its last checkpoint (every step). Reported: the steps recorded (each once),
rollouts, and the time lost: both processes' wall time minus an undisturbed process's (the
restart's new server included, as a restarted trainer pod pays it).

    python bench/fault_injection.py [--steps 4] [--modes sync,async] [--kills between-steps,mid-generation]
                                    [--trainer-kills generate,reload,publish,update,checkpoint,step]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kuberl.trainer.report import load_run
from kuberl.trainer.step_record import StepRecord

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "harness"))

KV_BYTES = 1 << 30  # the run's own server (local_vllm_config's 1 GiB KV cache) is found by it


def job_spec(model: str, steps: int, async_level: int) -> dict:
    return {
        "metadata": {"name": "faults"},
        "spec": {
            "model": {"base": model},
            "data": {"train": "builtin:arith"},
            "algorithm": {
                "groupSize": 2, "oversample": 1, "batchPrompts": 4, "learningRate": 1e-5,
                "miniBatches": 1, "asyncLevel": async_level,
            },
            "rollout": {"engine": "vllm", "maxTurns": 1, "maxResponseTokens": 64, "promptTemplate": "compact"},
            "stages": [{"name": "rl", "type": "rl", "steps": steps}],
            "trainer": {"device": "cpu", "threads": 1},
            "checkpoint": {"uri": "ckpt", "everySteps": 100, "keep": 1},
        },
    }  # fmt: skip


def server_pids() -> list[tuple[int, int]]:
    """(pid, port) of this run's vLLM API server."""
    out = subprocess.run(
        ["pgrep", "-af", f"api_server.*kv-cache-memory-bytes {KV_BYTES}"], capture_output=True, text=True
    ).stdout
    found = []
    for line in out.splitlines():
        port = re.search(r"--port (\d+)", line)
        if port:
            found.append((int(line.split()[0]), int(port.group(1))))
    return found


def running_requests(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} (\S+)", text, re.M))


def killer(metrics: Path, kill: str, steps_before: int, done: threading.Event, log: list[str]) -> None:
    """Wait for ``steps_before`` RL records, then (for mid-generation: once requests run) kill."""
    while not done.is_set():
        records = metrics.read_text().count('"type": "rl"') if metrics.exists() else 0
        if records >= steps_before:
            servers = server_pids()
            if servers and (kill == "between-steps" or running_requests(servers[0][1]) > 0):
                for pid, _ in servers:
                    try:
                        os.killpg(os.getpgid(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    log.append(f"{time.strftime('%H:%M:%S')} SIGKILL vLLM server pid {pid} after {records} steps")
                return
        time.sleep(0.05)


def one_run(model: str, steps: int, async_level: int, kill: str | None) -> dict:
    from kuberl.api.job import AgenticRLJob
    from kuberl.trainer.local import run_job

    job = AgenticRLJob.model_validate(job_spec(model, steps, async_level))
    with tempfile.TemporaryDirectory(prefix="kuberl-faults-") as tmp:
        out = Path(tmp) / "run"
        done, log = threading.Event(), []
        t = None
        if kill:
            t = threading.Thread(target=killer, args=(out / "metrics.jsonl", kill, 2, done, log), daemon=True)
            t.start()
        t0 = time.monotonic()
        result = run_job(job, out, use_ray=True, quiet=True)
        wall = time.monotonic() - t0
        done.set()
        if t is not None:
            t.join(timeout=5)
    rl = [h for h in result.history if h.type == "rl"]
    return {
        "kill": kill or "none",
        "async_level": async_level,
        "killed": log,
        **accounted(rl),
        "step_seconds": [round(h.step_seconds, 1) for h in rl],
        "rl_seconds": sum(h.step_seconds for h in rl),
        "wall_seconds": wall,
    }


def accounted(rl: list[StepRecord]) -> dict:
    """What a run's RL step records say of its rollouts: steps, rollouts, aborted, stale, faults."""
    return {
        "steps": [h.step for h in rl],
        "rollouts": sum(h.rollouts for h in rl),
        "aborted": sum(h.rollouts_aborted or 0 for h in rl),
        "stale": sum(h.rollouts_stale or 0 for h in rl),
        "engine_reconnects": sum(h.engine_reconnects or 0 for h in rl),
        "engine_version_mismatches": sum(h.engine_version_mismatches or 0 for h in rl),
        "engine_repushes": sum(h.engine_repushes or 0 for h in rl),
    }


def mode_label(async_level: int) -> str:
    return "sync" if async_level == 0 else f"async{async_level}"


KILL = REPO / "harness" / "kill_during.py"
# the kill_during.py count that lands in step 2 or 3 of a run of 4 prompts x 2 samples, one turn
# (update: the run's 2nd optimizer step; a step whose groups all tie has none)
TRAINER_KILL_AT = {"generate": 20, "reload": 3, "publish": 3, "update": 2, "checkpoint": 3, "step": 2}


def trainer_run(model: str, steps: int, async_level: int, point: str | None) -> dict:
    """The run as its own process, SIGKILLed at ``point`` (None: undisturbed) and run again."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="kuberl-trainer-kill-") as tmp:
        doc = job_spec(model, steps, async_level)
        doc.update(apiVersion="kuberl.io/v1alpha1", kind="AgenticRLJob")
        doc["spec"]["checkpoint"] = {"uri": str(Path(tmp) / "ckpt"), "everySteps": 1, "keep": 2}
        job, out = Path(tmp) / "job.yaml", Path(tmp) / "run"
        job.write_text(yaml.safe_dump(doc))
        walls, codes = [], []
        for kill in ([point] if point else []) + [None]:
            at = TRAINER_KILL_AT[kill] if kill else 0
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, str(KILL), kill or "update", str(at), str(job), str(out)],
                                  capture_output=True, text=True, timeout=1200)  # fmt: skip
            walls.append(time.monotonic() - t0)
            codes.append(done.returncode)
            if done.returncode not in (0, -signal.SIGKILL):
                raise SystemExit(f"trainer run {kill or 'resume'} failed ({done.returncode}): {done.stderr[-2000:]}")
        rl = [r for r in load_run(out)[0] if r.type == "rl"]
    return {
        "kill": f"trainer {point}" if point else "none",
        "async_level": async_level,
        "exit_codes": codes,
        **accounted(rl),
        "wall_seconds": sum(walls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--kills", default="between-steps,mid-generation")
    ap.add_argument("--trainer-kills", default="", help=f"comma-separated of {','.join(TRAINER_KILL_AT)}")
    ap.add_argument("--json", type=Path, help="write the runs' figures here too")
    args = ap.parse_args()
    from vllm_fixtures import prepared_model

    model = str(prepared_model())
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.2f} at start; {args.steps} RL steps per run")
    runs: list[dict] = []
    trainer_runs: list[dict] = []
    for mode in args.modes.split(","):
        level = {"sync": 0, "async": 1}[mode]
        kills = list(filter(None, args.kills.split(",")))
        if kills:
            base = one_run(model, args.steps, level, None)
            runs.append(base)
        for kill in kills:
            r = one_run(model, args.steps, level, kill)
            r["seconds_lost"] = r["rl_seconds"] - base["rl_seconds"]
            runs.append(r)
        points = list(filter(None, args.trainer_kills.split(",")))
        if points:
            whole = trainer_run(model, args.steps, level, None)
            trainer_runs.append(whole)
            for point in points:
                r = trainer_run(model, args.steps, level, point)
                r["seconds_lost"] = r["wall_seconds"] - whole["wall_seconds"]
                trainer_runs.append(r)
    if runs:
        print(
            f"\n{'mode':6} {'kill':15} {'steps':>9} {'rollouts':>8} {'aborted':>7} {'stale':>5} "
            f"{'reconn':>6} {'mismatch':>8} {'repush':>6} {'RL s':>6} {'lost s':>6}  step seconds"
        )
    for r in runs:
        mode = mode_label(r["async_level"])
        lost = f"{r['seconds_lost']:6.1f}" if "seconds_lost" in r else "     -"
        print(
            f"{mode:6} {r['kill']:15} {','.join(map(str, r['steps'])):>9} {r['rollouts']:8.0f} {r['aborted']:7.0f} "
            f"{r['stale']:5.0f} {r['engine_reconnects']:6.0f} {r['engine_version_mismatches']:8.0f} "
            f"{r['engine_repushes']:6.0f} {r['rl_seconds']:6.1f} {lost}  {r['step_seconds']}"
        )
        for line in r["killed"]:
            print(f"       {line}")
    if trainer_runs:
        print(
            f"\n{'mode':6} {'kill':18} {'exits':>9} {'steps':>9} {'rollouts':>8} {'aborted':>7} {'stale':>5} "
            f"{'reconn':>6} {'mismatch':>8} {'repush':>6} {'wall s':>7} {'lost s':>6}"
        )
    for r in trainer_runs:
        mode = mode_label(r["async_level"])
        lost = f"{r['seconds_lost']:6.1f}" if "seconds_lost" in r else "     -"
        print(
            f"{mode:6} {r['kill']:18} {','.join(map(str, r['exit_codes'])):>9} {','.join(map(str, r['steps'])):>9} "
            f"{r['rollouts']:8.0f} {r['aborted']:7.0f} {r['stale']:5.0f} {r['engine_reconnects']:6.0f} "
            f"{r['engine_version_mismatches']:8.0f} {r['engine_repushes']:6.0f} {r['wall_seconds']:7.1f} {lost}"
        )
    if args.json:
        args.json.write_text(json.dumps(runs + trainer_runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
