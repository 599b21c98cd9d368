"""The bench extra's pins (issue 41 item 1): TRL's side of bench/peers.py builds its prompts with
``datasets.Dataset.from_list``, which failed where dill could not pickle pyarrow's MonthDayNano.
The extra pins a datasets/pyarrow/dill set that works; where that set is installed (TRL is, or
KUBERL_BENCH_EXTRA=1 says it must be) ``from_list`` is run for real."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
PINNED = ("trl", "datasets", "pyarrow", "dill")


def bench_pins() -> dict[str, str]:
    """name -> exact version of the bench extra's ``==`` requirements."""
    extra = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["bench"]
    pins = {}
    for req in extra:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.]*)", req.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_the_bench_extra_pins_the_set_whose_from_list_works():
    pins = bench_pins()
    missing = [name for name in PINNED if name not in pins]
    assert not missing, f"pyproject's bench extra must pin {missing} with == (a set verified to work)"


def _required() -> bool:
    return importlib.util.find_spec("trl") is not None or os.environ.get("KUBERL_BENCH_EXTRA") == "1"


def test_dataset_from_list_runs_where_the_bench_extra_is_installed():
    if importlib.util.find_spec("datasets") is None and not _required():
        pytest.skip("the bench extra is not installed (pip install -e .[bench])")
    installed = {name: importlib.metadata.version(name) for name in PINNED}
    wrong = {n: (v, bench_pins()[n]) for n, v in installed.items() if v != bench_pins()[n]}
    assert not wrong, f"installed (version, pin) differ from the bench extra: {wrong}; reinstall .[bench]"
    import datasets

    rows = [{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}, {"prompt": [], "answer": "7"}]
    ds = datasets.Dataset.from_list(rows)
    assert len(ds) == 2 and ds[0]["answer"] == "5"
    mapped = ds.map(lambda r: {"n": len(r["answer"])})  # map() hashes its function with dill
    assert mapped["n"] == [1, 1]
