"""An RL stage: its GRPO-RoC steps (:func:`~kuberl.trainer.rl_step.rl_step`) over the stage's
prompt pool (after the difficulty filter), the engines' spot-check findings as events, then the
stage's eval and checkpoint. With ``algorithm.asyncLevel`` k > 0 the batches of the next k steps
generate while a step trains (the :class:`~kuberl.rollout.orchestrator.Orchestrator`'s part)."""

from __future__ import annotations

import os

from kuberl.api.job import StageSpec
from kuberl.rollout.loop import BatchRequest
from kuberl.rollout.orchestrator import Orchestrator
from kuberl.rollout.phases import PhaseAnnouncer, rollout_gpus
from kuberl.trainer.filtering import rl_pool
from kuberl.trainer.rl_step import StepSettings, rl_step
from kuberl.trainer.spot_check import EngineWatch, finding_texts
from kuberl.trainer.stage_host import StageHost


class RlStage:
    def __init__(self, pipe: StageHost):
        self.pipe = pipe
        self._engines = EngineWatch(pipe.spec.rollout.spot_check_tolerance)  # what the spot check flagged

    def run(self, stage: StageSpec) -> None:
        """The stage's GRPO-RoC steps (:func:`rl_step`), then its eval and checkpoint; with
        ``algorithm.asyncLevel`` k > 0 the batches of the next k steps generate while a step
        trains (the orchestrator's part)."""
        pipe = self.pipe
        a = pipe.spec.algorithm
        batch = stage.batch_size or a.batch_prompts
        pool = rl_pool(pipe, stage)
        n = a.rollouts_per_prompt if pipe.algorithm == "grpo-roc" else a.group_size
        settings = StepSettings(pipe.spec, pipe.algorithm, pipe.loss_cfg, pipe.ctx, pipe.device)
        pipe.model.eval()

        def request(ahead: int) -> BatchRequest:
            """The batch of the step ``ahead`` steps after the current one."""
            probs = [pool[(pipe.state.cursor + ahead * batch + i) % len(pool)] for i in range(batch)]
            seed = pipe.spec.seed * 1_000_003 + pipe.state.global_step + ahead
            return pipe.problems.request(
                stage,
                probs,
                n,
                temperature=pipe.spec.rollout.temperature,
                top_p=pipe.spec.rollout.top_p,
                seed=seed,
            )

        client = pipe.client if pipe.ctx.is_main else None
        phases = PhaseAnnouncer(
            pipe.job.metadata.name,
            rollout_gpus(),
            overlapping=a.async_level > 0,
            pool=os.environ.get("KUBERL_SANDBOX_POOL", ""),
        )
        with Orchestrator(client, pipe.weights, request, ahead=a.async_level, phases=phases) as orch:
            while pipe.state.stage_step < stage.steps:
                if pipe.out_of_time():
                    pipe.result.stopped_early = True
                    break
                pipe.seed_step()
                lr = pipe.set_lr(stage, pipe.state.stage_step)
                step = rl_step(
                    pipe.model,
                    pipe.optimizer,
                    orch,
                    settings,
                    version=pipe.state.global_step,
                    steps_left=stage.steps - pipe.state.stage_step,
                    lr=lr,
                )
                pipe.state.cursor = (pipe.state.cursor + batch) % len(pool)
                if step.probe is not None:
                    self._engine_events(stage, finding_texts(step.probe, pipe.state.global_step))
                if step.gaps:
                    self._engine_events(stage, self._engines.update(step.gaps))
                pipe.after_step(stage, step.record)
            orch.join()  # the last push (its errors raise here)
        if pipe.result.stopped_early:
            pipe.checkpoint_unless_saved(stage)
            if not pipe.result.interrupted:  # a SIGTERM leaves the grace period to the checkpoint
                pipe.evaluate(stage, stage.name)  # the accuracy at the time limit; not in the checkpoint
            return
        if stage.name not in pipe.result.evals:  # a run resumed at the stage's end has it already
            pipe.evaluate(stage, stage.name)
        pipe.checkpoint_unless_saved(stage)

    def _engine_events(self, stage: StageSpec, texts: list[str]) -> None:
        for text in texts:
            self.pipe.sink.event("engine", text, stage.name, self.pipe.state.global_step)
