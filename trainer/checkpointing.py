"""A run's checkpoints: saving the model, optimizer and where the run is (with the step history
and evals), resuming from the newest one, and keeping the run folder's events, step records and
run.json beside them (a trainer pod's run folder dies with the pod)."""

from __future__ import annotations

import logging
from typing import Any

from kuberl.api.job import StageSpec
from kuberl.trainer.checkpoint import apply_payload, make_payload
from kuberl.trainer.metrics import KEPT_RUN_FILES
from kuberl.trainer.stage_host import StageHost
from kuberl.trainer.step_record import StepRecord

log = logging.getLogger("kuberl.trainer")


class Checkpoints:
    def __init__(self, pipe: StageHost):
        self.pipe = pipe
        self.saved_step: int | None = None  # global step of the newest checkpoint

    def save(self, stage: StageSpec) -> str:
        pipe = self.pipe
        pipe.state.extra["history"] = [r.to_json() for r in pipe.result.history]
        pipe.state.extra["evals"] = pipe.result.evals
        payload = make_payload(
            pipe.model, pipe.optimizer, pipe.state, pipe.tok.to_str(), pipe.model.config.to_dict(), pipe.ctx
        )
        self.saved_step = pipe.state.global_step
        if payload is None:  # an FSDP rank other than 0: it gave its shards, rank 0 writes
            return ""
        where = pipe.store.save(payload, pipe.state.global_step)
        pipe.sink.event("checkpoint", f"checkpoint {where}", stage.name, pipe.state.global_step)
        self.keep_events()
        return where

    def save_unless_saved(self, stage: StageSpec) -> None:
        if self.saved_step != self.pipe.state.global_step:
            self.save(stage)

    def resume(self, payload: dict[str, Any] | None = None) -> bool:
        """Continue from ``payload`` (default: the store's newest checkpoint); False if none.

        With FSDP every rank calls this; rank 0's payload is the one that counts.
        """
        pipe = self.pipe
        if payload is None and pipe.ctx.is_main:
            payload = pipe.store.load()
        index = pipe.ctx.broadcast(payload["state"]["stage_index"] if payload is not None else None)
        if index is None:
            return False
        stage = pipe.spec.stages[min(index, len(pipe.spec.stages) - 1)]
        pipe.optimizer = pipe.new_optimizer(pipe.stage_lr(stage))
        pipe.state, restored = apply_payload(payload, pipe.model, pipe.optimizer, pipe.ctx)
        pipe.result.history = [StepRecord.from_json(r) for r in pipe.state.extra.get("history", [])]
        pipe.result.evals = dict(pipe.state.extra.get("evals", {}))
        self.saved_step = pipe.state.global_step
        text = f"resumed at global step {pipe.state.global_step}"
        if dropped := pipe.sink.forget_after(pipe.state.global_step):
            text += f"; {dropped} records of later steps (trained before the run stopped) dropped: they train again"
        pipe.sink.event("resume", text, stage.name, pipe.state.global_step)
        if not restored:
            pipe.sink.event(
                "resume",
                "optimizer moments start afresh: the checkpoint's by-index optimizer state "
                "(an older kuberl) only loads in a single process",
                stage.name,
                pipe.state.global_step,
            )
        return True

    def keep_events(self) -> None:
        """events.jsonl, metrics.jsonl and run.json next to the checkpoints too: a trainer pod's run
        folder dies with the pod, and they are what `kuberl report` and `kuberl status` read."""
        path = self.pipe.sink.events_path
        if path is None:
            return
        for name in KEPT_RUN_FILES:
            src = path.with_name(name)
            if not src.is_file():
                continue
            try:
                self.pipe.store.put_file(src, name)
            except Exception as err:  # noqa: BLE001 - the checkpoint is saved; annotations can wait
                log.warning("could not copy %s to %s: %s", name, self.pipe.store.uri, err)
