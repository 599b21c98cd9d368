"""Issue 14 item 3: edits that do not change the run leave the trainer alone, checkpoints live on
a volume that outlives the trainer's pods, and a failed trainer is restarted a bounded number
of times (resuming from that volume) before the job fails."""

from __future__ import annotations

from typing import Any

import builders
import pytest

from kuberl.api import AgenticRLJob
from kuberl.api.crdgen import all_crds
from kuberl.operator.render.job_builder import build_job
from kuberl.operator.render.trainer_runs import CHECKPOINT_DIR, restart_decision
from tests.apiserver_emulation import admission_errors
from tests.test_operator_e2e import API, NS, _status, cluster_and_operator, eventually, job

pytestmark = pytest.mark.timeout(60)
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


RUN = job("run")


def _trainer(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == "Job")


def test_labels_annotations_and_retry_settings_do_not_change_the_trainer_template() -> None:
    base = _trainer(build_job(builders.job(of=RUN), NS))["spec"]["template"]
    labelled = _trainer(build_job(builders.job(of=RUN, labels={"team": "rl"}, annotations={"note": "x"}), NS))
    assert labelled["spec"]["template"] == base
    doc = job("run")
    doc["spec"]["trainer"]["maxRestarts"] = 7
    assert _trainer(build_job(AgenticRLJob.model_validate(doc), NS))["spec"]["template"] == base
    doc["spec"]["seed"] = 5  # this one changes the run
    assert _trainer(build_job(AgenticRLJob.model_validate(doc), NS))["spec"]["template"] != base


def test_default_checkpoints_live_on_a_volume_owned_by_the_job() -> None:
    objs = build_job(builders.job(of=RUN), NS)
    claim = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "run-checkpoints"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # 2 trainer pods
    pod = _trainer(objs)["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == CHECKPOINT_DIR)
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["persistentVolumeClaim"]["claimName"] == "run-checkpoints"
    # s3:// needs no volume
    doc = job("run", checkpoint={"uri": "s3://bucket/run"})
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in build_job(AgenticRLJob.model_validate(doc), NS))


def test_trainer_tolerates_disruptions_and_restarts_are_bounded() -> None:
    spec = _trainer(build_job(builders.job(of=RUN), NS))["spec"]
    assert spec["podFailurePolicy"]["rules"][0]["action"] == "Ignore"
    # a trainer stopped by SIGTERM (its Job suspended) has checkpointed: no failure, no restart used
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]}} \
        in spec["podFailurePolicy"]["rules"]
    assert restart_decision("OOMKilled", 0, 2).restart and restart_decision("x", 1, 2).restarts == 2
    last = restart_decision("OOMKilled", 2, 2)
    assert not last.restart and "no restarts left" in last.message


async def test_a_label_on_a_running_job_does_not_replace_its_trainer() -> None:
    async with cluster_and_operator() as k:
        await k.create(f"{API}/agenticrljobs", job("calm"))
        first = await eventually(lambda: k.get(f"{JOBS}/calm-trainer"), what="trainer Job")

        async def running() -> bool:
            return (await _status(k, f"{API}/agenticrljobs/calm")).get("phase") == "Running"

        await eventually(running, what="Running")
        await k.patch(f"{API}/agenticrljobs/calm", {"metadata": {"labels": {"team": "rl"}}})

        async def handled() -> bool:
            obj = await k.get(f"{API}/agenticrljobs/calm")
            return "kuberl.io/last-handled-configuration" in obj["metadata"].get("annotations", {}) and (
                '"team"' in obj["metadata"]["annotations"]["kuberl.io/last-handled-configuration"]
            )

        await eventually(handled, what="the label edit handled")
        import asyncio

        await asyncio.sleep(1.0)  # two resync passes
        now = await k.get(f"{JOBS}/calm-trainer")
        assert now["metadata"]["uid"] == first["metadata"]["uid"]
        assert not any(e["reason"] == "TrainerReplaced" for e in await k.events("calm"))


async def _fail(k: Any, name: str) -> None:
    failed = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "rank 1 exited 1"}
    await k.patch(f"{JOBS}/{name}/status", {"status": {"conditions": [failed], "active": 0, "failed": 1}})


async def test_failed_trainer_is_restarted_then_the_job_fails() -> None:
    async with cluster_and_operator() as k:
        trainer = {"replicas": 1, "accelerator": {"profile": "h100", "count": 8}, "maxRestarts": 1}
        await k.create(f"{API}/agenticrljobs", job("flaky", trainer=trainer))
        first = await eventually(lambda: k.get(f"{JOBS}/flaky-trainer"), what="trainer Job")
        claim = await k.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/flaky-checkpoints")
        assert claim is not None
        await _fail(k, "flaky-trainer")

        async def replaced() -> Any:
            j = await k.get(f"{JOBS}/flaky-trainer")
            return j if j and j["metadata"]["uid"] != first["metadata"]["uid"] else None

        second = await eventually(replaced, what="trainer restarted")
        st = await eventually(
            lambda: _restarts(k, "flaky"), what="status.restarts"
        )
        assert st == 1
        # The checkpoint volume is the same object: the restarted trainer resumes from it.
        again = await k.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/flaky-checkpoints")
        assert again["metadata"]["uid"] == claim["metadata"]["uid"]
        assert any(e["reason"] == "TrainerRestarted" for e in await k.events("flaky"))

        await _fail(k, "flaky-trainer")

        async def failed() -> Any:
            s = await _status(k, f"{API}/agenticrljobs/flaky")
            return s if s.get("phase") == "Failed" else None

        st2 = await eventually(failed, what="job Failed after its restarts")
        assert st2["restarts"] == 1
        assert (await k.get(f"{JOBS}/flaky-trainer"))["metadata"]["uid"] == second["metadata"]["uid"]


async def _restarts(k: Any, name: str) -> Any:
    return (await _status(k, f"{API}/agenticrljobs/{name}")).get("restarts")


def test_model_and_checkpoint_uri_cannot_change_under_a_running_job() -> None:
    """The CRD's transition rule: a running run's checkpoints belong to its model."""
    crds = list(all_crds().values())
    old = {**job("run"), "status": {"phase": "Running"}}

    def update(**spec: Any) -> list[str]:
        new = job("run", **spec)
        new["metadata"]["labels"] = {"team": "rl"}
        return [m for _, m in admission_errors(crds, new, old)]

    assert update() == []  # a label
    refused = update(model={"base": "Qwen/Qwen3-14B"})
    assert any("spec.model and spec.checkpoint.uri cannot change" in m for m in refused), refused
    assert update(checkpoint={"uri": "s3://elsewhere"}) != []
    assert update(seed=3) == []  # changes the run: allowed (the trainer is replaced and resumes)
    for phase in ("Failed", "Pending"):  # not started, or over: anything goes
        done = {**old, "status": {"phase": phase}}
        new = job("run", model={"base": "Qwen/Qwen3-14B"})
        assert admission_errors(crds, new, done) == []
    assert admission_errors(crds, job("run", model={"base": "x"})) == []  # create


async def test_an_engine_the_spot_check_flags_shows_in_the_jobs_status_and_events() -> None:
    """Issue 20 item 4: the trainer's spot check (kuberl_train_engine_logprob_gap) reaches the
    job: EnginesInStep=False naming the engine, one Warning event, True again once it recovers."""
    from kuberl.operator.render.render_common import selector_labels
    from tests.test_operator_e2e import metrics_server

    gaps = {"rf-0": 0.02, "rf-1": 0.9}

    def render() -> str:
        rows = "".join(
            f'kuberl_train_engine_logprob_gap{{job="spot",engine="{e}"}} {g}\n' for e, g in gaps.items()
        )
        return "# TYPE kuberl_train_engine_logprob_gap gauge\n" + rows

    async with metrics_server(render) as port, cluster_and_operator() as k:
        await k.create(f"{API}/agenticrljobs", job("spot"))
        await eventually(lambda: k.get(f"{JOBS}/spot-trainer"), what="trainer Job")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "spot-trainer-0", "namespace": NS, "labels": selector_labels("spot", "trainer")},
            "spec": {"containers": [{"name": "t", "image": "i", "ports": [{"name": "metrics", "containerPort": port}]}]},
        }
        await k.create(f"/api/v1/namespaces/{NS}/pods", pod)
        running = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        await k.patch(f"/api/v1/namespaces/{NS}/pods/spot-trainer-0/status", {"status": running})

        async def in_step(value: str) -> dict[str, Any] | None:
            conds = (await _status(k, f"{API}/agenticrljobs/spot")).get("conditions") or []
            return next((c for c in conds if c["type"] == "EnginesInStep" and c["status"] == value), None)

        flagged = await eventually(lambda: in_step("False"), timeout=20, what="EnginesInStep=False")
        assert "rf-1 (0.900)" in flagged["message"] and "rf-0" not in flagged["message"]
        warnings = [e for e in await k.events("spot") if e["reason"] == "EngineWeightsDiffer"]
        assert len(warnings) == 1 and "rf-1" in warnings[0]["message"]
        gaps["rf-1"] = 0.03  # restarted: serves the pushed weights again
        await eventually(lambda: in_step("True"), timeout=20, what="EnginesInStep=True")
        assert len([e for e in await k.events("spot") if e["reason"] == "EngineWeightsDiffer"]) == 1
