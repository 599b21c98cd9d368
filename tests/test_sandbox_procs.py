"""The /proc and pidfd helpers the worker cleans up with (sandbox/procs.py)."""

from __future__ import annotations

import os
import signal
import time

from kuberl.sandbox.procs import wait_for_exit


def _child(seconds: float) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        time.sleep(seconds)
        os._exit(0)
    return pid


def test_wait_for_exit_wakes_on_the_exit_not_on_the_timeout():
    quick, slow = _child(0.05), _child(30)
    try:
        t = time.monotonic()
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
