"""The processes kuberl starts end with the process that started them, however it ends.

* :func:`tied_to_this_process` runs a command so that the kernel sends it SIGTERM when this
  process dies, SIGKILL included (``PR_SET_PDEATHSIG``, set by a tiny exec wrapper in the child
  rather than in a ``preexec_fn``, which is unsafe in a process with threads). The signal
  follows the thread that starts the command: start such commands from a thread that lives as
  long as they should (the main thread).
* :func:`reap_on_exit` starts a watchdog, tied to this process the same way, that kills given
  processes (by pid and start time) when this process ends: for programs that start processes
  of their own and do not tie them to themselves (a local Ray cluster's agents), and, after a
  grace period, for servers that may not end on the SIGTERM they were sent (a vLLM server
  paused in a weight reload waits for that request forever).
* :func:`exit_on_signals` turns SIGTERM and SIGHUP into ``SystemExit`` in the main thread, as
  Python does for SIGINT with ``KeyboardInterrupt``, so that every ``finally`` and context
  manager on the way out runs: servers are stopped, checkpoints already written stay whole.
* :func:`stop_at_step_on_signals` makes the first SIGTERM a request instead (:func:`stop_requested`):
  a trainer finishes its step, writes a checkpoint and ends, within the pod's grace period (a
  suspended or preempted job resumes from there); a second SIGTERM, or SIGHUP, leaves at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

# prctl(PR_SET_PDEATHSIG = 1, SIGTERM); if the parent is gone already, nobody will signal: stop
_EXEC_TIED = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` in the process tree (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22): a pid with
    another start time is another process."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def reap_on_exit(pids: Iterable[int], grace_s: float = 0.0, groups: bool = False) -> subprocess.Popen | None:
    """A watchdog that SIGKILLs ``pids`` once this process has ended (however it ended): at once,
    or those still running ``grace_s`` later (a server tied to this process got SIGTERM and may
    be shutting down by itself); ``groups``: each pid's whole process group (it leads one)."""
    if not sys.platform.startswith("linux"):
        return None
    targets = [f"{pid}:{t}" for pid in pids if (t := start_time(pid)) is not None]
    args = [str(os.getpid()), f"{grace_s:g}", "group" if groups else "pid", *targets]
    cmd = tied_to_this_process([sys.executable, "-m", "kuberl.util.lifetime", *args])
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)


def _watch(parent: int, targets: list[tuple[int, str]], grace_s: float = 0.0, groups: bool = False) -> None:
    """The watchdog of :func:`reap_on_exit`: wait for SIGTERM (``parent`` ended), give the
    targets ``grace_s`` to end, then SIGKILL each one (or its group) that is still the process it was."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if os.getppid() == parent:  # else it is gone already and no signal will come
        signal.sigwait({signal.SIGTERM})
    deadline = time.monotonic() + grace_s

    def running() -> list[int]:
        return [pid for pid, started in targets if start_time(pid) == started]

    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in running():
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL) if groups else os.kill(pid, signal.SIGKILL)


def tied_to_this_process(cmd: Sequence[str]) -> list[str]:
    """``cmd``, run so that it receives SIGTERM when this process ends."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-c", _EXEC_TIED, str(os.getpid()), *cmd]


@contextlib.contextmanager
def exit_on_signals(signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside: each of ``signals`` raises ``SystemExit(128 + signal)`` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, _frame: object) -> None:
        for sig in signals:  # once: the way out is not cut short by a second signal (SIGKILL is)
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP = threading.Event()


def stop_requested() -> bool:
    """Whether a SIGTERM asked this process to stop at the next step boundary."""
    return _STOP.is_set()


@contextlib.contextmanager
def stop_at_step_on_signals() -> Iterator[None]:
    """While inside: the first SIGTERM sets :func:`stop_requested` (the trainer checkpoints and
    ends at its next step boundary); a second SIGTERM or a SIGHUP raises ``SystemExit`` as
    :func:`exit_on_signals` does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum: int, _frame: object) -> None:
        if _STOP.is_set():
            raise SystemExit(128 + signum)
        _STOP.set()

    _STOP.clear()
    previous = signal.signal(signal.SIGTERM, request)
    try:
        with exit_on_signals((signal.SIGHUP,)):
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    _watch(
        int(sys.argv[1]),
        [(int(p), t) for p, t in (a.split(":", 1) for a in sys.argv[4:])],
        grace_s=float(sys.argv[2]),
        groups=sys.argv[3] == "group",
    )
