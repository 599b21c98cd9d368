"""bench/real_model.py's pure pieces: the seeded manifest copy and the thinking-budget table."""

import importlib.util
import math
from pathlib import Path

from kuberl.api.loader import load_manifests

BENCH = Path(__file__).resolve().parent.parent / "bench"
REPO = BENCH.parent

_spec = importlib.util.spec_from_file_location("bench_real_model", BENCH / "real_model.py")
real_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model)


def test_seeded_manifest_changes_only_the_seed(tmp_path):
    src = REPO / "examples" / "smollm2-thinking-budgets.yaml"
    path = real_model.seeded_manifest(src, 2, tmp_path / "m")
    (orig,) = load_manifests(src)
    (copy,) = load_manifests(path)
    assert copy.spec.seed == 2 and orig.spec.seed == 0
    assert copy.spec.model_copy(update={"seed": 0}) == orig.spec
    assert copy.spec.algorithm.length_reward.targets == [32, 64, 128]


def _rl(step: int, gap32: float, gap128: float, adh: float) -> dict:
    return {
        "type": "rl",
        "step": step,
        "length_gap_mean": (gap32 + gap128) / 2,
        "length_gap_t32": gap32,
        "length_gap_t128": gap128,
        "length_adherence": adh,
    }


def test_budget_summary_windows_and_evals():
    metrics = [
        {
            "type": "eval",
            "label": "sft",
            "length_gap_mean": 50.0,
            "length_gap_t32": 30.0,
            "length_adherence": 0.0,
        },
        *[_rl(i, 40.0, 80.0, 0.0) for i in range(1, 4)],
        *[_rl(i, 10.0, 20.0, 0.5) for i in range(4, 7)],
        {
            "type": "eval",
            "label": "rl",
            "length_gap_mean": 12.0,
            "length_gap_t32": 8.0,
            "length_adherence": 0.25,
        },
    ]
    rows = dict(real_model.budget_summary(metrics, window=3))
    assert list(rows) == ["held-out after SFT", "RL steps 1-3", "RL steps 4-6", "held-out after RL"]
    assert rows["RL steps 1-3"]["length_gap_t128"] == 80.0
    assert rows["RL steps 4-6"]["length_gap_mean"] == 15.0
    assert rows["RL steps 4-6"]["length_adherence"] == 0.5
    assert rows["held-out after RL"]["length_gap_t32"] == 8.0
    assert math.isnan(rows["held-out after RL"]["length_gap_t128"])  # no eval figure for it
    table = real_model._budget_table(list(rows.items()))
    assert "target 128" in table and "50.0%" in table.splitlines()[3]


def test_budget_summary_is_empty_without_a_length_reward():
    assert (
        real_model.budget_summary([{"type": "rl", "reward_mean": 0.5}, {"type": "eval", "label": "rl"}]) == []
    )
