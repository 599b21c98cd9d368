"""A RolloutFleet scaled up and down by `kubectl scale` while a run trains on it, on a real
control plane with real vLLM servers behind the fleet's pods (tests/elastic_fleet_driver.py,
in a network namespace of its own), at asyncLevel 1: the new engine serves only the current
policy version, the removed one drains, and every rollout of every step is trained on or
counted, none lost, none stale. The asynchronous run is the harder case (the push to the
joining engine runs beside generation on the other one); the synchronous one takes the same
join and drain path with the push in line, and costs CI another ~200 s, so the test runs the
asynchronous mode only (``elastic_fleet_driver.py --modes 0,1`` runs both). The engines stay host processes rather than pods of the
7 GB CPU vLLM image on the real node (docs/cluster.md, "The elastic fleet" says why);
tests/test_real_node_fleet.py runs the engine pods' kubelet side (probes, drain, SIGTERM) there."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.k8s

DRIVER = Path(__file__).resolve().parent / "elastic_fleet_driver.py"
ROLLOUTS_PER_STEP = 4 * 2 * 2  # batchPrompts x groupSize x oversample (the driver's job)
DRIVER_TIMEOUT_S = 2400


def _steps_per_hour(records: list[dict]) -> float:
    return 3600.0 / (sum(r["step_seconds"] for r in records) / len(records)) if records else float("nan")


@pytest.mark.timeout(DRIVER_TIMEOUT_S + 180)
def test_a_fleet_scaled_up_and_down_mid_run_loses_no_rollout(smollm2_dir, tmp_path):
    from k8s_fixtures import require_or_skip
    from vllm_fixtures import vllm_available

    from kuberl.cluster.build import ensure_binaries
    from kuberl.cluster.errors import ClusterError

    vllm_available()
    try:
        ensure_binaries()
    except ClusterError as err:
        require_or_skip(f"no control plane: {err}")
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        require_or_skip("the pods' IPs are routed in a network namespace of the test's own: needs root, unshare and ip")
    driver = subprocess.Popen(
        ["unshare", "-n", sys.executable, str(DRIVER), "--model", str(smollm2_dir), "--out", str(tmp_path),
         "--modes", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = driver.communicate(timeout=DRIVER_TIMEOUT_S)
    finally:
        if driver.poll() is None:  # SIGTERM first: the driver takes its cluster and servers down
            driver.terminate()
            try:
                driver.wait(timeout=120)
            except subprocess.TimeoutExpired:
                driver.kill()
    assert driver.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result["modes"]) == {"1"}, result["modes"].keys()
    figures = {}
    for level, mode in result["modes"].items():
        recs, marks = mode["records"], mode["marks"]
        where = f"asyncLevel {level}: {mode['log_tail']}"
        assert mode["exit"] == 128 + 15, where  # stopped by SIGTERM a step after the scale-down
        assert len(recs) >= marks["scaled_down_after_step"] + 1, where
        # every rollout of every step came back: none aborted (a moved one goes on), none stale
        for r in recs:
            assert r["rollouts"] == ROLLOUTS_PER_STEP and r["rollouts_aborted"] == 0, (level, r)
            assert r.get("rollouts_stale", 0) == 0, (level, r)
            # the joining engine served the current version from its first answer (its labels)
            assert not r.get("engine_version_mismatches"), (level, r)
        engines = [r["engines_in_service"] for r in recs]
        up, down = marks["scaled_up_after_step"], marks["scaled_down_after_step"]
        assert engines[:up] == [1] * up, engines
        assert 2 in engines[up:down], engines
        assert engines[-1] == 1, engines
        # the stand-in kubelet: one new engine pod served, left after the scale-down, drained
        # (its preStop hook held it until no request had run for 20 s) and stopped
        (new,) = [p for p in mode["pods"] if p["new"]]
        assert new["error"] is None and new["serving_s"] is not None, mode["pods"]
        left = [p for p in mode["pods"] if p["left"]]
        assert len(left) == 1 and left[0]["stopped"], mode["pods"]
        assert 20 <= left[0]["drained_s"] < 285, left
        joined = engines.index(2)
        two = [r for r in recs if r["engines_in_service"] == 2]
        figures[level] = {
            "steps/hour on one engine": round(_steps_per_hour(recs[:joined]), 1),
            "on two": round(_steps_per_hour(two), 1),
            "after the scale-down": round(_steps_per_hour(recs[joined + len(two):]), 1),
            "rollouts handed off": sum(r.get("rollouts_handed_off", 0) for r in recs),
        }
    print("asyncLevel:", figures)
