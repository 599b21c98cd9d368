"""An RL stage's prompt pool and the offline difficulty filter (paper stage 3): problems the
current policy solves k/k are dropped before the stage trains; the kept indices are part of the
run's state, so a resumed stage trains on the same pool."""

from __future__ import annotations

from kuberl.api.job import StageSpec
from kuberl.trainer import data as data_mod
from kuberl.trainer.stage_host import StageHost


def rl_pool(pipe: StageHost, stage: StageSpec) -> list[data_mod.Problem]:
    batch = stage.batch_size or pipe.spec.algorithm.batch_prompts
    source = stage.data or pipe.spec.data.train
    idx = pipe.spec.stages.index(stage)
    probs = pipe.problems.pool(source, stage.steps * batch, pipe.spec.data.seed + 1000 * (idx + 1))
    keep = pipe.state.extra.get(f"filter:{stage.name}")
    if stage.difficulty_filter is not None and keep is None:
        keep = difficulty_filter(pipe, stage, probs)
        pipe.state.extra[f"filter:{stage.name}"] = keep
    return [probs[i] for i in keep] if keep is not None else probs


def difficulty_filter(pipe: StageHost, stage: StageSpec, probs: list[data_mod.Problem]) -> list[int]:
    """Indices of problems the current policy does NOT solve k/k (paper stage 3)."""
    pipe.sync_weights()
    return pipe.ctx.broadcast(_filter_on(pipe, stage, probs) if pipe.ctx.is_main else None)


def _filter_on(pipe: StageHost, stage: StageSpec, probs: list[data_mod.Problem]) -> list[int]:
    f = stage.difficulty_filter
    assert f is not None
    request = pipe.problems.request(
        stage, probs, f.rollouts, temperature=pipe.spec.rollout.temperature, seed=pipe.spec.seed * 31 + 5
    )
    groups = pipe.client.generate(request)
    keep = [i for i, g in enumerate(groups) if not (f.drop_if_all_correct and all(s.reward > 0 for s in g))]
    if not keep:
        keep = list(range(len(probs)))  # everything solved: keep the pool rather than train on nothing
    pipe.sink.event(
        "filter",
        f"difficulty filter kept {len(keep)}/{len(probs)} problems",
        stage.name,
        pipe.state.global_step,
    )
    return keep
