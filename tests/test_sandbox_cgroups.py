"""Slot cgroups: the v1/v2 file protocol on a scratch tree, and the real hierarchy of this host."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kuberl.sandbox.containment.cgroups import CGROUP_ROOT, V2_PARENT, SlotCgroup, slot_cgroup

MB = 2**20


def _v2_tree(tmp_path: Path, root_controllers: str = "cpu io") -> Path:
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text(root_controllers + "\n")
    return tmp_path


def test_v2_enables_controllers_and_writes_limits(tmp_path):
    root = _v2_tree(tmp_path)
    cg = slot_cgroup("slot-a", 512 * MB, 32, root=str(root), cpu_cap=True)
    assert (cg.version, cg.memory, cg.pids) == (2, True, True)
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    parent = root / V2_PARENT
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"  # cpu where offered
    slot = parent / "slot-a"
    assert (slot / "memory.max").read_text() == str(512 * MB)
    assert (slot / "memory.swap.max").read_text() == "0"
    assert (slot / "pids.max").read_text() == "32"
    assert (slot / "cpu.max").read_text() == "100000 100000" and cg.cpu  # one core per slot
    cg.join(4242)
    (slot / "cgroup.procs").write_text("4242\n4243\n")
    assert cg.members() == {4242, 4243}
    cg.kill()
    assert (slot / "cgroup.kill").read_text() == "1"


def test_v2_memory_limit_is_counted_from_the_mark(tmp_path):
    root = _v2_tree(tmp_path, "memory pids")
    cg = slot_cgroup("slot-b", 64 * MB, 8, root=str(root))
    events = root / V2_PARENT / "slot-b" / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    cg.mark()  # an earlier call's OOM must not be blamed on the next one
    assert not cg.hit_memory_limit()
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    assert cg.hit_memory_limit()
    assert (root / "cgroup.subtree_control").read_text() == "memory pids\n"  # left alone


def test_v2_without_delegation_degrades_to_no_cgroup(tmp_path):
    root = _v2_tree(tmp_path)
    (root / "cgroup.subtree_control").unlink()
    (root / "cgroup.subtree_control").mkdir()  # unwritable: like EBUSY/EACCES in a container
    cg = slot_cgroup("slot-c", 64 * MB, 8, root=str(root))
    assert type(cg) is SlotCgroup and not (cg.memory or cg.pids)


def test_v1_writes_both_hierarchies_and_removes_them(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "pids").mkdir()
    cg = slot_cgroup("slot-d", 128 * MB, 16, root=str(tmp_path))
    assert (cg.version, cg.memory, cg.pids) == (1, True, True)
    mem, pids = tmp_path / "memory" / "kuberl" / "slot-d", tmp_path / "pids" / "kuberl" / "slot-d"
    assert (mem / "memory.limit_in_bytes").read_text() == str(128 * MB)
    assert (pids / "pids.max").read_text() == "16"
    (mem / "memory.failcnt").write_text("3")
    cg.mark()
    assert (mem / "memory.failcnt").read_text() == "0" and not cg.hit_memory_limit()
    for p in (mem, pids):  # a real cgroupfs has no regular files to delete
        for f in p.iterdir():
            f.unlink()
    cg.remove()
    assert not mem.exists() and not pids.exists()


def test_no_cgroup_filesystem(tmp_path):
    cg = slot_cgroup("slot-e", 64 * MB, 8, root=str(tmp_path))
    assert type(cg) is SlotCgroup and cg.members() == set() and not cg.hit_memory_limit()


def test_real_hierarchy_tracks_and_kills_a_detached_process():
    """On this host's own cgroup filesystem (v1 or v2), where we may create cgroups."""
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    cg = slot_cgroup(f"pytest-{os.getpid()}", 64 * MB, 8)
    if not cg.pids:
        pytest.skip(f"no writable pids cgroup under {CGROUP_ROOT} here")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: join, then leave a setsid grandchild behind
        try:
            cg.join(os.getpid())
            if os.fork() == 0:
                os.setsid()
                os.write(w, b"x")
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        os.waitpid(pid, 0)
        members = cg.members()
        assert len(members) == 1, members  # the detached grandchild is still listed
        cg.kill()
        for m in members:
            os.kill(m, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while cg.members() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cg.members() == set()
        for m in members:  # gone, or a zombie waiting for whoever inherited it
            ps = subprocess.run(["ps", "-o", "stat=", "-p", str(m)], capture_output=True, text=True)
            assert ps.stdout.strip()[:1] in ("", "Z"), ps.stdout
    finally:
        os.close(r)
        cg.remove()


@pytest.mark.parametrize("children_inside", [False, True])
def test_v2_children_waiting_in_the_slot_get_room_and_are_not_swept_with_cgroup_kill(tmp_path, children_inside):
    """Where clone3 puts children into the slot's cgroup v2 as they are born, the child each
    other zygote forked ahead waits there during a call: the cap makes room for it and clearing
    the slot kills process by process (sparing it) instead of writing ``cgroup.kill``."""
    from kuberl.sandbox.config import WorkerConfig
    from kuberl.sandbox.containment.slot import Slot

    root = _v2_tree(tmp_path)
    cfg = WorkerConfig(slot=0, pool=f"room{os.getpid()}", isolation="basic", memory_mb=256, max_processes=16)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: kill_all reaps, which must not touch pytest's children
        try:
            os.close(r)
            slot = Slot(cfg, False)
            slot.cgroup = slot_cgroup("slot-room", 256 * MB, 16, root=str(root))
            zygotes = [2**22 - 3, 2**22 - 2]  # (no such processes: nothing is really signalled)
            slot.keep_alive = frozenset(zygotes)
            slot.make_room(zygotes, children_inside)
            slot.kill_all()
            slot.remove()
            os.write(w, b"ok")
            os._exit(0)
        finally:
            os._exit(1)
    os.close(w)
    assert os.waitpid(pid, 0)[1] == 0 and os.read(r, 2) == b"ok"
    os.close(r)
    cg = root / V2_PARENT / "slot-room"
    assert (cg / "pids.max").read_text() == ("17" if children_inside else "16")
    assert (cg / "cgroup.kill").exists() != children_inside
