"""The multi-stage recipe (paper section 4): an SFT stage, then RL stages with their own
response length / turn limits, the stage-3 offline difficulty filter and optimizer resets.

:class:`Pipeline` is the trainer driver. It owns the trainable model and optimizer and talks
to the rollout worker (a Ray actor, or the same object in-process) through a
:class:`~kuberl.rollout.client.RolloutClient`; an RL stage's steps are :func:`rl_step.rl_step`
calls, their batches owned by an :class:`~kuberl.rollout.orchestrator.Orchestrator`.
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

import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kuberl.api.job import AgenticRLJob, StageSpec
from kuberl.rollout import template
from kuberl.rollout.client import RolloutClient
from kuberl.rollout.loop import BatchRequest
from kuberl.rollout.orchestrator import Orchestrator
from kuberl.rollout.phases import PhaseAnnouncer, rollout_gpus
from kuberl.rollout.scored import Scored
from kuberl.trainer import data as data_mod
from kuberl.trainer import length_reward
from kuberl.trainer.checkpoint import CheckpointStore, TrainState, apply_payload, make_payload
from kuberl.trainer.distributed import DistContext
from kuberl.trainer.grpo import budget_rows
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.metrics import KEPT_RUN_FILES, MetricsSink
from kuberl.trainer.model import GPT
from kuberl.trainer.precision import compute_in
from kuberl.trainer.rl_step import StepSettings, rl_step
from kuberl.trainer.sft import sft_loss
from kuberl.trainer.spot_check import EngineWatch, finding_texts
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
        client: RolloutClient | None,
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
        loop in lockstep; rank 0 alone holds the rollout worker (``client``; None elsewhere), the
        store writes and the sink, and decides what the others must agree on (time limit,
        filters, evals).
        """
        self.ctx = ctx or DistContext()
        self.job = job
        self.spec = job.spec
        self.model = model
        self.tok = tokenizer
        self.client = client
        self.weights = weights if weights is not None else LocalWeights(client, self.ctx)
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

    def _seed_step(self) -> None:
        """Python, NumPy and torch seeded from (seed, global step): a resumed step draws the same."""
        seed_everything(self.spec.seed * 1_000_003 + self.state.global_step)

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

    def _with_budgets(
        self, probs: list[data_mod.Problem], seed: int
    ) -> tuple[list[data_mod.Problem], list[int] | None]:
        """With ``algorithm.lengthReward``: each problem with a drawn target's instruction beside
        its question, and the targets; else the problems as they are and None."""
        budget = self.spec.algorithm.length_reward
        if budget is None:
            return probs, None
        targets = length_reward.draw_targets(budget.targets, len(probs), seed)
        budgeted = [
            dataclasses.replace(
                p, question=length_reward.budget_prompt(p.question, budget.instruction, t, budget.position)
            )
            for p, t in zip(probs, targets, strict=True)
        ]
        return budgeted, targets

    def _request(
        self, stage: StageSpec, probs: list[data_mod.Problem], n: int, *, seed: int, **sampling: Any
    ) -> BatchRequest:
        """``n`` rollouts of each problem under the stage's turn and response limits; with
        ``algorithm.lengthReward`` each problem's prompt asks for a target length drawn from
        ``seed``."""
        probs, targets = self._with_budgets(probs, seed)
        return BatchRequest(
            [template.render_prompt(p.question, self.spec.rollout.prompt_template) for p in probs],
            [p.answer for p in probs],
            n,
            max_turns=self.spec.stage_max_turns(stage),
            max_response_tokens=self.spec.stage_max_response_tokens(stage),
            seed=seed,
            length_targets=targets,
            **sampling,
        )

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
        text = f"resumed at global step {self.state.global_step}"
        if dropped := self.sink.forget_after(self.state.global_step):
            text += f"; {dropped} records of later steps (trained before the run stopped) dropped: they train again"
        self.sink.event("resume", text, stage.name, self.state.global_step)
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
        groups = self.client.generate(
            self._request(
                stage, probs, 1, temperature=self.spec.rollout.temperature, seed=self.spec.seed * 7919 + 17
            )
        )
        acc = sum(g[0].reward for g in groups) / len(groups)
        pos = [g[0] for g in groups if g[0].reward > 0]
        calls = sum(s.traj.tool_calls for s in pos)
        terr = sum(s.traj.tool_errors for s in pos) / calls if calls else math.nan
        self.result.evals[label] = acc
        self.result.evals[label + ":tool_error_ratio_positive"] = terr
        budgets = self._budget_stats([g[0] for g in groups])
        self.result.evals.update(
            {f"{label}:{k}": budgets[k] for k in ("length_gap_mean", "length_adherence") if k in budgets}
        )
        self.sink.step(
            {
                "type": "eval",
                "stage": stage.name,
                "step": self.state.global_step,
                "label": label,
                "accuracy": acc,
                "tool_error_ratio_positive": terr,
                **budgets,
            }
        )

    def _budget_stats(self, scored: list[Scored]) -> dict[str, float]:
        """How the held-out rollouts kept their thinking budgets ({} without a length reward)."""
        budget = self.spec.algorithm.length_reward
        if budget is None:
            return {}
        rows = budget_rows(scored, budget.alpha, budget.count_tool_tokens)
        return length_reward.length_stats(rows)

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
                self.run_rl(stage)
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
            # SFT traces start from the prompts RL samples from: with thinking budgets, a target's
            # instruction beside each question (the traces' lengths do not follow it: RL teaches that)
            pool = self._pool(source, n, self.spec.data.seed + 11)
            probs, _ = self._with_budgets(pool, self.spec.data.seed + 13)
            traces = self.client.build_sft(
                probs, seed=self.spec.data.seed, error_fraction=SFT_ERROR_FRACTION, style=style
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
            self._seed_step()
            lr = self._set_lr(stage, self.state.stage_step)
            idx = [(self.state.cursor + i) % len(seqs) for i in range(batch)]
            mine, tokens = idx, None
            if self.ctx.enabled:  # this rank's share; every rank knows the batch's token count
                mine = idx[self.ctx.rank :: self.ctx.world_size]
                tokens = float(sum(sum(masks[i][1:]) for i in idx))
            with compute_in(self.spec.trainer.precision, self.device):
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

    # -- RL stages ----------------------------------------------------------------------------

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
        request = self._request(
            stage, probs, f.rollouts, temperature=self.spec.rollout.temperature, seed=self.spec.seed * 31 + 5
        )
        groups = self.client.generate(request)
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

    def run_rl(self, stage: StageSpec) -> None:
        """The stage's GRPO-RoC steps (:func:`rl_step`), then its eval and checkpoint; with
        ``algorithm.asyncLevel`` k > 0 the batches of the next k steps generate while a step
        trains (the orchestrator's part)."""
        a = self.spec.algorithm
        batch = stage.batch_size or a.batch_prompts
        pool = self._rl_pool(stage)
        n = a.rollouts_per_prompt if self.algorithm == "grpo-roc" else a.group_size
        settings = StepSettings(self.spec, self.algorithm, self.loss_cfg, self.ctx, self.device)
        self.model.eval()

        def request(ahead: int) -> BatchRequest:
            """The batch of the step ``ahead`` steps after the current one."""
            probs = [pool[(self.state.cursor + ahead * batch + i) % len(pool)] for i in range(batch)]
            seed = self.spec.seed * 1_000_003 + self.state.global_step + ahead
            return self._request(
                stage,
                probs,
                n,
                temperature=self.spec.rollout.temperature,
                top_p=self.spec.rollout.top_p,
                seed=seed,
            )

        client = self.client if self.ctx.is_main else None
        phases = PhaseAnnouncer(
            self.job.metadata.name,
            rollout_gpus(),
            overlapping=a.async_level > 0,
            pool=os.environ.get("KUBERL_SANDBOX_POOL", ""),
        )
        with Orchestrator(client, self.weights, request, ahead=a.async_level, phases=phases) as orch:
            while self.state.stage_step < stage.steps:
                if self._out_of_time():
                    self.result.stopped_early = True
                    break
                self._seed_step()
                lr = self._set_lr(stage, self.state.stage_step)
                step = rl_step(
                    self.model,
                    self.optimizer,
                    orch,
                    settings,
                    version=self.state.global_step,
                    steps_left=stage.steps - self.state.stage_step,
                    lr=lr,
                )
                self.state.cursor = (self.state.cursor + batch) % len(pool)
                if step.probe is not None:
                    self._engine_events(stage, finding_texts(step.probe, self.state.global_step))
                if step.gaps:
                    self._engine_events(stage, self._engines.update(step.gaps))
                self._after_step(stage, step.record)
            orch.join()  # the last push (its errors raise here)
        if self.result.stopped_early:
            self._checkpoint_unless_saved(stage)
            self.evaluate(stage, stage.name)  # the accuracy at the time limit; not in the checkpoint
            return
        if stage.name not in self.result.evals:  # a run resumed at the stage's end has it already
            self.evaluate(stage, stage.name)
        self._checkpoint_unless_saved(stage)

    def _engine_events(self, stage: StageSpec, texts: list[str]) -> None:
        for text in texts:
            self.sink.event("engine", text, stage.name, self.state.global_step)
