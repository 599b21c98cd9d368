"""Warm fork-server: one per core, forks one contained child per tool call.

Started by the server as ``python -m kuberl.sandbox.process.worker CONFIG_JSON`` (under
``unshare --net --pid --ipc --fork --mount-proc --kill-child`` when available) with an
allowlisted environment, it builds the filesystem view its calls get
(:mod:`kuberl.sandbox.containment.fsview`: a private read-only root with a per-call tmpfs, or a Landlock
read allowlist), forks its two zygotes (:mod:`kuberl.sandbox.process.zygote`): the full one preloads and
warms numpy, sympy, scipy and math-verify, the light one only the standard library; they fork
every call's child (:mod:`kuberl.sandbox.process.routing` picks which), so no child inherits memory that
held an earlier call. It then reads one length-prefixed frame (a call) at a time
on its protocol pipe and answers one JSON line per call, as soon as that call is done (so the
server knows which call was running if the worker dies). Per call the cost is one ``fork`` (of
the zygote): the child (:mod:`kuberl.sandbox.process.child`) enters the sandbox and runs the code; its
output comes back on pipes opened for it, never through files the call could swap. The worker
(the child's parent: the zygote forks with ``CLONE_PARENT``) enforces the wall deadline and the
slot's disk quota, afterwards kills everything left in the slot (cgroup members, the process
group, its orphans and every process of the slot uid), so daemons cannot outlive a call, and
empties the scratch space in bounded time.

The worker and the server are not dumpable (``PR_SET_DUMPABLE`` 0): a call running under
their uid (``--isolation basic``) can then neither open their ``/proc/PID/mem`` or ``fd``
nor ptrace them, and the seccomp filter refuses to signal them (see :class:`SeccompProgram`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from typing import Any

from kuberl.sandbox.config import WorkerConfig
from kuberl.sandbox.containment.fsview import PrivateRoot
from kuberl.sandbox.containment.slot import Slot
from kuberl.sandbox.libc import LIBC
from kuberl.sandbox.process.calls import ChildGone, OwnForks, run_call
from kuberl.sandbox.process.routing import Zygotes, zygote_for
from kuberl.sandbox.process.zygote import Zygote, ZygoteGone

_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
M_PERTURB = -6  # glibc mallopt: fill freed (and fresh) blocks with a byte (only without a zygote)


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
    for i in range(len(keep)):  # the stash is on the host's /tmp: leave nothing there
        subprocess.run(["umount", f"{stash}/{i}"], check=False, capture_output=True)
    shutil.rmtree(stash, ignore_errors=True)
    return True


def preload_light() -> None:
    """The light zygote's preload: the standard library modules calls use most."""
    import importlib

    for name in PRELOAD_STDLIB:
        importlib.import_module(name)


def preload() -> None:
    """Import and exercise the heavy libraries once so each fork inherits them warm (in the
    full zygote; the worker itself never loads them)."""
    preload_light()
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


def _private_root(cfg: WorkerConfig) -> tuple[PrivateRoot | None, bool]:
    """Full isolation, as root and pid 1 of our own namespaces: the minimal read-only root
    (and whether a slot uid can read the interpreter in it). (None, False) where it cannot be
    built; the worker says why and falls back to Landlock's read allowlist."""
    if not (cfg.in_namespace and os.getpid() == 1 and os.geteuid() == 0):
        return None, False
    base = tempfile.mkdtemp(prefix=f"kuberl-sbx-{cfg.pool}-{cfg.slot}-root-")
    try:
        root = PrivateRoot.build(base, cfg.disk_mb, uid=None)
    except OSError as err:
        print(
            f"kuberl sandbox worker: no private root ({err}); Landlock limits reads instead", file=sys.stderr
        )
        with contextlib.suppress(OSError):
            os.rmdir(base)
        return None, False
    uuid_py = os.path.realpath(os.path.join(sysconfig.get_paths()["stdlib"], "uuid.py"))
    return root, _readable_by_others(base + uuid_py)


def _fallback_view(cfg: WorkerConfig) -> bool:
    """Without a private root: hide a 0700 home that holds the interpreter where we may mount
    (our own mount namespace), so a slot uid can use the interpreter; whether it can."""
    if cfg.in_namespace and os.getpid() == 1 and os.geteuid() == 0:
        try:
            return _hide_home_keep_python()
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"kuberl sandbox worker: cannot hide home ({err}); no uid drop", file=sys.stderr)
            return False
    return _readable_by_others(os.path.join(sysconfig.get_paths()["stdlib"], "uuid.py"))


def encode_frames(calls: list[dict[str, Any]], protect: list[int]) -> bytes:
    """The server's side of the protocol (pure): one length-prefixed frame per call.

    Frames, not one line per batch: the worker reads one call at a time, so that a worker
    without a zygote (which forks its children itself) never hands a child the calls queued
    behind it (nor, with its scrubbing allocator, the ones before it)."""
    out = bytearray()
    for call in calls:
        frame = json.dumps({"call": call, "protect": protect}).encode()
        out += b"%d\n" % len(frame) + frame
    return bytes(out)


def _read_frame(fd: int) -> dict[str, Any] | None:
    """The next call from the server (None at end of input), read unbuffered: no copy of it or
    of the next one stays behind in a buffer a later child would inherit."""
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return None
        header += byte
        if len(header) > 20:
            raise ValueError(f"bad frame header {header!r}")
    size = int(header)
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return None
        got += n
    try:
        return json.loads(buf)
    finally:
        buf[:] = bytes(size)  # scrubbed before the memory is reused
        view.release()


def _write_line(fd: int, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def main(argv: list[str]) -> int:
    cfg = WorkerConfig(**json.loads(argv[0]))
    if cfg.cpu is not None:  # first: the zygotes and every call's process inherit it
        try:
            os.sched_setaffinity(0, {cfg.cpu})
        except OSError as err:
            print(f"kuberl sandbox worker: not pinned to CPU {cfg.cpu} ({err})", file=sys.stderr)
    # the protocol lives on private fds; 0/1 become /dev/null so children cannot touch it
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    with contextlib.suppress(Exception):
        LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no /proc/PID/mem, fd or ptrace for our calls
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    root, readable = _private_root(cfg)
    if root is None:
        readable = _fallback_view(cfg)
    slot = Slot(cfg, readable, root)
    gc.collect()
    gc.freeze()
    forker = _start_forker(slot, cfg, (proto_in, proto_out))
    slot.keep_alive = frozenset(forker.pids)
    slot.make_room(list(forker.pids), forker.children_inside)
    hello = {
        "ready": True,
        "slot": cfg.slot,
        "pid": os.getpid(),
        "zygote_pids": list(forker.pids),
        "protections": {
            **slot.protections,
            "zygote": not forker.scrub,
            "light_zygote": len(forker.pids) == 2,
        },
        # if we die uncleanly (a private root is an empty directory outside our mount namespace)
        "leftovers": {"dir": root.root if root else slot.dir, "cgroups": slot.cgroup.dirs()},
    }
    _write_line(proto_out, hello)
    forker.ask(slot)
    try:
        while (frame := _read_frame(proto_in)) is not None:
            slot.protect(frame.get("protect", []))
            kind = zygote_for(frame["call"])
            prepared = forker.take(slot, kind)  # forked while we were idle (or answering the last call)
            try:
                result = run_call(slot, cfg, prepared, frame["call"])
            except ChildGone as err:  # e.g. killed by another slot's call on an old kernel
                print(f"kuberl sandbox worker: {err}; forking another", file=sys.stderr)
                result = run_call(slot, cfg, forker.take(slot, kind), frame["call"])
            _write_line(proto_out, {"result": result})
            del frame, result  # (matters only without a zygote: OwnForks)
            slot.after_call()
            forker.ask(slot)  # the next child is forked while we wait for the next call
    except ZygoteGone as err:  # the server answers the call with an error and starts a new worker
        print(f"kuberl sandbox worker: {err}; exiting", file=sys.stderr)
        return 1
    finally:
        forker.close()
        slot.kill_all()
        slot.remove()
    return 0


def _start_forker(slot: Slot, cfg: WorkerConfig, protocol: tuple[int, int]) -> Zygotes | OwnForks:
    """The full and the light zygote (children never inherit memory that held a call), both
    before the first call; without a light one the full one forks every call. Where the kernel
    refuses ``clone(CLONE_PARENT)``, this worker forks its children itself with freed memory
    scrubbed (so a call finds no trace of earlier calls in the heap it inherits, at a cost in
    calls/s)."""
    try:
        full = Zygote.start(slot, cfg, close=protocol, preload=preload)
        light = None
        try:  # it must not hold the full one's socket (nor could any of its children use it)
            light = Zygote.start(slot, cfg, close=(*protocol, full.sock.fileno()), preload=preload_light)
        except (OSError, ZygoteGone) as err:
            print(f"kuberl sandbox worker: no light zygote ({err}); the full one forks all", file=sys.stderr)
        return Zygotes(full, light)
    except (OSError, ZygoteGone) as err:
        print(f"kuberl sandbox worker: no zygote ({err}); scrubbing freed memory instead", file=sys.stderr)
    LIBC.mallopt(M_PERTURB, 0xA5)
    preload()
    gc.collect()
    gc.freeze()
    return OwnForks(cfg)


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
