"""The zygote (sandbox/process/zygote.py): calls' children are forked from a process that never saw a
call, yet are the worker's own children."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import pytest
from sandbox_helpers import memory_probe

from kuberl.sandbox.containment.slot import Slot
from kuberl.sandbox.process.calls import OwnForks, run_call
from kuberl.sandbox.process.zygote import Zygote, fork_sibling

# the slot fixture: without Landlock, so that a call may read its own /proc/self/mem
pytestmark = pytest.mark.slot_config(pool="zygote", memory_mb=512, landlock=False)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _in_middle(body) -> list[list[str]]:
    """Run ``body(w)`` in a forked middle process (whose CLONE_PARENT children are ours); the
    lines its children wrote to ``w``, split. Reaps those children (they exit 7)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # pragma: no cover - child
        try:
            os.close(r)
            body(w)
            os._exit(0)
        finally:
            os._exit(1)
    os.close(w)
    assert os.waitpid(middle, 0)[1] == 0
    rows = [line.split() for line in _read_all(r).decode().splitlines()]
    for row in rows:
        _, status = os.waitpid(int(row[0]), 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7
    return rows


def test_fork_sibling_makes_a_child_of_our_parent_with_a_working_interpreter():
    """CLONE_PARENT: the grandchild is ours to wait for; the interpreter's after-fork steps ran
    in it (threads start, ``random`` was reseeded: two siblings draw different numbers)."""

    def body(w: int) -> None:
        for _ in range(2):
            if fork_sibling() == 0:
                import random

                t = threading.Thread(target=lambda: None)
                t.start()
                t.join()
                os.write(w, f"{os.getpid()} {os.getppid()} {random.random()}\n".encode())
                os._exit(7)

    rows = _in_middle(body)
    assert len(rows) == 2
    assert {int(ppid) for _, ppid, _ in rows} == {os.getpid()}
    assert rows[0][2] != rows[1][2]


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, path, fstype, *_ = line.split()
            if fstype == "cgroup2":
                return path
    return None


def test_fork_sibling_into_a_cgroup_is_born_there():
    """clone3 with CLONE_INTO_CGROUP: the child starts in the given cgroup v2 (no migration,
    no wait for RCU) and is still our child (CLONE_PARENT)."""
    mount = _cgroup2_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("no cgroup v2 hierarchy we may write here")
    path = os.path.join(mount, f"kuberl-clone-into-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as err:
        pytest.skip(f"cannot make a cgroup v2 here: {err}")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:

        def body(w: int) -> None:
            if fork_sibling(fd) == 0:
                with open("/proc/self/cgroup") as fh:
                    unified = [ln for ln in fh.read().splitlines() if ln.startswith("0::")]
                os.write(w, f"{os.getpid()} {os.getppid()} {unified[0]}\n".encode())
                os._exit(7)

        rows = _in_middle(body)
        assert [(int(ppid), where) for _, ppid, where in rows] == [(os.getpid(), f"0::/{os.path.basename(path)}")]
    finally:
        os.close(fd)
        os.rmdir(path)


def test_a_zygote_that_cannot_clone_into_the_cgroup_forks_plainly_for_good():
    """A kernel or seccomp profile without clone3, or a descriptor that is no cgroup: the
    zygote's children are forked as before (and join the cgroup per call), and it stops trying."""
    from types import SimpleNamespace

    from kuberl.sandbox.process.zygote import _fork_child

    not_a_cgroup = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    slot = SimpleNamespace(clone_fd=not_a_cgroup, born_inside=False)

    def body(w: int) -> None:
        pid, inside = _fork_child(slot)
        if pid == 0:
            os.write(w, f"{os.getpid()} {int(inside)} {slot.clone_fd}\n".encode())
            os._exit(7)

    rows = _in_middle(body)
    assert [(inside, fd) for _, inside, fd in rows] == [("0", "None")]


def _probe(slot: Slot, forker: Zygote | OwnForks, reversed_needles: list[str]) -> dict:
    prepared = forker.take(slot)
    call = {"op": "exec", "code": memory_probe(reversed_needles), "stdin": "", "timeout": 30.0}
    result = run_call(slot, slot.cfg, prepared, call)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(prepared.pid, 0)
    assert result.get("meta", {}).get("status") == "ok", result
    return json.loads(result["stdout"])


def test_zygote_children_hold_nothing_the_worker_read_after_the_zygote_started(slot):
    """What the worker holds (a call it read, a gold answer) is not in a zygote's child; in a
    child the worker forks itself (OwnForks, without scrubbing) it is: the probe can tell."""
    zygote = Zygote.start(slot, slot.cfg, close=())
    try:
        assert zygote.pid in slot.protected and zygote.pid in slot.own_pids
        secret = "kuberl-gold-" + os.urandom(8).hex()  # read by the "worker" after the zygote forked
        # reversed only in the probe: its own copies and nothing else
        held = [secret[::-1], os.urandom(8).hex() + "-lortnoc-lrebuk"]
        out = _probe(slot, zygote, held)
        assert out["how"] == "maps"
        found, own = out["counts"]
        assert own >= 1 and found <= own, out
        # the next child too (forked ahead while the last call ran its course)
        assert _probe(slot, zygote, held)["counts"][0] <= own
    finally:
        zygote.close()
    own_forks = OwnForks(slot.cfg)
    try:
        found, own = _probe(slot, own_forks, held)["counts"]
        assert found > own  # a fork of this process inherits the secret
    finally:
        own_forks.close()


def test_a_dead_zygote_is_reported_not_waited_for(slot):
    from kuberl.sandbox.process.zygote import ZygoteGone

    zygote = Zygote.start(slot, slot.cfg, close=())
    zygote.close()
    with pytest.raises(ZygoteGone):
        zygote.take(slot)


def test_a_child_stopped_while_it_waited_still_runs_its_call(slot):
    """Where a call can signal processes of its uid (basic isolation without Landlock's signal
    scope), it may SIGSTOP the children forked ahead: the worker continues a child before it
    hands it a call, so the call does not wait out its deadline."""
    import signal
    import time

    zygote = Zygote.start(slot, slot.cfg, close=())
    try:
        prepared = zygote.take(slot)
        os.kill(prepared.pid, signal.SIGSTOP)
        started = time.monotonic()
        call = {"op": "exec", "code": "print('ran')", "stdin": "", "timeout": 10.0}
        result = run_call(slot, slot.cfg, prepared, call)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(prepared.pid, 0)
        assert (result["timed_out"], result["stdout"]) == (False, "ran\n"), result
        assert time.monotonic() - started < 5
    finally:
        zygote.close()


def test_the_worker_image_holds_no_pydantic_nor_the_api_models():
    """Every call forks an image of the worker (through its zygotes): what the worker imports,
    every call pays for. The configuration types must not pull in pydantic or kuberl.api."""
    import subprocess
    import sys

    code = (
        "import sys, kuberl.sandbox.process.worker\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or m.startswith('kuberl.api'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout
