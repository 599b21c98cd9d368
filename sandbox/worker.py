"""Warm fork-server: one per core, forks one contained child per tool call.

Started by the server as ``python -m kuberl.sandbox.worker CONFIG_JSON`` (under
``unshare --net --pid --fork --mount-proc --kill-child`` when available), it preloads and
warms numpy, sympy, scipy and math-verify, calls ``gc.freeze()`` and then reads one JSON
request (a batch of calls) per line on its protocol pipe and answers one JSON line per call,
as soon as that call is done (so the server knows which call was running if the worker dies).
Per call the cost is one ``fork``: the child does setsid, joins the slot's cgroup (memory,
pids), sets rlimits (AS, CPU, FSIZE, NOFILE, CORE, NPROC), drops to the slot's non-root uid,
confines its writes to the slot directory (Landlock), installs a seccomp filter and runs the
code. The parent enforces the wall deadline and the slot's disk quota and afterwards kills
everything left in the slot (cgroup members, the process group, its orphans and every process
of the slot uid), so daemons cannot outlive a call.

The worker and the server are not dumpable (``PR_SET_DUMPABLE`` 0): a call running under
their uid (``--isolation basic``) can then neither open their ``/proc/PID/mem`` or ``fd``
nor ptrace them, and the seccomp filter refuses to signal them (see :class:`SeccompProgram`).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import errno
import gc
import json
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from kuberl.sandbox import landlock
from kuberl.sandbox.cgroups import SlotCgroup, slot_cgroup

DEFAULT_UID_BASE = 61000
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
# prepared in the worker, used by every forked child (a CDLL built in the child costs page faults)
_LIBC = ctypes.CDLL(None, use_errno=True)
DISK_POLL_SECONDS = 0.05  # a call may overshoot its disk quota by what it writes in one poll


@dataclass
class WorkerConfig:
    """Everything a worker needs; passed as one JSON argument by the server."""

    slot: int
    pool: str = "local"
    timeout_seconds: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 16384
    max_processes: int = 32
    max_file_mb: int = 64
    disk_mb: int = 256
    verify_timeout_seconds: float = 5.0
    in_namespace: bool = False
    isolation: str = "full"  # "basic": no slot uid, no cgroups (see ServiceConfig.isolation)
    uid_base: int = DEFAULT_UID_BASE  # the server draws a random block so services never share uids
    protections: dict[str, bool] = field(default_factory=dict)


# Preloaded so that no call pays for these imports (and so the slot uid needs no access to them).
PRELOAD_STDLIB = (
    "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal", "fractions",
    "functools", "heapq", "itertools", "json", "math", "numbers", "operator", "random", "re",
    "statistics", "string", "sys", "textwrap", "time", "typing", "uuid", "threading", "hashlib",
    "array", "struct", "io", "os", "signal", "socket", "ctypes",
)  # fmt: skip


def _hide_home_keep_python() -> bool:
    """Inside our private mount namespace: replace a 0700 home that holds the interpreter
    (e.g. /root/.pyenv) with an empty tmpfs that only re-exposes the interpreter read-only.

    The slot uid can then import any installed module while the rest of the home (dotfiles,
    credentials) is simply not there. Returns whether the interpreter is usable by other uids.
    """
    prefix = os.path.realpath(sys.base_prefix)
    parts = prefix.split(os.sep)
    if len(parts) < 3:
        return True
    home = os.sep.join(parts[:2])
    if os.stat(home).st_mode & 0o005 == 0o005:
        return True
    keep = sorted({os.sep.join(os.path.realpath(p).split(os.sep)[:3]) for p in (*sys.path, prefix)
                   if p and os.path.realpath(p).startswith(home + os.sep)})  # fmt: skip
    stash = tempfile.mkdtemp(prefix="kuberl-keep-")

    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True)

    for i, k in enumerate(keep):
        os.makedirs(f"{stash}/{i}")
        mount("--bind", k, f"{stash}/{i}")
    mount("-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", home)
    for i, k in enumerate(keep):
        os.makedirs(k, exist_ok=True)
        mount("--bind", f"{stash}/{i}", k)
        mount("-o", "remount,bind,ro", k)
    return True


def _preload() -> None:
    """Import and exercise the heavy libraries once so each fork inherits them warm."""
    import importlib

    for name in PRELOAD_STDLIB:
        importlib.import_module(name)
    import numpy  # noqa: F401
    import scipy  # noqa: F401
    import scipy.special  # noqa: F401
    import sympy
    from math_verify import parse, verify

    x = sympy.Symbol("x")
    sympy.simplify((x**2 - 1) / (x - 1))
    # no math-verify alarms: the worker's outer kill is the one deadline (see _child_verify);
    # math-verify warns once that its own timeout is off, which is the point
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify(
        parse("$\\frac{1}{2}$", parsing_timeout=None),
        parse("0.5", parsing_timeout=None),
        timeout_seconds=None,
    )


class Slot:
    """The cgroup, uid, scratch directory and seccomp filter one worker's calls run in."""

    def __init__(self, cfg: WorkerConfig, python_readable: bool) -> None:
        self.cfg = cfg
        full = cfg.isolation == "full"
        # a root worker always drops calls to a slot uid where the interpreter allows it: as
        # root a call would ignore RLIMIT_NPROC and could signal or ptrace anything
        uid_ok = os.geteuid() == 0 and python_readable
        self.uid = cfg.uid_base + cfg.slot if uid_ok else None
        # unique even across services: in a PID namespace every worker is pid 1
        self.dir = tempfile.mkdtemp(prefix=f"kuberl-sbx-{cfg.pool}-{cfg.slot}-")
        if self.uid is not None:
            os.chown(self.dir, self.uid, self.uid)
        os.chmod(self.dir, 0o700)
        memory = cfg.memory_mb * 2**20 + 64 * 2**20  # the interpreter's own pages on top
        name = os.path.basename(self.dir)
        self.cgroup = slot_cgroup(name, memory, cfg.max_processes) if full else SlotCgroup()
        # the worker itself (and its threads, if a library started any), and outside a PID
        # namespace the server (our parent); the server adds its threads and the other
        # workers with every batch (see protect())
        own = {1, os.getpid()} | {int(t) for t in os.listdir("/proc/self/task")}
        self.own_pids = frozenset(own | (set() if cfg.in_namespace else {os.getppid()}))
        self.protected = self.own_pids
        self.seccomp = SeccompProgram.compile(self.protected)
        self.landlock_abi = landlock.abi_version()
        self.landlock: landlock.WriteRuleset | None = None
        if self.landlock_abi >= 1:
            try:
                self.landlock = landlock.WriteRuleset.build([self.dir], [os.devnull], self.landlock_abi)
            except OSError as err:  # e.g. a container seccomp profile that allows only some calls
                print(f"landlock unavailable: {err}", file=sys.stderr)
        self.protections = {
            "cgroup_memory": self.cgroup.memory,
            "cgroup_pids": self.cgroup.pids,
            "uid": self.uid is not None,
            # a per-call process cap: the pids cgroup, or RLIMIT_NPROC under a non-root uid
            # (root ignores it: a root call in basic isolation has no cap, and says so)
            "pids": self.cgroup.pids or self.uid is not None or os.geteuid() != 0,
            "seccomp": self.seccomp is not None,
            "landlock": self.landlock is not None,
            "disk_quota": True,
            "rlimits": True,
            "setsid": True,
            "home_hidden": python_readable and cfg.in_namespace,
        }

    def protect(self, pids: list[int]) -> None:
        """Also refuse signals to ``pids`` (host pids: meaningless inside a PID namespace).

        Recompiles the filter only when the set changes (worker restarts), ~10 ms."""
        if self.cfg.in_namespace or self.seccomp is None:
            return
        wanted = self.own_pids | {p for p in pids if isinstance(p, int) and 0 < p < 2**31}
        if wanted != self.protected:
            self.seccomp = SeccompProgram.compile(wanted) or self.seccomp
            self.protected = wanted

    def child_fds(self) -> tuple[int, ...]:
        """Descriptors a call's child needs until it enters the sandbox (the Landlock ruleset)."""
        return (self.landlock.fd,) if self.landlock is not None else ()

    def disk_usage(self) -> int:
        """Bytes allocated beneath the slot directory (what counts against the disk quota)."""
        return _dir_bytes(self.dir)

    def join(self) -> None:
        self.cgroup.join(os.getpid())

    def kill_all(self) -> None:
        """SIGKILL every process of the slot: cgroup members, then all processes of its uid.

        The uid sweep costs a fork of this (large, preloaded) worker, about as much as the call
        itself, so it runs only when something could have escaped the cgroup sweep: no pids
        cgroup, a cgroup that would not empty, or a process of the slot uid still in /proc.
        """
        emptied = False
        self.cgroup.kill()
        for _ in range(50):
            pids = self._cgroup_pids()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                emptied = True
                break
            time.sleep(0.002)
        tracked = emptied and self.cgroup.pids
        if not tracked:
            kill_children()
        if self.uid is not None and (not tracked or _uid_has_processes(self.uid)):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    os.setgid(self.uid)
                    os.setuid(self.uid)
                    for _ in range(3):
                        with contextlib.suppress(OSError):
                            os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        _reap_zombies()

    def _cgroup_pids(self) -> list[int]:
        return sorted(self.cgroup.members() - {os.getpid()})

    def clean_dir(self) -> None:
        for name in os.listdir(self.dir):
            p = os.path.join(self.dir, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(p)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.cgroup.remove()


def _children_of(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2 :].split()  # comm may contain spaces and ")"
            if int(fields[1]) == pid:
                kids.append(int(name))
    return kids


def kill_children(keep: frozenset[int] = frozenset(), rounds: int = 100) -> int:
    """Kill every child of this process but ``keep``; returns how many were killed.

    Used where no cgroup tracks a call: this process (the worker, or the server after a worker
    died) is a child subreaper or PID-namespace init, so orphans, however many times they
    setsid and double-fork, are reparented to it; grandchildren of a killed process show up
    as children in the next round. Only the killed pids are reaped: the others' exit status
    belongs to whoever waits for them (asyncio, in the server)."""
    me = os.getpid()
    killed = 0
    for _ in range(rounds):
        kids = [k for k in _children_of(me) if k not in keep]
        if not kids:
            break
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed += len(kids)
        _reap(kids, patience=0.05)
    return killed


def _reap(pids: list[int], patience: float) -> None:
    deadline = time.monotonic() + patience
    left = set(pids)
    while left:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _dir_bytes(path: str) -> int:
    """Allocated bytes of every file beneath ``path`` (sparse holes are free; links not followed)."""
    total = 0
    stack = [path]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
    return total


def _real_uid_and_threads(pid: str) -> tuple[int, int] | None:
    """From /proc/PID/status: /proc/PID itself is owned by root for a non-dumpable process
    (ours, and every call after a uid change), so its owner says nothing about the uid.
    Runs for every process after every call outside a PID namespace: raw reads and ``find``
    instead of line parsing (30 -> 8 us a process)."""
    chunks: list[bytes] = []
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except OSError:
        return None
    try:
        while chunk := os.read(fd, 8192):  # long Groups: lines make it larger than a page
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = b"".join(chunks)
    try:
        at = text.index(b"\nUid:")
        uid = int(text[at + 5 : text.index(b"\t", at + 6)])
        at = text.find(b"\nThreads:")
        threads = int(text[at + 9 : text.index(b"\n", at + 9)]) if at >= 0 else 1
    except ValueError:  # not the format we know
        return None
    return uid, threads


def _uid_task_count(uid: int) -> int:
    """Tasks (threads included: RLIMIT_NPROC counts them) of real uid ``uid`` in /proc."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _real_uid_and_threads(name)
            if found is not None and found[0] == uid:
                count += found[1]
    return count


def _uid_has_processes(uid: int) -> bool:
    """Is any process of real uid ``uid`` alive?"""
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _real_uid_and_threads(name)
            if found is not None and found[0] == uid:
                return True
    return False


def _readable_by_others(path: str) -> bool:
    """Could a non-root uid open ``path`` (every directory on the way world-searchable)?"""
    cur = os.path.realpath(path)
    try:
        if os.stat(cur).st_mode & 0o004 == 0:
            return False
        while cur != os.sep:
            cur = os.path.dirname(cur)
            if os.stat(cur).st_mode & 0o001 == 0:
                return False
    except OSError:
        return False
    return True


def _reap_zombies(patience: float = 1.0) -> None:
    """Reap every child (orphans of a call are ours: subreaper / PID-namespace init).

    Called right after SIGKILLing the slot, so it waits briefly for those deaths to land."""
    deadline = time.monotonic() + patience
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)


_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_DENY = (
    "ptrace", "mount", "umount2", "unshare", "setns", "reboot", "kexec_load", "init_module",
    "finit_module", "delete_module", "swapon", "swapoff", "pivot_root", "chroot", "bpf",
    "perf_event_open", "process_vm_readv", "process_vm_writev", "keyctl", "add_key", "request_key",
    # a pidfd for any pid can also come from open("/proc/PID"): no signals through pidfds at all
    "pidfd_send_signal",
)  # fmt: skip
# syscalls that signal a pid given in argument N (tgkill checks that its tid belongs to tgid)
_SIGNAL_PID_ARGS = {
    "kill": 0,
    "tkill": 0,
    "tgkill": 0,
    "rt_sigqueueinfo": 0,
    "rt_tgsigqueueinfo": 0,
    "pidfd_open": 0,
}
# fcntl/ioctl commands that make the kernel signal an arbitrary pid or group on I/O (SIGIO,
# or any signal chosen with F_SETSIG, SIGKILL included)
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902
_PID_MASK = 0xFFFFFFFF  # pid_t is 32 bits: compare only what the kernel reads of the register


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


class SeccompProgram:
    """The call filter, compiled to classic BPF once per worker.

    libseccomp needs ~10 ms to build and compile the filter, as much as the rest of a call, so
    the worker compiles it at start and each child only hands the ready program to the kernel
    (two prctl calls). Denies network sockets, ptrace, mounts, namespaces and kernel-level calls
    with EPERM; everything else is allowed.

    Without a slot uid (basic isolation) a call may signal every process of its uid, the server
    and the workers included; the filter therefore also refuses kill/tkill/tgkill/
    rt_(tg)sigqueueinfo/pidfd_open aimed at a protected pid (the worker, the server and its
    threads, the other workers, pid 1) or at a negative pid (a process group, or -1: everyone),
    any pidfd_send_signal, and the fcntl/ioctl commands that route SIGIO to another process.
    """

    def __init__(self, bpf: bytes) -> None:
        self.bpf = bpf
        self._libc = _LIBC
        self._prog = _SockFprog(len(bpf) // 8, bpf)

    @classmethod
    def compile(cls, protected: frozenset[int] = frozenset()) -> SeccompProgram | None:
        """None where libseccomp/pyseccomp is unavailable (the worker degrades and reports it)."""
        try:
            import pyseccomp as sc
        except Exception:  # noqa: BLE001 - libseccomp missing
            return None
        import socket

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        deny = sc.ERRNO(errno.EPERM)
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK):
            f.add_rule(deny, "socket", sc.Arg(0, sc.EQ, family))
        for name in _SECCOMP_DENY:
            with contextlib.suppress(Exception):  # a syscall this arch does not have
                f.add_rule(deny, name)
        for name, arg in _SIGNAL_PID_ARGS.items():
            with contextlib.suppress(Exception):
                f.add_rule(deny, name, sc.Arg(arg, sc.MASKED_EQ, 0x80000000, 0x80000000))  # pid < 0
                for pid in sorted(protected):
                    f.add_rule(deny, name, sc.Arg(arg, sc.MASKED_EQ, _PID_MASK, pid))
        for cmd in (_F_SETOWN, _F_SETSIG, _F_SETOWN_EX):
            f.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, cmd))
        for cmd in (_FIOSETOWN, _SIOCSPGRP):
            f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, _PID_MASK, cmd))
        with tempfile.TemporaryFile() as fh:
            f.export_bpf(fh)
            fh.seek(0)
            bpf = fh.read()
        if not bpf or len(bpf) % 8:
            return None
        return cls(bpf)

    def load(self) -> None:
        """Install the filter on the calling process (and everything it will fork)."""
        if self._libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if self._libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _enter_sandbox(slot: Slot, cfg: WorkerConfig, timeout: float) -> None:
    """Runs in the forked child, as root, right before the untrusted code."""
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    slot.join()
    os.chdir(slot.dir)
    with open("/proc/self/statm") as fh:
        vsize = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    mem = cfg.memory_mb * 2**20
    cpu = max(1, math.ceil(timeout)) + 1
    for res, value in (
        (resource.RLIMIT_AS, vsize + mem),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, cfg.max_file_mb * 2**20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    if slot.uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
    elif os.geteuid() != 0:  # shared uid (unprivileged pod): cap what this call may add to it
        nproc = _uid_task_count(os.getuid()) + cfg.max_processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if slot.uid is not None:
        os.setgroups([])
        os.setgid(slot.uid)
        os.setuid(slot.uid)
    os.environ["HOME"] = slot.dir
    os.environ["TMPDIR"] = slot.dir  # the only place it may write
    if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # Landlock needs it without CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if slot.landlock is not None:
        slot.landlock.restrict_self()
        slot.landlock.close()
    if slot.seccomp is not None:
        slot.seccomp.load()


def _run_user_code(code: str) -> dict[str, Any]:
    """Execute ``code`` as __main__; IPython-style value of a trailing expression."""
    try:
        tree = ast.parse(code, filename="<string>", mode="exec")
    except SyntaxError:
        return {"status": "error", "traceback": traceback.format_exc(limit=0)}
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    env: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<string>", "exec"), env)  # noqa: S102 - this is the sandbox
        value = eval(compile(last, "<string>", "eval"), env) if last is not None else None  # noqa: S307
        sys.stdout.flush()
        if value is None:
            return {"status": "ok", "repr": None}
        return {"status": "ok", "repr": repr(value)}
    except MemoryError:
        return {"status": "memory"}
    except BaseException as exc:  # noqa: BLE001 - SystemExit etc. are the program's result too
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return {"status": "ok", "repr": None}
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        return {"status": "error", "traceback": text}


def _close_fds(keep: tuple[int, ...]) -> None:
    """Close every descriptor above stderr but ``keep``."""
    low = 3
    for fd in sorted(k for k in set(keep) if k >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _child_exec(slot: Slot, cfg: WorkerConfig, req: dict[str, Any], meta_w: int) -> None:
    stdin_path = os.path.join(slot.dir, ".stdin")
    with open(stdin_path, "w") as fh:
        fh.write(req.get("stdin", ""))
    fd_in = os.open(stdin_path, os.O_RDONLY)
    fd_out = os.open(os.path.join(slot.dir, ".stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(os.path.join(slot.dir, ".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    _close_fds(keep=(meta_w, *slot.child_fds()))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    _enter_sandbox(slot, cfg, float(req["timeout"]))
    meta = _run_user_code(req["code"])
    _write_meta(meta_w, meta, cfg.max_output_bytes)


def _write_meta(fd: int, meta: dict[str, Any], limit: int) -> None:
    for key in ("repr", "traceback"):
        if isinstance(meta.get(key), str) and len(meta[key]) > limit:
            meta[key] = meta[key][:limit]
            meta["truncated"] = True
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    data = json.dumps(meta).encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _child_verify(slot: Slot, cfg: WorkerConfig, req: dict[str, Any], meta_w: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    _close_fds(keep=(meta_w, *slot.child_fds()))
    _enter_sandbox(slot, cfg, float(req["timeout"]))
    from math_verify import parse, verify

    def parse_any(text: str) -> list[Any]:
        # answers arrive extracted from \boxed{} (rollout.template.extract_answer); re-box bare
        # ones so the LaTeX extractor sees the whole expression ("1+x" alone parses as 1)
        if "$" in text or "\\boxed" in text:
            return parse(text, parsing_timeout=None)
        return parse(f"\\boxed{{{text}}}", parsing_timeout=None) or parse(text, parsing_timeout=None)

    # math-verify's own SIGALRM timeouts (5 s per parse and per comparison, whole seconds only)
    # are off: they would race the outer deadline, or stretch a verify to 3x their value; the
    # parent's kill at req["timeout"] is the single deadline and is reported as a timeout
    try:
        ok = bool(verify(parse_any(req["gold"]), parse_any(req["prediction"]), timeout_seconds=None))
    except Exception:  # noqa: BLE001 - unparsable answers are simply wrong
        ok = False
    _write_meta(meta_w, {"status": "ok", "correct": ok}, 1024)


def run_forked(slot: Slot, cfg: WorkerConfig, req: dict[str, Any]) -> dict[str, Any]:
    """Fork one contained child for ``req``, enforce the deadline, clean the slot, report."""
    timeout = float(req["timeout"])
    slot.cgroup.mark()
    meta_r, meta_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child; coverage cannot follow the fork
        code = 0
        try:
            os.close(meta_r)
            if req["op"] == "verify":
                _child_verify(slot, cfg, req, meta_w)
            else:
                _child_exec(slot, cfg, req, meta_w)
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            os._exit(code)
    os.close(meta_w)
    pidfd = os.pidfd_open(pid)
    chunks: list[bytes] = []
    deadline = start + timeout
    quota = cfg.disk_mb * 2**20
    next_disk_check = start + DISK_POLL_SECONDS
    timed_out = disk_exceeded = False
    meta_open = True
    status = None
    try:
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                timed_out = True
                break
            if now >= next_disk_check:
                if slot.disk_usage() > quota:
                    disk_exceeded = True
                    break
                # a slot full of small files takes long to scan: never spend over 1/4 of the call on it
                next_disk_check = time.monotonic() + max(DISK_POLL_SECONDS, 3 * (time.monotonic() - now))
            watch = [pidfd, meta_r] if meta_open else [pidfd]
            ready, _, _ = select.select(watch, [], [], max(0.0, min(left, next_disk_check - now)))
            if meta_r in ready:
                data = os.read(meta_r, 65536)
                if data:
                    chunks.append(data)
                else:
                    meta_open = False
            if pidfd in ready:
                break
        if timed_out or disk_exceeded:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        while meta_open:
            r, _, _ = select.select([meta_r], [], [], 0.05)
            if not r:
                break
            data = os.read(meta_r, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(pidfd)
        os.close(meta_r)
        duration = time.monotonic() - start
        slot.kill_all()
    oom = slot.cgroup.hit_memory_limit()
    # what the call left when it ended counts too (it may have written it faster than one poll)
    disk_exceeded = disk_exceeded or slot.disk_usage() > quota
    meta: dict[str, Any] = {}
    if chunks:
        with contextlib.suppress(ValueError):
            meta = json.loads(b"".join(chunks))
    out = {"duration_s": duration, "timed_out": timed_out, "meta": meta, "oom": oom}
    if disk_exceeded:
        out["disk_exceeded_mb"] = cfg.disk_mb
    if status is not None:
        out["signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out["exit_code"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    if req["op"] == "exec":
        out.update(_read_outputs(slot, cfg.max_output_bytes))
    slot.clean_dir()
    return out


def _read_outputs(slot: Slot, limit: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name in ("stdout", "stderr"):
        try:
            with open(os.path.join(slot.dir, f".{name}"), "rb") as fh:
                data = fh.read(limit + 1)
        except OSError:
            data = b""
        res[name] = data[:limit].decode("utf-8", "replace")
        res[f"{name}_truncated"] = len(data) > limit
    return res


def main(argv: list[str]) -> int:
    cfg = WorkerConfig(**json.loads(argv[0]))
    # the protocol lives on private fds; 0/1 become /dev/null so children cannot touch it
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    with contextlib.suppress(Exception):
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no /proc/PID/mem, fd or ptrace for our calls
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    readable = False
    if cfg.in_namespace and os.getpid() == 1 and os.geteuid() == 0:
        try:
            readable = _hide_home_keep_python()
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"kuberl sandbox worker: cannot hide home ({err}); no uid drop", file=sys.stderr)
    else:
        readable = _readable_by_others(os.path.join(sysconfig.get_paths()["stdlib"], "uuid.py"))
    _preload()
    slot = Slot(cfg, readable)
    gc.collect()
    gc.freeze()
    hello = {
        "ready": True,
        "slot": cfg.slot,
        "pid": os.getpid(),
        "protections": slot.protections,
        "leftovers": {"dir": slot.dir, "cgroups": slot.cgroup.dirs()},  # if we die uncleanly
    }
    proto_out.write(json.dumps(hello).encode() + b"\n")
    proto_out.flush()
    try:
        for line in proto_in:
            req = json.loads(line)
            slot.protect(req.get("protect", []))
            for call in req["calls"]:
                proto_out.write(json.dumps({"result": run_forked(slot, cfg, call)}).encode() + b"\n")
                proto_out.flush()
    finally:
        slot.kill_all()
        slot.remove()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
