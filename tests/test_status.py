"""`kuberl status`: from a run folder, and from an AgenticRLJob on a (kmock-emulated) cluster."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json

import aiohttp
import kmock
import pytest
from kube_emulator import ClusterEmulator, write_kubeconfig

from kuberl.cli import main
from kuberl.status_view import cluster_lines, local_lines
from kuberl.trainer.step_record import StepRecord
from tests.test_trainer_pipeline import TINY

STAGES = {
    "job": "tiny",
    "stages": [{"name": "sft", "type": "sft", "steps": 4}, {"name": "rl", "type": "rl", "steps": 10}],
}


def _records(rl_steps: int) -> list[StepRecord]:
    recs = [{"job": "tiny", "type": "sft", "stage": "sft", "step": i, "stage_step": i, "loss": 0.5, "token_acc": 0.9,
             "step_seconds": 1.0, "time": 1000.0 + i} for i in range(1, 5)]  # fmt: skip
    recs.append({"type": "eval", "stage": "sft", "step": 4, "label": "sft", "accuracy": 0.25, "time": 1005.0})
    for i in range(1, rl_steps + 1):
        recs.append(
            {"job": "tiny", "type": "rl", "stage": "rl", "step": 4 + i, "stage_step": i, "reward_mean": 0.1 * i,
             "tool_error_ratio_positive": 0.05, "clip_low": 0.001, "clip_high": 0.002, "response_clip_ratio": 0.1,
             "response_length": 90.0, "response_tokens": 600.0, "step_seconds": 3.0, "time": 1010.0 + 3 * i}
        )  # fmt: skip
    return [StepRecord.from_json(r) for r in recs]


EVENTS = [
    {"kind": "stage", "text": "stage sft (sft) starts", "stage": "sft", "step": 0, "time": 1000.0},
    {
        "kind": "checkpoint",
        "text": "checkpoint ck/ckpt-00000004.pt",
        "stage": "sft",
        "step": 4,
        "time": 1006.0,
    },
    {"kind": "stage", "text": "stage rl (rl) starts", "stage": "rl", "step": 4, "time": 1006.0},
]


def test_local_view_of_a_running_and_a_finished_run():
    lines = local_lines("runs/tiny", _records(6), EVENTS, STAGES, now=1090.0)
    assert lines == [
        "run runs/tiny (job tiny): running, or interrupted (last record 1m02s ago)",
        "stage rl (rl) step 6/10, run step 10/14",
        "reward 0.60 tool-err+ 0.05 clip 0.001/0.002 trunc 0.10 len 90  (mean reward of the last 5 steps 0.400)",
        "held-out accuracy: sft 0.250",
        "step time 3.0 s  200 tok/s  ETA 12s",  # 4 RL steps left at 3 s
        "last checkpoint: step 4 (checkpoint ck/ckpt-00000004.pt)",
    ]
    done = [*EVENTS, {"kind": "done", "text": "run finished", "stage": None, "step": 14, "time": 1050.0}]
    lines = local_lines("runs/tiny", _records(10), done, STAGES, now=1090.0)
    assert lines[0] == "run runs/tiny (job tiny): run finished" and "ETA" not in lines[4]
    assert local_lines("r", [], EVENTS[:1], {}, now=1001.0)[1] == "no step finished yet"


def test_local_status_of_a_real_run_folder(tmp_path, capsys, monkeypatch):
    from trainer_fakes import FakeSandbox

    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.trainer.local import run_job

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    f = tmp_path / "job.yaml"
    f.write_text(json.dumps(TINY))
    run_job(find_one(load_manifests(str(f)), AgenticRLJob), tmp_path / "run", use_ray=False,
            executor_factory=FakeSandbox, quiet=True)  # fmt: skip
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run {tmp_path / 'run'} (job tiny-e2e): run finished"
    assert out[1] == "stage rl (rl) step 2/2, run step 6/6"
    assert out[3].startswith("held-out accuracy: sft ") and ", rl " in out[3]
    assert main(["status", str(tmp_path / "nothing-here/")]) == 2
    assert "not a folder" in capsys.readouterr().err


NS = "ml"
API = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}"


def _job_object() -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": "tiny", "namespace": NS}
    doc["spec"]["rollout"]["fleetRef"] = "shared-fleet"
    return doc


JOB_STATUS = {
    "phase": "Running",
    "stage": "rl",
    "step": 5,
    "summary": {"rewardMean": 0.4375, "toolErrorRatio": 0.125},
    "startTime": "2026-01-01T00:00:00Z",
    "observedGeneration": 1,
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "TrainerActive", "message": "1 trainer pods active, 1 ready",
         "lastTransitionTime": "2026-01-01T00:00:05Z"}
    ],
}  # fmt: skip


def test_cluster_view_lines():
    obj = {**_job_object(), "status": JOB_STATUS}
    obj["metadata"]["generation"] = 2
    trainer = {"spec": {"parallelism": 1}, "status": {"active": 1, "ready": 1}}
    fleet = {"spec": {"replicas": 2}, "status": {"readyReplicas": 1, "phase": "Scaling"}}
    now = datetime.datetime(2026, 1, 1, 1, 2, 3, tzinfo=datetime.UTC)
    lines = cluster_lines(
        obj, [("Job", "tiny-trainer", trainer), ("RolloutFleet", "f", fleet), ("SandboxPool", "p", None)], now
    )
    assert lines == [
        "AgenticRLJob ml/tiny: Running  (status of generation 1, spec is at 2)",
        "stage rl  step 5/6  reward 0.438  pass rate -  tool-err+ 0.125",
        "started 2026-01-01T00:00:00Z, running for 1h02m",
        "children:",
        "  Job tiny-trainer: 1/1 ready, 1 active",
        "  RolloutFleet f: 1/2 ready (Scaling)",
        "  SandboxPool p: not found",
        "conditions:",
        "  Ready=True TrainerActive: 1 trainer pods active, 1 ready",
    ]


def test_cluster_view_says_where_a_queued_job_waits_and_why():
    obj = {**_job_object(), "status": {"phase": "Suspended", "conditions": [
        {"type": "Suspended", "status": "True", "reason": "Preempted",
         "message": "preempted by Kueue and queued again: insufficient quota"}]}}
    obj["metadata"] = {**obj["metadata"], "labels": {"kueue.x-k8s.io/queue-name": "team-a",
                                                     "kueue.x-k8s.io/priority-class": "low"}}
    lines = cluster_lines(obj, [], datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
    assert lines[1] == ("queue: LocalQueue team-a, priority class low; Preempted: preempted by Kueue and "
                        "queued again: insufficient quota")


@pytest.mark.timeout(60)
async def test_cluster_status_through_the_kubernetes_client(tmp_path, monkeypatch, capsys):
    """The real kubernetes client against the API emulator: one job's view, and the job list."""
    async with (
        ClusterEmulator(namespaces={NS}) as emu,
        kmock.Server(emu) as srv,
        aiohttp.ClientSession() as s,
    ):
        url = str(srv.url).rstrip("/")

        async def req(method: str, path: str, body: dict, ctype: str = "application/json") -> None:
            async with s.request(method, url + path, json=body, headers={"Content-Type": ctype}) as rsp:
                assert rsp.status < 300, await rsp.text()

        merge = "application/merge-patch+json"
        await req("POST", f"{API}/agenticrljobs", _job_object())
        await req("PATCH", f"{API}/agenticrljobs/tiny/status", {"status": JOB_STATUS}, merge)
        trainer = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "tiny-trainer", "namespace": NS},
                   "spec": {"parallelism": 1, "template": {"spec": {"containers": [{"name": "t", "image": "x"}],
                                                                    "restartPolicy": "Never"}}}}  # fmt: skip
        await req("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", trainer)
        await req("PATCH", f"/apis/batch/v1/namespaces/{NS}/jobs/tiny-trainer/status",
                  {"status": {"active": 1, "ready": 1}}, merge)  # fmt: skip
        fleet = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet",
                 "metadata": {"name": "shared-fleet", "namespace": NS}, "spec": {"replicas": 2}}  # fmt: skip
        await req("POST", f"{API}/rolloutfleets", fleet)
        await req(
            "PATCH",
            f"{API}/rolloutfleets/shared-fleet/status",
            {"status": {"readyReplicas": 2, "phase": "Ready"}},
            merge,
        )

        import kubernetes.config  # noqa: F401 - imported before $KUBECONFIG is set, as in the full suite

        kubeconfig = tmp_path / "kubeconfig"
        write_kubeconfig(kubeconfig, url, NS)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERL_NAMESPACE", raising=False)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        # the client is synchronous: off the loop that serves the emulator
        assert await asyncio.to_thread(main, ["status", "tiny"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "AgenticRLJob ml/tiny: Running"
        assert out[1] == "stage rl  step 5/6  reward 0.438  pass rate -  tool-err+ 0.125"
        assert "  Job tiny-trainer: 1/1 ready, 1 active" in out
        assert "  RolloutFleet shared-fleet: 2/2 ready (Ready)" in out
        assert "  SandboxPool tiny-sandbox: not found" in out  # TINY has an inline pool; none was made

        assert await asyncio.to_thread(main, ["status"]) == 0
        listing = capsys.readouterr().out.splitlines()
        assert listing[0].split() == ["NAME", "PHASE", "STAGE", "STEP", "REWARD", "PASS", "TOOL-ERR", "AGE"]
        assert listing[1].split()[:7] == ["tiny", "Running", "rl", "5", "0.438", "-", "0.125"]

        assert await asyncio.to_thread(main, ["status", "nope"]) == 2
        assert "AgenticRLJob nope not found in namespace ml" in capsys.readouterr().err


def test_no_cluster_or_an_unreachable_one_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert main(["status", "tiny"]) == 2
    assert "no cluster to ask" in capsys.readouterr().err
    write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9", NS)  # nothing listens on port 9
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kc"))
    assert main(["status", "tiny"]) == 2
    assert "cannot reach the API server" in capsys.readouterr().err


def test_operator_summary_line_counts_phases_and_names_running_jobs():
    from kuberl.operator.runtime.summary import summary_line

    job = {"kind": "AgenticRLJob", "metadata": {"namespace": "ml", "name": "a"},
           "status": {"phase": "Running", "stage": "rl", "step": 312, "summary": {"rewardMean": 0.4125}}}  # fmt: skip
    done = {
        "kind": "AgenticRLJob",
        "metadata": {"namespace": "ml", "name": "b"},
        "status": {"phase": "Succeeded"},
    }
    fleet = {
        "kind": "RolloutFleet",
        "spec": {"replicas": 2},
        "status": {"phase": "Ready", "readyReplicas": 2},
    }
    new_pool = {"kind": "SandboxPool", "spec": {"replicas": 3}}
    assert summary_line([new_pool, done, fleet, job]) == (
        "resync: AgenticRLJob 2 (Running 1, Succeeded 1: ml/a rl step 312 reward 0.41); "
        "RolloutFleet 1 (Ready 1; 2/2 replicas ready); SandboxPool 1 (New 1; 0/3 replicas ready)"
    )
    assert summary_line([]) == "resync: no kuberl objects"


async def test_the_running_operator_logs_the_summary_line(caplog):
    from tests.test_operator_e2e import API as E2E_API
    from tests.test_operator_e2e import emulated_cluster, eventually, pool, running_operator

    caplog.set_level("INFO", logger="kuberl.operator")
    async with emulated_cluster() as k, running_operator(k):
        await k.create(f"{E2E_API}/sandboxpools", pool("tools", replicas=1))

        async def said() -> bool:
            return any("resync: SandboxPool 1 (" in r.getMessage() for r in caplog.records)

        await eventually(said, timeout=20, what="the operator's summary line")
