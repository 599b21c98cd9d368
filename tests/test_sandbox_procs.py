"""The /proc and pidfd helpers the worker cleans up with (sandbox/containment/procs.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from kuberl.sandbox.containment.procs import uid_has_processes, wait_for_exit


def _child(seconds: float) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        time.sleep(seconds)
        os._exit(0)
    return pid


def test_wait_for_exit_wakes_on_the_exit_not_on_the_timeout():
    t = time.monotonic()  # before the fork: the child's 50 ms start there, however slow the fork
    quick, slow = _child(0.05), _child(30)
    try:
        wait_for_exit([quick], 5.0)
        took = time.monotonic() - t
        assert 0.03 < took < 2.0, took  # woke at the exit, far before the 5 s timeout
        assert os.waitpid(quick, os.WNOHANG)[0] == quick  # exited (a zombie until now)

        t = time.monotonic()
        wait_for_exit([slow], 0.1)  # still running: the timeout bounds the wait
        took = time.monotonic() - t
        assert 0.09 < took < 2.0, took
        os.kill(slow, signal.SIGKILL)
        t = time.monotonic()
        wait_for_exit([slow, 2**22 + 12345], 5.0)  # a pid that does not exist counts as gone
        assert time.monotonic() - t < 2.0
    finally:
        for pid in (quick, slow):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def test_unlinked_files_held_only_by_a_mapping_are_counted(tmp_path):
    """A file mapped one page, its descriptor closed and its name unlinked still holds all its
    blocks; the mapping (/proc/PID/maps, followed through map_files) is how to find it."""
    import ctypes

    from kuberl.sandbox.containment.procs import unlinked_bytes

    if os.geteuid() != 0:
        pytest.skip("/proc/PID/map_files needs CAP_CHECKPOINT_RESTORE or root")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    path = tmp_path / "held"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, 8 * 2**20)
    addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    try:
        assert unlinked_bytes([os.getpid()], str(tmp_path)) == 0  # still named: the scan sees it
        os.unlink(path)
        assert unlinked_bytes([os.getpid()], str(tmp_path)) >= 8 * 2**20
    finally:
        libc.munmap(addr, 4096)


def test_uid_processes_skips_the_pids_it_is_told_are_not_the_uids():
    """The worker passes its zygotes and their waiting children (root until a request reaches
    them): with every live process skipped there is nothing of the uid left to find."""
    child = _child(5)
    try:
        assert uid_has_processes(os.getuid())
        for _ in range(20):  # a process that starts between the listing and the look (a kernel thread)
            everyone = frozenset(int(p) for p in os.listdir("/proc") if p.isdigit())
            if not uid_has_processes(os.getuid(), everyone):
                break
        else:
            pytest.fail("processes of our uid kept being found though all were skipped")
        assert child in everyone and uid_has_processes(os.getuid(), everyone - {child})
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_descendants_walks_the_tree_below_a_process_as_one_pass_over_proc_finds_it(monkeypatch):
    """A child, its own child and a thread's child: the walk down the kernel's children lists
    finds the same processes as the pass over all of /proc, and nothing outside the tree."""
    import subprocess
    import sys

    from kuberl.sandbox.containment import procs

    # the child starts a grandchild from a second thread (a thread's children list is its own)
    code = (
        "import subprocess, sys, threading, time\n"
        "kids = []\n"
        "t = threading.Thread(target=lambda: kids.append(subprocess.Popen(['sleep', '30'])))\n"
        "t.start(); t.join()\n"
        "kids.append(subprocess.Popen(['sleep', '30']))\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "30"])
    grandchildren: set[int] = set()
    try:
        assert child.stdout is not None
        grandchildren = {int(p) for p in child.stdout.readline().split()}
        assert len(grandchildren) == 2
        walked = set(procs.descendants(os.getpid()))
        assert {child.pid, *grandchildren} <= walked and bystander.pid in walked  # both are ours
        assert set(procs.descendants(child.pid)) == grandchildren
        monkeypatch.setattr(procs, "CHILDREN_FILES", False)
        assert set(procs.descendants(child.pid)) == grandchildren  # the pass over /proc agrees
        assert procs.descendants(bystander.pid) == []
    finally:
        for p in (child, bystander):
            p.kill()
            p.wait()
        for pid in grandchildren:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
