"""The zygote: a clean preloaded process that forks every call's child and never sees a call.

Each tool call runs in a fork, and a fork inherits its parent's whole memory. The worker reads
the calls (their code, stdin, a verification's gold answer) and their output, and freed memory
keeps those bytes until it is reused: a child forked from the worker could read earlier calls
in the heap it inherits. Scrubbing freed memory in the worker (glibc ``M_PERTURB``) closed that
but cost ~25 % of calls/s. The zygote is forked from the worker right after preloading and
building the slot, before the first request; it only ever receives commands (fork a child, the
slot's current filter pids and directory), never a call, so a child forked from it holds
nothing of any call, whatever the worker's allocator does. A worker starts two: the full one
(numpy, scipy, sympy, math-verify) and a light one (the standard library), and
:mod:`kuberl.sandbox.process.routing` picks one per call.

The child is nevertheless the *worker's* child (``clone`` with ``CLONE_PARENT``): the worker
waits for it, kills and reaps it, reads its exit status and adopts its orphans exactly as if it
had forked it itself. The zygote hands the worker the parent ends of the child's pipes over a
``SOCK_SEQPACKET`` pair (``SCM_RIGHTS``); it keeps none of them.

:func:`fork_sibling` is ``os.fork`` with ``CLONE_PARENT``: the interpreter's own before/after-fork
steps (import lock, ``os.register_at_fork`` hooks such as ``random``'s reseeding, thread
state) run as they do in ``os.fork``. What it skips of glibc's ``fork`` matters only to a
multi-threaded parent (the zygote has one thread) and to glibc's cached thread id of the
child's main thread, which stays the zygote's: ``pthread_*`` calls that address the main thread
by that id (affinity, scheduling, its CPU clock, its name) reach the zygote's thread or fail;
the call's seccomp filter refuses the ones that act on another pid.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import gc
import json
import os
import platform
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from kuberl.sandbox.containment.fsview import use_call_environment
from kuberl.sandbox.libc import LIBC, PYAPI
from kuberl.sandbox.process.calls import Prepared
from kuberl.sandbox.process.child import Pipes, prepare_children, run_prepared, set_name
from kuberl.sandbox.process.forkhooks import ForkHooks

if TYPE_CHECKING:
    from kuberl.sandbox.config import WorkerConfig
    from kuberl.sandbox.containment.slot import Slot

CLONE_PARENT = 0x00008000
_SIGCHLD = int(signal.SIGCHLD)
_PR_SET_PDEATHSIG = 1
# clone(2)'s number; with no stack, tid pointers or tls its argument order does not matter
_SYS_CLONE = {"x86_64": 56, "amd64": 56, "aarch64": 220, "arm64": 220}
_SYS_CLONE3 = {"x86_64": 435, "amd64": 435, "aarch64": 435, "arm64": 435}
CLONE_INTO_CGROUP = 0x200000000
_CLONE_NR = _SYS_CLONE.get(platform.machine().lower())
_CLONE3_NR = _SYS_CLONE3.get(platform.machine().lower())
_ZERO = ctypes.c_long(0)
_CLONE_ARGS = (ctypes.c_long(_CLONE_NR or -1), ctypes.c_long(CLONE_PARENT | _SIGCHLD))
# what a kernel or a container's seccomp profile answers where clone3 into a cgroup is not to be
# had (too old, filtered, not a cgroup v2 directory we may use): the zygote falls back for good
_NO_CLONE_INTO = (
    errno.ENOSYS,
    errno.EPERM,
    errno.EACCES,
    errno.EINVAL,
    errno.E2BIG,
    errno.EOPNOTSUPP,
    errno.EBADF,
)
_BEFORE_FORK = ctypes.pythonapi.PyOS_BeforeFork
_AFTER_FORK_CHILD = ctypes.pythonapi.PyOS_AfterFork_Child
_AFTER_FORK_PARENT = ctypes.pythonapi.PyOS_AfterFork_Parent
# one message, either way: a command or state update (the protected pids, a directory), a reply
# with a pid or an error. Received into a buffer made once: ``recv(n)`` allocates n bytes per
# message (at 1 MiB an mmap, mremap and munmap per call in the worker; pages in the zygote)
_MAX_MESSAGE = 1 << 20
_FDS_PER_CHILD = 4
_ANCILLARY = socket.CMSG_SPACE(_FDS_PER_CHILD * array.array("i").itemsize)
_FORK = {"op": "fork"}
_FORK_MSG = json.dumps(_FORK).encode()


class ZygoteGone(RuntimeError):
    """The zygote died or refused to fork; the worker cannot make clean children any more."""


class _CloneArgs(ctypes.Structure):
    """``struct clone_args`` of clone3(2) (Linux 5.7+: up to ``cgroup``)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size",
                     "tls", "set_tid", "set_tid_size", "cgroup")
    ]  # fmt: skip


def fork_sibling(cgroup: int | None = None) -> int:
    """Like ``os.fork()``, but the child's parent is our parent (``CLONE_PARENT``); 0 in the child.

    ``cgroup``: a cgroup v2 directory's descriptor; the child is born in that cgroup (clone3
    with ``CLONE_INTO_CGROUP``) instead of migrating into it later, a migration that waits for
    an RCU grace period when none happened in the last ~20 ms (see ``Slot.settle_zygote``).

    Raises OSError where the kernel or a container's seccomp profile refuses it."""
    number = _CLONE_NR if cgroup is None else _CLONE3_NR
    if number is None:
        raise OSError(errno.ENOSYS, f"no clone syscall number known for {platform.machine()}")
    _BEFORE_FORK()
    if cgroup is None:
        pid = PYAPI.syscall(_CLONE_ARGS[0], _CLONE_ARGS[1], _ZERO, _ZERO, _ZERO, _ZERO)
    else:
        # no exit_signal with CLONE_PARENT (clone3 refuses one): the child's is ours, SIGCHLD
        args = _CloneArgs(flags=CLONE_PARENT | CLONE_INTO_CGROUP, cgroup=cgroup)
        pid = PYAPI.syscall(ctypes.c_long(number), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if pid == 0:
        _AFTER_FORK_CHILD()
        return 0
    err = ctypes.get_errno()
    _AFTER_FORK_PARENT()
    if pid < 0:
        raise OSError(
            err, f"clone(CLONE_PARENT{'' if cgroup is None else ' | CLONE_INTO_CGROUP'}): {os.strerror(err)}"
        )
    return pid


class Zygote:
    """The worker's handle on its zygote: ask for a child ahead, take it when a call comes.

    Requests and state updates travel in order on one socket, so a child is always forked with
    the filter pids and slot directory the worker had when it asked for it."""

    scrub = False  # the worker need not scrub freed memory: no child inherits it

    def __init__(self, pid: int, sock: socket.socket, generation: int) -> None:
        self.pid = pid
        self.sock = sock
        self.generation = generation  # of the slot state the zygote last heard of
        self.asked: int | None = None  # generation of a child asked for and not yet received
        self.ready: Prepared | None = None  # a child received (its pid known) and not yet taken
        self.children_inside = False  # its children are born in the slot's cgroup
        self._buf = bytearray(_MAX_MESSAGE)

    @classmethod
    def start(
        cls, slot: Slot, cfg: WorkerConfig, close: tuple[int, ...], preload: Callable[[], None] = lambda: None
    ) -> Zygote:
        """Fork the zygote from the worker (before the worker reads any call), have it run
        ``preload`` (the libraries every call gets warm: loaded in the zygote only, the worker
        stays small) and check that it can fork children for us. ``close``: the worker's
        descriptors it must not hold (the protocol pipes: the server sees EOF when the worker
        dies). Raises ZygoteGone."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        worker = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote; coverage cannot follow the fork
            try:
                ours.close()
                for fd in close:
                    os.close(fd)
                LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
                if os.getppid() != worker:  # the worker died before the line above
                    os._exit(0)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_IGN)  # the worker stops us (EOF, SIGKILL)
                set_name(b"kuberl-zygote")
                use_call_environment(slot.call_dir)  # inherited by every child
                slot.add_own(os.getpid())
                slot.ready_for_fork()
                preload()
                gc.unfreeze()  # what the worker froze: ForkHooks looks for the hook list in it
                hooks = ForkHooks.trim()
                prepare_children()
                gc.collect()
                gc.freeze()  # no collection touches (and so copies) the preloaded objects
                slot.settle_zygote()  # after the preload: its pages are not charged to the calls
                _serve(theirs, slot, cfg, hooks)
            finally:
                os._exit(70)
        theirs.close()
        slot.add_own(pid)
        self = cls(pid, ours, slot.generation)
        try:
            self._probe()
        except (OSError, ZygoteGone):
            self.close()
            raise
        return self

    def _probe(self) -> None:
        """One child that exits at once: it must be ours to wait for (CLONE_PARENT works)."""
        self._send({"op": "probe"})
        doc, fds = self._receive()
        for fd in fds:
            os.close(fd)
        self.children_inside = bool(doc.get("inside"))
        try:
            os.waitpid(int(doc["pid"]), 0)
        except ChildProcessError as err:
            raise ZygoteGone("the zygote's children are not the worker's (CLONE_PARENT ignored)") from err

    def _send(self, doc: dict) -> None:
        try:
            self.sock.send(_FORK_MSG if doc == _FORK else json.dumps(doc).encode())
        except OSError as err:
            raise ZygoteGone(f"the zygote (pid {self.pid}) is gone: {err}") from err

    def _receive(self) -> tuple[dict, list[int]]:
        try:
            size, ancillary, flags, _ = self.sock.recvmsg_into([self._buf], _ANCILLARY)
        except OSError as err:
            raise ZygoteGone(f"the zygote (pid {self.pid}) is gone: {err}") from err
        fds = passed_fds(ancillary)
        if not size or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            raise ZygoteGone(f"the zygote (pid {self.pid}) is gone" if not size else "garbled zygote reply")
        doc = json.loads(self._buf[:size])
        if "error" in doc:
            for fd in fds:
                os.close(fd)
            raise ZygoteGone(f"the zygote could not fork: {doc['error']}")
        return doc, fds

    def ask(self, slot: Slot) -> None:
        """Have the next child forked now, with the slot's current state (returns at once);
        a child received earlier that died while it waited is replaced."""
        if self.ready is not None and self.ready.exited():
            self.ready.discard()
            self.ready = None
        if self.asked is not None or self.ready is not None:
            return
        if self.generation != slot.generation:
            self._send({"op": "state", "protected": sorted(slot.protected), "dir": slot.dir})
            self.generation = slot.generation
        self._send({"op": "fork"})
        self.asked = self.generation

    def take(self, slot: Slot) -> Prepared:
        """The child asked for (asking now if nobody did), forked with the slot's current state."""
        while True:
            self.ask(slot)
            self.collect()
            prepared, self.ready = self.ready, None
            if prepared is None:  # already gone and reaped: ask for another
                continue
            if prepared.generation == slot.generation:
                return prepared
            prepared.discard()  # forked with an older filter or directory

    def collect(self) -> None:
        """Receive the child asked for, if any (forked by now or in a moment), without taking it:
        the worker then knows its pid and spares it when it clears the slot after a call."""
        if self.asked is None or self.ready is not None:
            return
        doc, fds = self._receive()
        generation, self.asked = self.asked, None
        self.children_inside = bool(doc.get("inside"))
        request_w, out_r, err_r, meta_r = fds
        try:
            pidfd = os.pidfd_open(int(doc["pid"]))
        except OSError:  # already gone and reaped
            for fd in fds:
                os.close(fd)
            return
        pipes = Pipes((out_r, -1), (err_r, -1), (meta_r, -1))
        self.ready = Prepared(int(doc["pid"]), pidfd, pipes, request_w, generation)

    def close(self) -> None:
        """Stop the zygote (EOF on its socket; SIGKILL as well) and reap it (and a child it
        forked that was not taken)."""
        if self.ready is not None:
            self.ready.discard()
            self.ready = None
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _serve(
    sock: socket.socket, slot: Slot, cfg: WorkerConfig, hooks: ForkHooks | None
) -> NoReturn:  # pragma: no cover - zygote
    """The zygote's loop: apply state updates, fork children, until the worker goes away.
    ``hooks``: the after-fork hooks it forks with trimmed (see :mod:`kuberl.sandbox.process.forkhooks`)."""
    buf = bytearray(_MAX_MESSAGE)
    fork_size = len(_FORK_MSG)
    while True:
        try:
            size = sock.recv_into(buf)
        except OSError:
            size = 0
        if not size:
            os._exit(0)
        # the hot path written to touch few objects: after each fork every page the zygote
        # writes is copied for it again (~100 pages a call), so no json, wrappers or lookups here
        cmd = _FORK if size == fork_size and buf.startswith(_FORK_MSG) else json.loads(buf[:size])
        if cmd["op"] == "state":
            slot.use_state(frozenset(cmd["protected"]), cmd["dir"])
            continue
        slot.ready_for_fork()
        pipes = Pipes.open()
        request_r, request_w = os.pipe()
        set_name(b"kuberl-ready")  # the child is born with this name
        try:
            pid, inside = _fork_child(slot)
        except OSError as err:
            set_name(b"kuberl-zygote")
            for fd in (request_r, request_w, *pipes.out, *pipes.err, *pipes.meta):
                os.close(fd)
            sock.send(json.dumps({"error": str(err)}).encode())
            continue
        if pid == 0:
            if hooks is not None:
                hooks.restore()
            os.close(sock.detach())
            os.close(request_w)
            if cmd["op"] == "probe":
                os._exit(0)
            slot.born_inside = inside
            run_prepared(slot, cfg, pipes, request_r)
        set_name(b"kuberl-zygote")
        os.close(request_r)
        pipes.close_write_ends()
        parent_ends = [request_w, pipes.out[0], pipes.err[0], pipes.meta[0]]
        reply = b'{"pid": %d, "inside": %s}' % (pid, b"true" if inside else b"false")
        sock.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", parent_ends))])
        for fd in parent_ends:
            os.close(fd)


def passed_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an ``SCM_RIGHTS`` message carried (as ``socket.recv_fds`` reads them)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _fork_child(slot: Slot) -> tuple[int, bool]:  # pragma: no cover - zygote
    """Fork a call's child: born in the slot's cgroup where it can be (the zygote lives there
    (v1), or clone3 puts it there (v2)), else joining it per call. (pid, born inside)."""
    if slot.clone_fd is not None:
        try:
            return fork_sibling(slot.clone_fd), True
        except OSError as err:
            if err.errno not in _NO_CLONE_INTO:
                raise
            print(f"kuberl sandbox zygote: children join the slot's cgroup per call ({err})", file=sys.stderr)
            os.close(slot.clone_fd)
            slot.clone_fd = None
    return fork_sibling(), slot.born_inside
