"""A trainer SIGKILLed during a weight push to a real vLLM server, then resumed (issue 30 item 5).

The push is the one place a kill leaves two sides half-changed: the trainer's weights folder on
disk and the server's loaded weights. Two kills, each the run's second push (version 1, at the
start of RL step 2; step 1's checkpoint is on disk):

* synchronous: while the server loads it (the transfer of a shared-memory slot sent, the
  server paused);
* asyncLevel 1: half-way through writing it, on the background push's thread: a shared-memory
  slot (``kuberl run``'s default for its local server) and, with ``KUBERL_VLLM_SHM=0``, a
  checkpoint folder (what fleets load).

The killed trainer's vLLM server and sandbox end with it. The same command run again resumes
from step 1's checkpoint on a new server: every step is trained and recorded once, every
rollout comes back, none from weights the server was never given, the half-written weights are
never served, and the dead run's shared memory is given back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

from vllm_fixtures import marked_processes, small_rl_job, vllm_available  # noqa: E402

from kuberl.rollout.vllm_engine import check_weights_folder  # noqa: E402
from kuberl.rollout.vllm_shm import MANIFEST  # noqa: E402

pytestmark = pytest.mark.timeout(900)

KILL = Path(__file__).resolve().parents[1] / "harness" / "kill_during.py"


def _run(point: str, at: int, job: Path, out: Path, token: str, shm: bool) -> subprocess.CompletedProcess:
    # the server paused in the killed reload ignores SIGTERM: its group goes after this grace
    env = {**os.environ, "KUBERL_TEST_RUN": token, "KUBERL_VLLM_STOP_GRACE_S": "5", "KUBERL_VLLM_SHM": str(int(shm))}
    return subprocess.run([sys.executable, str(KILL), point, str(at), str(job), str(out)],
                          capture_output=True, text=True, timeout=800, env=env)  # fmt: skip


def _gone(token: str, within_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := marked_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _slot_roots(name: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"kuberl-weights-{name}-{os.getuid()}-*"))


@pytest.mark.parametrize(
    ("async_level", "point", "shm"), [(0, "reload", True), (1, "publish", True), (1, "publish", False)]
)
def test_a_trainer_killed_during_a_weight_push_resumes_and_trains_each_step_once(
    smollm2_dir, tmp_path, async_level, point, shm
):
    vllm_available()
    name = f"push-kill-{async_level}-{'shm' if shm else 'disk'}"
    doc = small_rl_job(smollm2_dir, tmp_path / "ckpt", name, async_level=async_level,
                       every_steps=1, keep=2, max_turns=2)  # fmt: skip
    job, out, token = tmp_path / "job.yaml", tmp_path / "run", uuid.uuid4().hex
    job.write_text(yaml.safe_dump(doc))
    killed = _run(point, 2, job, out, token, shm)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    # the server (API process and engine core) and the sandbox ended with the trainer
    assert _gone(token) == [], "processes outlived the killed trainer"
    before = [r for r in _lines(out / "metrics.jsonl") if r["type"] == "rl"]
    assert [r["step"] for r in before] == [1], before  # killed in step 2's push
    weights = out / "weights" / name
    if point == "publish" and shm:
        slots = [s for root in _slot_roots(name) for s in root.iterdir()]
        assert any(not (s / MANIFEST).exists() for s in slots), slots  # the half-copied slot: no manifest
    elif point == "publish":
        torn = list(weights.glob(".tmp-*"))
        assert torn, sorted(p.name for p in weights.iterdir())  # half a folder, never renamed

    resumed = _run(point, 0, job, out, token, shm)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _gone(token) == []
    rl = [r for r in _lines(out / "metrics.jsonl") if r["type"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3], rl  # no step skipped or trained twice
    assert all(r["rollouts"] == 4 and r["rollouts_aborted"] == 0 and r["rollouts_stale"] == 0 for r in rl), rl
    assert all(r.get("staleness_max", 0) <= async_level for r in rl), rl
    # the new server was given this run's weights before it answered: no answer from weights
    # never pushed, and the spot check found it in step
    assert not any(r.get("engine_version_mismatches") for r in rl[1:]), rl
    events = _lines(out / "events.jsonl")
    assert [e for e in events if e["kind"] == "resume"] and events[-1]["kind"] == "done", events[-3:]
    assert not [e for e in events if e["kind"] == "engine"], events
    if shm:  # the dead run's slots went when the resumed run started, its own when it ended
        assert _slot_roots(name) == []
        assert not weights.exists() or not any(weights.glob("v*"))
        return
    folders = sorted(p.name for p in weights.iterdir())
    assert not [f for f in folders if f.startswith(".tmp-")], folders  # the torn folder was replaced
    for f in folders:  # whatever stays is whole: a server could load it
        check_weights_folder(str(weights / f))
        for part in (weights / f).glob("*.safetensors"):
            assert load_file(part), part  # a torn file fails to load
    assert folders[-1] >= "v00000002", folders  # step 3 pushed version 2 at least
