"""How the suite runs in parallel under pytest-xdist (pyproject's addopts: ``-n auto``).

Every test runs in the group of its file, one group on one worker:

* ``cluster``: the real control plane and node are one per host (one kubelet, one containerd
  root, one kube-proxy's iptables), so every file that meets them runs in one worker's session;
* ``vllm``: the real vLLM servers (~2 GB each, every core while they decode) and their timed
  weight pushes run one after another;
* any other file is a group of its own, so that its module-scoped fixtures start once.

The two long groups come first (collection order is kept: ``--no-loadscope-reorder``) and start at
once on workers of their own; the other files fill the workers around them. xdist's scheduler sees
node ids only, so the groups go by file name, and the collection check fails a test that needs the
cluster or a vLLM server in a file outside these names instead of letting it start a second
control plane beside the first.
"""

from __future__ import annotations

import os
from fnmatch import fnmatch
from typing import Any

import pytest

CLUSTER_FILES = ("test_k8s_*.py", "test_real_node*.py", "test_image_build.py", "test_elastic_fleet.py")
VLLM_FILES = ("test_vllm_*.py",)
CLUSTER_FIXTURES = frozenset({"control_plane", "kube", "kuberl_operator"})
CLUSTER_MARKS = ("k8s", "node", "images")
VLLM_FIXTURES = frozenset({"smollm2_dir", "vllm_url"})
FIRST = {"cluster": 0, "vllm": 1}
MAX_AUTO_WORKERS = 4


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid`` (``tests/test_x.py::test_y[param]``)."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if any(fnmatch(name, p) for p in CLUSTER_FILES):
        return "cluster"
    if any(fnmatch(name, p) for p in VLLM_FILES):
        return "vllm"
    return path


def needs(item: pytest.Item) -> str | None:
    """The shared group ``item`` must run in, by its fixtures and marks; None for any."""
    names = set(getattr(item, "fixturenames", ()))
    if names & CLUSTER_FIXTURES or any(item.get_closest_marker(m) for m in CLUSTER_MARKS):
        return "cluster"
    if names & VLLM_FIXTURES:
        return "vllm"
    return None


def order_and_check(items: list[pytest.Item]) -> None:
    """Puts the cluster and vllm groups first, keeping the order within each group, and refuses a
    test whose file name puts it outside the group its fixtures need."""
    wrong = [f"{item.nodeid} (needs {need})" for item in items
             if (need := needs(item)) is not None and group_of(item.nodeid) != need]  # fmt: skip
    if wrong:
        raise pytest.UsageError(
            "tests that meet the real cluster or a vLLM server must live in files named "
            f"{' or '.join(CLUSTER_FILES)} (cluster) or {' or '.join(VLLM_FILES)} (vllm), which run "
            "on one worker (tests/xdist_groups.py); move or rename: " + ", ".join(wrong[:5])
        )
    items.sort(key=lambda item: FIRST.get(group_of(item.nodeid), len(FIRST)))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with this module's groups as its scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def auto_workers() -> int:
    """``-n auto``: a worker per CPU this process may use, at most four: past that the files are
    spread thin while the cluster and vllm groups take as long, and every worker imports torch."""
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0))))
