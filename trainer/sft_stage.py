"""An SFT stage: its traces (synthesized for ``builtin:arith`` with tool outputs from the
sandbox, else read from the stage's data), the steps over them, then its eval and checkpoint.

The loss itself is :func:`kuberl.trainer.sft.sft_loss`.
"""

from __future__ import annotations

import time

import torch

from kuberl.api.job import StageSpec
from kuberl.trainer import data as data_mod
from kuberl.trainer.precision import compute_in
from kuberl.trainer.sft import sft_loss
from kuberl.trainer.stage_host import StageHost
from kuberl.trainer.step_record import StepRecord

SFT_ERROR_FRACTION = 0.3  # SFT traces that make a tool error and then fix it
SFT_POOL_MAX = 2048  # distinct SFT traces (cycled); each one's tool outputs come from the sandbox

Traces = tuple[list[list[int]], list[list[int]]]  # token ids and loss masks, one row per trace


class SftStage:
    def __init__(self, pipe: StageHost):
        self.pipe = pipe
        self._cache: dict[str, Traces] = {}

    def data(self, stage: StageSpec) -> Traces:
        pipe = self.pipe
        if stage.name not in self._cache:  # each SFT stage may read its own data
            self._cache[stage.name] = pipe.ctx.broadcast(
                self._build_data(stage) if pipe.ctx.is_main else None
            )
        return self._cache[stage.name]

    def _build_data(self, stage: StageSpec) -> Traces:
        """The stage's traces: synthesized for ``builtin:arith`` (tool outputs from the sandbox),
        else read from the stage's ``data`` (jsonl chat traces, :func:`data.load_sft_traces`)."""
        pipe = self.pipe
        source = stage.data or pipe.spec.data.train
        style = pipe.spec.rollout.prompt_template
        if source.startswith("builtin:"):
            batch = stage.batch_size or 32
            n = min(stage.steps * batch, SFT_POOL_MAX)
            # SFT traces start from the prompts RL samples from: with thinking budgets, a target's
            # instruction beside each question (the traces' lengths do not follow it: RL teaches that)
            pool = pipe.problems.pool(source, n, pipe.spec.data.seed + 11)
            probs, _ = pipe.problems.with_budgets(pool, pipe.spec.data.seed + 13)
            traces = pipe.client.build_sft(
                probs, seed=pipe.spec.data.seed, error_fraction=SFT_ERROR_FRACTION, style=style
            )
        else:
            try:
                traces = data_mod.load_sft_traces(source, style)
            except ValueError as err:
                raise ValueError(
                    f"stage '{stage.name}' (sft): {err}; an SFT stage on your own data needs stage.data: "
                    'a jsonl of {"messages": [user, assistant/tool turns...]} traces'
                ) from err
        pairs = [data_mod.tokenize_segments(pipe.tok, segs) for segs in traces]
        limit = pipe.model.config.block_size
        fit = [p for p in pairs if len(p[0]) <= limit]
        if not fit:
            raise ValueError(f"no SFT trace fits the model's block_size ({limit} tokens)")
        if len(fit) < len(pairs):
            pipe.sink.event(
                "sft",
                f"dropped {len(pairs) - len(fit)} SFT traces longer than {limit} tokens",
                stage.name,
                pipe.state.global_step,
            )
        return [p[0] for p in fit], [p[1] for p in fit]

    def run(self, stage: StageSpec) -> None:
        pipe = self.pipe
        batch = stage.batch_size or 32
        if pipe.state.stage_step < stage.steps:
            seqs, masks = self.data(stage)
            pipe.model.train()
        while pipe.state.stage_step < stage.steps:
            if pipe.out_of_time():
                pipe.result.stopped_early = True
                pipe.checkpoint_unless_saved(stage)
                return
            t0 = time.perf_counter()
            pipe.seed_step()
            lr = pipe.set_lr(stage, pipe.state.stage_step)
            idx = [(pipe.state.cursor + i) % len(seqs) for i in range(batch)]
            mine, tokens = idx, None
            if pipe.ctx.enabled:  # this rank's share; every rank knows the batch's token count
                mine = idx[pipe.ctx.rank :: pipe.ctx.world_size]
                tokens = float(sum(sum(masks[i][1:]) for i in idx))
            with compute_in(pipe.spec.trainer.precision, pipe.device):
                loss, acc = sft_loss(
                    pipe.model,
                    [seqs[i] for i in mine],
                    [masks[i] for i in mine],
                    pipe.device,
                    num_tokens=tokens,
                )
                pipe.optimizer.zero_grad(set_to_none=True)
                (loss * pipe.ctx.loss_scale).backward()
            gn = torch.nn.utils.clip_grad_norm_(pipe.model.parameters(), pipe.spec.algorithm.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            pipe.optimizer.step()
            pipe.state.cursor = (pipe.state.cursor + batch) % len(seqs)
            loss_value, acc = pipe.ctx.all_reduce([float(loss.detach()), acc])
            rec = StepRecord(
                type="sft",
                step=pipe.state.global_step + 1,
                loss=loss_value,
                token_acc=acc,
                lr=lr,
                grad_norm=float(gn),
                step_seconds=time.perf_counter() - t0,
            )
            pipe.after_step(stage, rec)
        pipe.model.eval()
        if stage.name not in pipe.result.evals:  # a run resumed at the stage's end has it already
            pipe.evaluate(stage, stage.name)
        pipe.checkpoint_unless_saved(stage)
