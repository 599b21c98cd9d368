"""asyncLevel k lets k batches generate at once where the engines gain from it: the batch of step
n+2 samples version n at level 2 when generation is the slow side; level 1 and engines that pad
rows keep one batch at a time; nothing older than k is trained on."""

from __future__ import annotations

import asyncio

import builders
import pytest
from trainer_fakes import FakeSandbox

from kuberl.rollout.local_engine import LocalEngine
from kuberl.trainer.local import run_job
from tests.test_trainer_pipeline import TINY

ALGORITHM, CHECKPOINT = TINY["spec"]["algorithm"], TINY["spec"]["checkpoint"]
SFT, RL = TINY["spec"]["stages"]
TURN_SECONDS = 0.4  # each engine request takes this long after its tokens: generation is the slow side


class SlowEngine(LocalEngine):
    """The local engine with every request ``TURN_SECONDS`` long: a turn keeps the version it
    started with (taken when the engine accepts it), as on a slow GPU fleet."""

    def __init__(self, model, *, pads_rows: bool):
        super().__init__(model, max_total_tokens=1 << 20, max_batch=64, seed=0)
        self.pads_rows = pads_rows

    async def generate(self, req):
        out = await super().generate(req)
        await asyncio.sleep(TURN_SECONDS)
        return out


def _run(tmp_path, monkeypatch, level: int, pads_rows: bool) -> list:
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    job = builders.job(
        of=TINY,
        algorithm={**ALGORITHM, "asyncLevel": level},
        stages=[SFT, {**RL, "steps": 4}],
        checkpoint={**CHECKPOINT, "uri": str(tmp_path / "ck")},
    )
    res = run_job(
        job,
        tmp_path / "out",
        use_ray=False,
        executor_factory=FakeSandbox,
        engine_factory=lambda model, tok: SlowEngine(model, pads_rows=pads_rows),
        quiet=True,
    )
    rl = [h for h in res.history if h.type == "rl"]
    assert len(rl) == 4 and all(h.rollouts == 8 and h.rollouts_stale == 0 for h in rl), rl
    return rl


@pytest.mark.parametrize(
    ("level", "pads_rows", "ages"),
    [
        (2, False, [0, 1, 2, 2]),  # the batch of step n+2 starts at step n, beside n+1's, on version n
        (1, False, [0, 1, 1, 1]),  # one batch ahead: version n for step n+1, as before
        (2, True, [0, 1, 1, 1]),  # padded rows: batches in turn, step n+2's starts after version n+1
    ],
)
def test_level_k_runs_k_versions_ahead_where_batches_generate_together(
    tmp_path, monkeypatch, level, pads_rows, ages
):
    rl = _run(tmp_path, monkeypatch, level, pads_rows)
    # every rollout of a step as old as the level allows (its oldest turn counts), none older
    assert [h.staleness_max for h in rl] == ages, rl
    assert [h.staleness_mean for h in rl] == ages, rl
    assert all(h.staleness_max <= level for h in rl)
