"""The RL stages of :class:`~kuberl.trainer.stages.Pipeline` (paper sections 3 and 4): the
prompt pool and stage 3's difficulty filter, and the GRPO-RoC step, synchronous or with
``algorithm.asyncLevel`` batches generating ahead (INTELLECT-2 section 2.1), with the engines'
spot check.

A mixin: it uses the pipeline's model, optimizer, state, sink and rollout worker (``call``), which
:class:`~kuberl.trainer.stages.Pipeline` owns.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kuberl.api.job import StageSpec
from kuberl.trainer import data as data_mod
from kuberl.trainer.grpo import (
    engine_gaps,
    prepare_batch,
    recompute_old_logprobs,
    rl_update,
    shard_step_batch,
    spot_rows,
    trained_engines,
)
from kuberl.trainer.spot_check import finding_texts, probe_engines
from kuberl.trainer.weight_sync import BackgroundPush


class RLStage:
    """RL stage methods of the pipeline."""

    def _rl_pool(self, stage: StageSpec) -> list[data_mod.Problem]:
        batch = stage.batch_size or self.spec.algorithm.batch_prompts
        source = stage.data or self.spec.data.train
        idx = self.spec.stages.index(stage)
        probs = self._pool(source, stage.steps * batch, self.spec.data.seed + 1000 * (idx + 1))
        keep = self.state.extra.get(f"filter:{stage.name}")
        if stage.difficulty_filter is not None and keep is None:
            keep = self._difficulty_filter(stage, probs)
            self.state.extra[f"filter:{stage.name}"] = keep
        return [probs[i] for i in keep] if keep is not None else probs

    def _difficulty_filter(self, stage: StageSpec, probs: list[data_mod.Problem]) -> list[int]:
        """Indices of problems the current policy does NOT solve k/k (paper stage 3)."""
        self._sync_weights()
        return self.ctx.broadcast(self._filter_on(stage, probs) if self.ctx.is_main else None)

    def _filter_on(self, stage: StageSpec, probs: list[data_mod.Problem]) -> list[int]:
        f = stage.difficulty_filter
        assert f is not None
        groups = self.call(
            "rollouts",
            [self._prompt(p) for p in probs],
            [p.answer for p in probs],
            f.rollouts,
            temperature=self.spec.rollout.temperature,
            seed=self.spec.seed * 31 + 5,
            **self._rl_limits(stage),
        )
        keep = [
            i for i, g in enumerate(groups) if not (f.drop_if_all_correct and all(s.reward > 0 for s in g))
        ]
        if not keep:
            keep = list(range(len(probs)))  # everything solved: keep the pool rather than train on nothing
        self.sink.event(
            "filter",
            f"difficulty filter kept {len(keep)}/{len(probs)} problems",
            stage.name,
            self.state.global_step,
        )
        return keep

    def _run_rl(self, stage: StageSpec) -> None:
        """GRPO-RoC steps; with ``algorithm.asyncLevel`` k > 0 the rollouts of the next k steps
        generate while this one trains (INTELLECT-2 section 2.1).

        Step n's batch is submitted at step n-k, once version n-k reached the engines and step
        n-k's own batch is in hand (a batch then generates during every update): it is at most
        k versions old when trained on; the weight push of each new version overlaps the
        generation in flight. A turn is one engine request, and a request finishes on the
        weights it started with (vLLM: ``pause?mode=wait``; LocalEngine: reports the version it
        started with), so a multi-turn rollout that spans a push carries the version of each turn
        and counts as old as its oldest turn: nothing is trained on with a staleness it does not
        have. Batches submitted ahead are not checkpointed: a resumed run generates them afresh.

        Engines behind HTTP load each version from a published folder; with k > 0 the trainer
        copies the weights and goes on to the update while a thread writes the folder, has the
        engines load it and only then submits the batches ahead (the staleness bound needs the
        version on the engines first): the push leaves the trainer's critical path as in
        INTELLECT-2, where the trainer hands its checkpoint off and keeps training.
        """
        a = self.spec.algorithm
        k = a.async_level
        batch = stage.batch_size or a.batch_prompts
        pool = self._rl_pool(stage)
        n = a.rollouts_per_prompt if self.algorithm == "grpo-roc" else a.group_size
        self.model.eval()
        pending: dict[int, Any] = {}  # global step -> ticket of its submitted rollouts (rank 0)
        self._engine_busy_mark = self.call("busy_seconds") if self.ctx.is_main else None

        def request(ahead: int) -> tuple[tuple, dict[str, Any]]:
            probs = [pool[(self.state.cursor + ahead * batch + i) % len(pool)] for i in range(batch)]
            kwargs = {
                "temperature": self.spec.rollout.temperature,
                "top_p": self.spec.rollout.top_p,
                "seed": self.spec.seed * 1_000_003 + self.state.global_step + ahead,
                **self._rl_limits(stage),
            }
            return ([self._prompt(p) for p in probs], [p.answer for p in probs], n), kwargs

        try:
            while self.state.stage_step < stage.steps:
                if self._out_of_time():
                    self.result.stopped_early = True
                    break
                self._rl_step(stage, request, pending, k, batch, pool)
            self._join_background()  # the last push (its errors raise here)
        finally:
            if self._background is not None:  # failed mid-step: settle the thread (that error comes first)
                with contextlib.suppress(Exception):
                    self._join_background()
            for ticket in pending.values():  # stopped early or failed: not trained on
                self.call("discard_rollouts", ticket)
        if self.result.stopped_early:
            self._checkpoint_unless_saved(stage)
            self.evaluate(stage, stage.name)  # the accuracy at the time limit; not in the checkpoint
            return
        if stage.name not in self.result.evals:  # a run resumed at the stage's end has it already
            self.evaluate(stage, stage.name)
        self._checkpoint_unless_saved(stage)

    def _probe(self, stage: StageSpec, target, version: int, count: int) -> dict[str, float]:
        """The engines score ``target``'s rows against its pi_old (spot check, asyncLevel > 0),
        once this step's push (on its thread, if any) has reached them."""
        if self._background is not None:
            self._background.wait_pushed()
        probe = probe_engines(self.call, target, version, count)
        self._engine_events(stage, finding_texts(probe, version))
        return probe.gaps

    def _rl_step(self, stage: StageSpec, request, pending: dict[int, Any], k: int, batch: int, pool) -> None:
        a = self.spec.algorithm
        t0 = time.perf_counter()
        gstep = self.state.global_step
        push_wait = self._join_background()  # the step before's push and batches ahead
        self._seed_step()
        lr = self._set_lr(stage, self.state.stage_step)
        # version gstep reaches the engines (overlapping generation if k > 0); a folder push runs
        # on a thread beside the wait and the update, except at the stage's first step, whose
        # batch needs the version at once
        if k > 0 and hasattr(self.weights, "prepare") and (gstep in pending or not self.ctx.is_main):
            push = self.weights.prepare(self.model, gstep)
            if push is not None:
                self._background = BackgroundPush(push)
        else:
            self._sync_weights()
        t1 = time.perf_counter()
        parts = None
        groups: list = []
        if self.ctx.is_main:
            if k == 0:
                self.call("step_stats")  # from here on: this step's figures alone (not an eval's)
                args, kwargs = request(0)
                groups = self.call("rollouts", *args, **kwargs)
            else:

                def submit(ahead: int) -> None:
                    if gstep + ahead not in pending:
                        args, kwargs = request(ahead)
                        pending[gstep + ahead] = self.call("submit_rollouts", *args, **kwargs)

                submit(0)  # only at the stage's first step: later ones were submitted ahead
                groups = self.call("collect_rollouts", pending.pop(gstep))
                # Only now the next k batches: submitted before the wait, the batch ahead filled
                # this batch's tail, ended with it and left the engines idle during the update
                # (bench/README.md, asynchronous RL)
                aheads = range(1, min(k + 1, stage.steps - self.state.stage_step))
                if self._background is None:
                    for ahead in aheads:
                        submit(ahead)
                else:  # once this step's version is on the engines
                    self._background.release([lambda ahead=ahead: submit(ahead) for ahead in aheads])
            sb = prepare_batch(
                groups,
                a.group_size,
                roc=self.algorithm == "grpo-roc",
                seed=self.spec.seed + gstep,
                filter_zero=a.filter_zero_advantage,
                version=gstep,
                max_staleness=k,
            )
            parts = shard_step_batch(sb, self.ctx.world_size) if self.ctx.enabled else [sb]
        t_roll = time.perf_counter() - t1
        sb = self.ctx.scatter(parts)  # this rank's share (rank 0 did the rollouts and RoC)
        mini_batches = min(a.mini_batches, max(1, len(sb.seqs)))
        # One optimizer step per batch: pi_old, the policy at the start of the optimisation step,
        # is the update's own forward (rl_update's on_policy), no separate recomputation; with
        # k > 0 the engines' sampling log-probs still enter as the behaviour policy of the
        # truncated IS weights. Equal on every rank (equal row counts).
        on_policy = a.ppo_epochs == 1 and mini_batches == 1
        logprob_gap = 0.0
        sizes = {"micro_batch_tokens": self.spec.trainer.micro_batch_tokens, "device": self.device}
        t_old = time.perf_counter()
        if not on_policy:
            logprob_gap = recompute_old_logprobs(self.model, sb, dist=self.ctx, **sizes) if sb.seqs else 0.0
            logprob_gap = self.ctx.all_reduce([logprob_gap])[0] / self.ctx.world_size
        t_spot = time.perf_counter()
        gaps: dict[str, float] = {}
        n_check = self.spec.rollout.spot_check_rollouts
        spot = self.ctx.is_main and n_check and self.spec.rollout.spot_check_tolerance is not None
        probe_target = None
        if spot and k > 0:
            # Sampled by older versions: the engines score rows against pi_old instead, after the
            # update (pi_old is known by then, from the update's forward or recomputed before it;
            # the engines serve version gstep until the next step pushes, and a push on its own
            # thread has had the update's time to reach them).
            probe_target = sb
            if not any(map(any, sb.masks)) and not self.ctx.enabled:  # nothing trained: any rollouts
                probe_target = spot_rows(groups, None, n_check)
                if probe_target.seqs:
                    recompute_old_logprobs(self.model, probe_target, **sizes)
        elif spot and not self.ctx.enabled:
            # The trained rows measure their engines (batch.gaps, from pi_old); the spot check
            # rescores rollouts of the other engines only, before the update changes the weights.
            probe = spot_rows(groups, gstep, n_check, skip=trained_engines(sb))
            if probe.seqs:
                recompute_old_logprobs(self.model, probe, **sizes)
                gaps = engine_gaps(probe)
        t_opt = time.perf_counter()
        upd = rl_update(
            self.model,
            self.optimizer,
            sb,
            self.loss_cfg,
            grad_clip=a.grad_clip,
            mini_batches=mini_batches,
            ppo_epochs=a.ppo_epochs,
            dist=self.ctx,
            tis_cap=a.effective_tis_cap,
            on_policy=on_policy,
            **sizes,
        )
        t_opt_end = time.perf_counter()
        if on_policy:
            logprob_gap = upd.pop("rollout_logprob_gap", 0.0)
        if probe_target is not None:
            gaps = self._probe(stage, probe_target, gstep, n_check)
        t_probe_end = time.perf_counter()
        if spot:  # FSDP: rank 0's trained share alone (a forward of other rows would be collective)
            gaps = {**engine_gaps(sb), **gaps}
        self.model.eval()
        self.state.cursor = (self.state.cursor + batch) % len(pool)
        rec = {
            "type": "rl",
            "algorithm": self.algorithm,
            "lr": lr,
            **sb.stats,
            **upd,
            "rollout_logprob_gap": logprob_gap,
            "rollout_seconds": t_roll,  # waiting for this step's rollouts (all of their time when k = 0)
            "update_seconds": time.perf_counter() - t1 - t_roll,  # recompute + update
            # where the update's time goes: pi_old's forward, the spot check (engines scoring
            # when k > 0: a request the busy engines answer), the optimizer steps
            "pi_old_seconds": t_spot - t_old,
            "spot_check_seconds": t_opt - t_spot + t_probe_end - t_opt_end,
            "optimizer_seconds": t_opt_end - t_opt,
            # the weight push on the trainer's critical path (with k > 0 the engines go on
            # generating meanwhile; a folder push: the weights' copy and any wait for the last push)
            "sync_seconds": t1 - t0,
            "push_wait_seconds": push_wait,
            "step_seconds": time.perf_counter() - t0,
        }
        if gaps:
            rec["engine_logprob_gap"] = gaps
            self._engine_events(stage, self._engines.update(gaps))
        if self.ctx.is_main:  # with k > 0: the calls finished since the last step, later batches' too
            rec.update(self.call("step_stats") or {})  # None: a worker that does not count them
        busy = self.call("busy_seconds") if self.ctx.is_main else None
        if busy is not None and self._engine_busy_mark is not None:
            rec["engine_busy_seconds"] = busy - self._engine_busy_mark  # generation during this step
        self._engine_busy_mark = busy
        self._after_step(stage, rec)

    def _engine_events(self, stage: StageSpec, texts: list[str]) -> None:
        for text in texts:
            self.sink.event("engine", text, stage.name, self.state.global_step)
