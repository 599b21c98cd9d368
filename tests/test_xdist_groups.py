"""The groups the suite runs in under pytest-xdist (tests/xdist_groups.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from xdist_groups import group_of, order_and_check


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)
    marks: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def test_files_fall_into_the_cluster_the_vllm_or_their_own_group():
    assert group_of("tests/test_k8s_kueue.py::test_x") == "cluster"
    assert group_of("tests/test_real_node_trainer.py::test_x[a-b]") == "cluster"
    assert group_of("tests/test_elastic_fleet.py::test_x") == "cluster"
    assert group_of("tests/test_vllm_kill.py::test_x[0-reload]") == "vllm"
    assert group_of("tests/test_api.py::test_x") == "tests/test_api.py"
    # a parameter that looks like a file name does not move a test
    assert group_of("tests/test_api.py::test_x[test_k8s_y.py]") == "tests/test_api.py"


def test_the_long_groups_come_first_and_the_rest_keep_their_order():
    items = [FakeItem("tests/test_a.py::t1"), FakeItem("tests/test_vllm_real.py::t", ["vllm_url"]),
             FakeItem("tests/test_b.py::t"), FakeItem("tests/test_k8s_x.py::t", ["kube"]),
             FakeItem("tests/test_a.py::t2")]  # fmt: skip
    order_and_check(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/test_k8s_x.py::t", "tests/test_vllm_real.py::t",
        "tests/test_a.py::t1", "tests/test_b.py::t", "tests/test_a.py::t2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("item", "need"),
    [
        (FakeItem("tests/test_api.py::t", ["control_plane"]), "cluster"),
        (FakeItem("tests/test_api.py::t", marks=("node",)), "cluster"),
        (FakeItem("tests/test_api.py::t", ["smollm2_dir"]), "vllm"),
        (FakeItem("tests/test_vllm_real.py::t", ["kube"]), "cluster"),
    ],
)
def test_a_test_that_needs_a_shared_group_outside_its_files_is_refused(item, need):
    with pytest.raises(pytest.UsageError, match=rf"tests/test_\w+\.py::t \(needs {need}\)"):
        order_and_check([item])  # type: ignore[list-item]
