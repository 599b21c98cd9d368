"""The multi-stage recipe (paper section 4): an SFT stage, then RL stages with their own
response length / turn limits, the stage-3 offline difficulty filter and optimizer resets.

:class:`Pipeline` is the trainer driver. It owns the trainable model and optimizer and talks
to a rollout worker (a Ray actor, or the same object in-process) through ``call(name, ...)``.
Every step is seeded from (seed, global step) and every rollout from (step seed, prompt,
sample, turn), so a resumed run continues exactly where the checkpoint left off: SFT, the
rollouts' tokens and the update. Tool latency and thread timing change how the engine batches
requests, which moves its log-probs in the last float bits but not the sampled tokens (unless a
uniform lands within ~1e-7 of a token boundary); the update takes pi_old from the trainer in a
fixed layout (its own forward when the step is on-policy, else ``recompute_old_logprobs``), so
it is bitwise reproducible.

Checkpoints: every ``checkpoint.everySteps`` global steps, at the end of each stage after its
eval (so a resumed run neither repeats the eval nor the stage), and when ``deadline`` stops the
run.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kuberl.api.job import AgenticRLJob, StageSpec
from kuberl.rollout import template
from kuberl.trainer import data as data_mod
from kuberl.trainer.checkpoint import CheckpointStore, TrainState, apply_payload, make_payload
from kuberl.trainer.distributed import DistContext
from kuberl.trainer.grpo import (
    engine_gaps,
    prepare_batch,
    recompute_old_logprobs,
    rl_update,
    shard_step_batch,
    spot_rows,
    trained_engines,
)
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.metrics import KEPT_RUN_FILES, MetricsSink
from kuberl.trainer.model import GPT
from kuberl.trainer.sft import sft_loss
from kuberl.trainer.spot_check import EngineWatch, finding_texts, probe_engines
from kuberl.trainer.weight_sync import LocalWeights

log = logging.getLogger("kuberl.trainer")

SFT_ERROR_FRACTION = 0.3  # SFT traces that make a tool error and then fix it
SFT_POOL_MAX = 2048  # distinct SFT traces (cycled); each one's tool outputs come from the sandbox
EVAL_SIZE = 256  # held-out problems in the builtin eval set


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


@dataclass
class RunResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[str, float] = field(default_factory=dict)  # "<stage>": sampled accuracy after it
    stopped_early: bool = False


class Pipeline:
    def __init__(
        self,
        job: AgenticRLJob,
        model: GPT,
        tokenizer,
        call: Callable[..., Any],
        store: CheckpointStore,
        sink: MetricsSink,
        *,
        algorithm: str,
        device: torch.device,
        deadline: float | None = None,
        on_progress: Callable[[str, int, int, dict], None] | None = None,
        weights: Any = None,
        ctx: DistContext | None = None,
    ):
        """``weights.sync(model, version)`` brings the rollout engines up to date before every
        rollout batch (default: the state dict to the worker's local engine, ``LocalWeights``).

        ``ctx``: FSDP ranks (see :mod:`kuberl.trainer.distributed`). Every rank runs this same
        loop in lockstep; rank 0 alone holds the rollout worker (``call``), the store writes and
        the sink, and decides what the others must agree on (time limit, filters, evals).
        """
        self.ctx = ctx or DistContext()
        self.job = job
        self.spec = job.spec
        self.model = model
        self.tok = tokenizer
        self.call = call
        self.weights = weights if weights is not None else LocalWeights(call, self.ctx)
        self.store = store
        self.sink = sink
        self.algorithm = algorithm
        self.device = device
        self.deadline = deadline
        self.on_progress = on_progress or (lambda *a: None)
        self.state = TrainState()
        self.optimizer = self._new_optimizer(self._stage_lr(self.spec.stages[0]))
        self.result = RunResult()
        a = self.spec.algorithm
        self.loss_cfg = LossConfig(
            clip_low=a.clip.low,
            clip_high=a.clip.high,
            negative_ratio_cap=a.clip.negative_ratio_cap,
            kl_coef=a.kl_coef,
            entropy_coef=a.entropy_coef,
            aggregation=a.loss_aggregation,
        )
        if a.kl_coef > 0:
            raise ValueError(
                "algorithm.klCoef > 0 is not supported by the local trainer (no reference model)"
            )
        self._saved_step: int | None = None  # global step of the newest checkpoint
        self._pools: dict[str, list[data_mod.Problem]] = {}
        self._engines = EngineWatch(self.spec.rollout.spot_check_tolerance)  # what the spot check flagged
        self._engine_busy_mark: float | None = None
        self._sft_cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    # -- helpers ----------------------------------------------------------------------------

    def _stage_lr(self, stage: StageSpec) -> float:
        return stage.learning_rate or self.spec.algorithm.learning_rate

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def _set_lr(self, stage: StageSpec, step: int) -> float:
        warm = self.spec.algorithm.warmup_steps
        lr = self._stage_lr(stage) * (min(1.0, (step + 1) / warm) if warm > 0 else 1.0)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _out_of_time(self) -> bool:
        return self.ctx.broadcast(self.deadline is not None and time.time() > self.deadline)

    def _sync_weights(self) -> None:
        self.weights.sync(self.model, self.state.global_step)

    def _pool(self, source: str, n: int, seed: int) -> list[data_mod.Problem]:
        key = f"{source}|{n}|{seed}"
        if key not in self._pools:
            self._pools[key] = data_mod.load_problems(source, n, seed)
        return self._pools[key]

    def eval_problems(self) -> list[data_mod.Problem]:
        d = self.spec.data
        sources = d.eval or (["builtin:arith"] if d.train == "builtin:arith" else [])
        out: list[data_mod.Problem] = []
        for s in sources:
            out += self._pool(s, EVAL_SIZE, d.seed + data_mod.EVAL_SEED_OFFSET)
        return out

    def _rl_limits(self, stage: StageSpec) -> dict[str, int]:
        return {
            "max_turns": self.spec.stage_max_turns(stage),
            "max_response_tokens": self.spec.stage_max_response_tokens(stage),
        }

    def _prompt(self, p: data_mod.Problem) -> str:
        return template.render_prompt(p.question, self.spec.rollout.prompt_template)

    def checkpoint(self, stage: StageSpec) -> str:
        self.state.extra["history"] = self.result.history
        self.state.extra["evals"] = self.result.evals
        payload = make_payload(
            self.model, self.optimizer, self.state, self.tok.to_str(), self.model.config.to_dict(), self.ctx
        )
        self._saved_step = self.state.global_step
        if payload is None:  # an FSDP rank other than 0: it gave its shards, rank 0 writes
            return ""
        where = self.store.save(payload, self.state.global_step)
        self.sink.event("checkpoint", f"checkpoint {where}", stage.name, self.state.global_step)
        self._keep_events()
        return where

    def _checkpoint_unless_saved(self, stage: StageSpec) -> None:
        if self._saved_step != self.state.global_step:
            self.checkpoint(stage)

    def resume(self, payload: dict[str, Any] | None = None) -> bool:
        """Continue from ``payload`` (default: the store's newest checkpoint); False if none.

        With FSDP every rank calls this; rank 0's payload is the one that counts.
        """
        if payload is None and self.ctx.is_main:
            payload = self.store.load()
        index = self.ctx.broadcast(payload["state"]["stage_index"] if payload is not None else None)
        if index is None:
            return False
        stage = self.spec.stages[min(index, len(self.spec.stages) - 1)]
        self.optimizer = self._new_optimizer(self._stage_lr(stage))
        self.state, restored = apply_payload(payload, self.model, self.optimizer, self.ctx)
        self.result.history = list(self.state.extra.get("history", []))
        self.result.evals = dict(self.state.extra.get("evals", {}))
        self._saved_step = self.state.global_step
        self.sink.event(
            "resume", f"resumed at global step {self.state.global_step}", stage.name, self.state.global_step
        )
        if not restored:
            self.sink.event(
                "resume",
                "optimizer moments start afresh: the checkpoint's by-index optimizer state "
                "(an older kuberl) only loads in a single process",
                stage.name,
                self.state.global_step,
            )
        return True

    # -- evaluation --------------------------------------------------------------------------

    def evaluate(self, stage: StageSpec, label: str) -> float:
        """Sampled (temperature 1.0, one sample) accuracy on the held-out eval set."""
        probs = self.eval_problems() if self.ctx.is_main else []
        if not self.ctx.broadcast(bool(probs)):
            return math.nan
        self._sync_weights()
        if self.ctx.is_main:
            self._evaluate_on(probs, stage, label)
        self.result.evals = self.ctx.broadcast(self.result.evals)
        return self.result.evals[label]

    def _evaluate_on(self, probs: list[data_mod.Problem], stage: StageSpec, label: str) -> None:
        groups = self.call(
            "rollouts",
            [self._prompt(p) for p in probs],
            [p.answer for p in probs],
            1,
            temperature=self.spec.rollout.temperature,
            seed=self.spec.seed * 7919 + 17,
            **self._rl_limits(stage),
        )
        acc = sum(g[0].reward for g in groups) / len(groups)
        pos = [g[0] for g in groups if g[0].reward > 0]
        calls = sum(s.traj.tool_calls for s in pos)
        terr = sum(s.traj.tool_errors for s in pos) / calls if calls else math.nan
        self.result.evals[label] = acc
        self.result.evals[label + ":tool_error_ratio_positive"] = terr
        self.sink.step(
            {
                "type": "eval",
                "stage": stage.name,
                "step": self.state.global_step,
                "label": label,
                "accuracy": acc,
                "tool_error_ratio_positive": terr,
            }
        )

    # -- stages -------------------------------------------------------------------------------

    def run(self) -> RunResult:
        stages = self.spec.stages
        while self.state.stage_index < len(stages):
            stage = stages[self.state.stage_index]
            if self.state.stage_step == 0:
                self.sink.event(
                    "stage", f"stage {stage.name} ({stage.type}) starts", stage.name, self.state.global_step
                )
            if stage.type == "sft":
                self._run_sft(stage)
            else:
                self._run_rl(stage)
            if self.result.stopped_early:
                break
            self.state.stage_index += 1
            self.state.stage_step = 0
            self.state.cursor = 0
            nxt = stages[self.state.stage_index] if self.state.stage_index < len(stages) else None
            if nxt is not None and (nxt.reset_optimizer or nxt.type != stage.type):
                self.optimizer = self._new_optimizer(self._stage_lr(nxt))
                self.sink.event(
                    "stage", f"optimizer reset before {nxt.name}", nxt.name, self.state.global_step
                )
        self.sink.event(
            "done",
            "run finished" if not self.result.stopped_early else "stopped at the time limit",
            None,
            self.state.global_step,
        )
        self._keep_events()
        return self.result

    def _keep_events(self) -> None:
        """events.jsonl, metrics.jsonl and run.json next to the checkpoints too: a trainer pod's run
        folder dies with the pod, and they are what `kuberl report` and `kuberl status` read."""
        path = self.sink.events_path
        if path is None:
            return
        for name in KEPT_RUN_FILES:
            src = path.with_name(name)
            if not src.is_file():
                continue
            try:
                self.store.put_file(src, name)
            except Exception as err:  # noqa: BLE001 - the checkpoint is saved; annotations can wait
                log.warning("could not copy %s to %s: %s", name, self.store.uri, err)

    def _sft_data(self, stage: StageSpec) -> tuple[list[list[int]], list[list[int]]]:
        if stage.name not in self._sft_cache:  # each SFT stage may read its own data
            self._sft_cache[stage.name] = self.ctx.broadcast(
                self._build_sft_data(stage) if self.ctx.is_main else None
            )
        return self._sft_cache[stage.name]

    def _build_sft_data(self, stage: StageSpec) -> tuple[list[list[int]], list[list[int]]]:
        """The stage's traces: synthesized for ``builtin:arith`` (tool outputs from the sandbox),
        else read from the stage's ``data`` (jsonl chat traces, :func:`data.load_sft_traces`)."""
        source = stage.data or self.spec.data.train
        style = self.spec.rollout.prompt_template
        if source.startswith("builtin:"):
            batch = stage.batch_size or 32
            n = min(stage.steps * batch, SFT_POOL_MAX)
            probs = self._pool(source, n, self.spec.data.seed + 11)
            traces = self.call(
                "build_sft", probs, seed=self.spec.data.seed, error_fraction=SFT_ERROR_FRACTION, style=style
            )
        else:
            try:
                traces = data_mod.load_sft_traces(source, style)
            except ValueError as err:
                raise ValueError(
                    f"stage '{stage.name}' (sft): {err}; an SFT stage on your own data needs stage.data: "
                    'a jsonl of {"messages": [user, assistant/tool turns...]} traces'
                ) from err
        pairs = [data_mod.tokenize_segments(self.tok, segs) for segs in traces]
        limit = self.model.config.block_size
        fit = [p for p in pairs if len(p[0]) <= limit]
        if not fit:
            raise ValueError(f"no SFT trace fits the model's block_size ({limit} tokens)")
        if len(fit) < len(pairs):
            self.sink.event(
                "sft",
                f"dropped {len(pairs) - len(fit)} SFT traces longer than {limit} tokens",
                stage.name,
                self.state.global_step,
            )
        return [p[0] for p in fit], [p[1] for p in fit]

    def _run_sft(self, stage: StageSpec) -> None:
        batch = stage.batch_size or 32
        if self.state.stage_step < stage.steps:
            seqs, masks = self._sft_data(stage)
            self.model.train()
        while self.state.stage_step < stage.steps:
            if self._out_of_time():
                self.result.stopped_early = True
                self._checkpoint_unless_saved(stage)
                return
            t0 = time.perf_counter()
            seed_everything(self.spec.seed * 1_000_003 + self.state.global_step)
            lr = self._set_lr(stage, self.state.stage_step)
            idx = [(self.state.cursor + i) % len(seqs) for i in range(batch)]
            mine, tokens = idx, None
            if self.ctx.enabled:  # this rank's share; every rank knows the batch's token count
                mine = idx[self.ctx.rank :: self.ctx.world_size]
                tokens = float(sum(sum(masks[i][1:]) for i in idx))
            loss, acc = sft_loss(
                self.model, [seqs[i] for i in mine], [masks[i] for i in mine], self.device, num_tokens=tokens
            )
            self.optimizer.zero_grad(set_to_none=True)
            (loss * self.ctx.loss_scale).backward()
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.algorithm.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            self.optimizer.step()
            self.state.cursor = (self.state.cursor + batch) % len(seqs)
            loss_value, acc = self.ctx.all_reduce([float(loss.detach()), acc])
            rec = {
                "type": "sft",
                "loss": loss_value,
                "token_acc": acc,
                "lr": lr,
                "grad_norm": float(gn),
                "step_seconds": time.perf_counter() - t0,
            }
            self._after_step(stage, rec)
        self.model.eval()
        if stage.name not in self.result.evals:  # a run resumed at the stage's end has it already
            self.evaluate(stage, stage.name)
        self._checkpoint_unless_saved(stage)

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

        Step n's batch is submitted right after version n-k reached the engines, so it is at most
        k versions old when trained on; the weight push of each new version overlaps the
        generation in flight. A turn is one engine request, and a request finishes on the
        weights it started with (vLLM: ``pause?mode=wait``; LocalEngine: reports the version it
        started with), so a multi-turn rollout that spans a push carries the version of each turn
        and counts as old as its oldest turn: nothing is trained on with a staleness it does not
        have. Batches submitted ahead are not checkpointed: a resumed run generates them afresh.
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
        finally:
            for ticket in pending.values():  # stopped early or failed: not trained on
                self.call("discard_rollouts", ticket)
        if self.result.stopped_early:
            self._checkpoint_unless_saved(stage)
            self.evaluate(stage, stage.name)  # the accuracy at the time limit; not in the checkpoint
            return
        if stage.name not in self.result.evals:  # a run resumed at the stage's end has it already
            self.evaluate(stage, stage.name)
        self._checkpoint_unless_saved(stage)

    def _rl_step(self, stage: StageSpec, request, pending: dict[int, Any], k: int, batch: int, pool) -> None:
        a = self.spec.algorithm
        t0 = time.perf_counter()
        gstep = self.state.global_step
        seed_everything(self.spec.seed * 1_000_003 + gstep)
        lr = self._set_lr(stage, self.state.stage_step)
        self._sync_weights()  # version gstep reaches the engines (overlapping generation if k > 0)
        t1 = time.perf_counter()
        parts = None
        groups: list = []
        if self.ctx.is_main:
            if k == 0:
                self.call("step_stats")  # from here on: this step's figures alone (not an eval's)
                args, kwargs = request(0)
                groups = self.call("rollouts", *args, **kwargs)
            else:
                for ahead in range(min(k + 1, stage.steps - self.state.stage_step)):
                    if gstep + ahead not in pending:
                        args, kwargs = request(ahead)
                        pending[gstep + ahead] = self.call("submit_rollouts", *args, **kwargs)
                groups = self.call("collect_rollouts", pending.pop(gstep))
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
        # One optimizer step on fresh rollouts: pi_old is the update's own forward (rl_update's
        # on_policy), no separate recomputation. Equal on every rank (equal row counts).
        on_policy = a.ppo_epochs == 1 and mini_batches == 1 and k == 0
        logprob_gap = 0.0
        sizes = {"micro_batch_tokens": self.spec.trainer.micro_batch_tokens, "device": self.device}
        if not on_policy:
            logprob_gap = recompute_old_logprobs(self.model, sb, dist=self.ctx, **sizes) if sb.seqs else 0.0
            logprob_gap = self.ctx.all_reduce([logprob_gap])[0] / self.ctx.world_size
        gaps: dict[str, float] = {}
        n_check = self.spec.rollout.spot_check_rollouts
        spot = self.ctx.is_main and n_check and self.spec.rollout.spot_check_tolerance is not None
        if spot and k > 0:  # sampled by older versions: the engines score pi_old's rows instead
            target = sb
            if not any(map(any, sb.masks)) and not self.ctx.enabled:  # nothing trained: any rollouts
                target = spot_rows(groups, None, n_check)
                if target.seqs:
                    recompute_old_logprobs(self.model, target, **sizes)
            probe = probe_engines(self.call, target, gstep, n_check)
            self._engine_events(stage, finding_texts(probe, gstep))
            gaps = probe.gaps
        elif spot and not self.ctx.enabled:
            # The trained rows measure their engines (batch.gaps, from pi_old); the spot check
            # rescores rollouts of the other engines only, before the update changes the weights.
            probe = spot_rows(groups, gstep, n_check, skip=trained_engines(sb))
            if probe.seqs:
                recompute_old_logprobs(self.model, probe, **sizes)
                gaps = engine_gaps(probe)
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
        if on_policy:
            logprob_gap = upd.pop("rollout_logprob_gap", 0.0)
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

    def _after_step(self, stage: StageSpec, rec: dict[str, Any]) -> None:
        self.state.stage_step += 1
        self.state.global_step += 1
        rec = {
            "stage": stage.name,
            "step": self.state.global_step,
            "stage_step": self.state.stage_step,
            **rec,
        }
        self.result.history.append(rec)
        self.sink.step(rec)
        self.on_progress(stage.name, self.state.stage_step, stage.steps, rec)
        last = self.state.stage_step == stage.steps  # saved after the stage's eval instead
        if self.state.global_step % self.spec.checkpoint.every_steps == 0 and not last:
            self.checkpoint(stage)
