"""The forked child's side of one tool call: from the worker's fork to the call's result.

It wires the call's stdin (a memfd), stdout, stderr and result record (pipes the worker reads)
to fixed descriptors, enters the sandbox as root (setsid, the slot's cgroup, the private root or
slot directory, rlimits, the slot uid or no capabilities, an environment of its own, Landlock,
seccomp) and runs the code as ``__main__``, IPython-style. Everything here runs after ``fork``
in a process that will ``_exit``; the worker keeps no state of it.
"""

from __future__ import annotations

import _signal
import ast
import contextlib
import ctypes
import json
import math
import os
import resource
import sys
import tempfile
import traceback
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any, NoReturn

from kuberl.sandbox.containment.fsview import environment_for, use_call_environment
from kuberl.sandbox.containment.kfiles import read_bytes
from kuberl.sandbox.containment.procs import uid_task_count
from kuberl.sandbox.containment.seccomp import PR_SET_NO_NEW_PRIVS
from kuberl.sandbox.libc import LIBC
from kuberl.sandbox.types import valid_text

if TYPE_CHECKING:
    from kuberl.sandbox.config import WorkerConfig
    from kuberl.sandbox.containment.slot import Slot

# looked up in the worker, used by every forked child
_PRCTL, _MALLOPT, _CAPSET = LIBC.prctl, LIBC.mallopt, LIBC.capset
# Python frames of 3.11 live on the heap, not the C stack: with sys.setrecursionlimit(10**7)
# runaway recursion takes seconds and gigabytes before it fails; 100k frames fail in ~50 ms
MAX_RECURSION_DEPTH = 100_000
TRACEBACK_FRAMES = 50
_PR_SET_NAME = 15
_PR_SET_DUMPABLE = 4
_PR_SET_SECUREBITS = 28
_PR_CAPBSET_DROP = 24
_SECBITS_NOROOT_LOCKED = 0x2F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS: each set and locked
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


_STDIO: list[Any] = []  # sys.stdin, stdout and stderr for the children, made by the zygote
_M_ARENA_MAX = -8
_M_PERTURB = -6
_DEFAULT_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGPIPE, _signal.SIGCHLD)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _drop_capabilities() -> None:
    """A call that keeps uid 0 (no slot uid could be used) keeps no capability either: none
    now, none from the bounding set, and root's exec-time grant switched off (securebits)."""
    _PRCTL(_PR_SET_SECUREBITS, _SECBITS_NOROOT_LOCKED, 0, 0, 0)
    for cap in range(64):
        if _PRCTL(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the kernel's last capability
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if _CAPSET(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _enter_ahead(slot: Slot, cfg: WorkerConfig) -> None:
    """The part of entering the sandbox that no request decides (as root, before it arrives):
    a child forked ahead does it while the worker waits for the next call, off the call's path.
    Nothing here is lost if the child is discarded unused. As root it keeps root's uid and
    capabilities until its request is here, out of reach of a call (slot uid, no capabilities);
    under a shared uid (basic isolation) it is as exposed to signals as it was before."""
    os.setsid()
    # the C module's calls and a raw read: the Python wrappers (signal's enum conversions, the io
    # stack) run code all over the inherited heap, and each page they touch is copied for us
    for sig in _DEFAULT_SIGNALS:
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
    vsize = int(read_bytes("/proc/self/statm").split()[0]) * _PAGE_SIZE
    mem = cfg.memory_mb * 2**20
    for res, value in (
        (resource.RLIMIT_AS, vsize + mem),
        (resource.RLIMIT_FSIZE, cfg.max_file_mb * 2**20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    if slot.uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
    elif os.geteuid() != 0:  # shared uid (unprivileged pod): cap what this call may add to it
        nproc = uid_task_count(os.getuid()) + cfg.max_processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _enter_sandbox(slot: Slot, cfg: WorkerConfig, timeout: float) -> None:
    """The rest, once the request is here, right before the untrusted code: the slot's cgroup,
    its directory (joined now: one that changed since the fork is the one used), the CPU limit,
    the uid, Landlock and seccomp."""
    slot.join()
    slot.enter()
    cpu = max(1, math.ceil(timeout)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if slot.uid is not None:
        os.setgroups([])
        os.setgid(slot.uid)
        os.setuid(slot.uid)
    elif os.geteuid() == 0:
        _drop_capabilities()
    if environment_for() != slot.call_dir:  # forked by the worker itself, not by a zygote
        use_call_environment(slot.call_dir)
    # tempfile's cached choice is the call's scratch space: a zygote that asked before the
    # call's root existed (a preloaded module) got the host's /tmp where the scratch space is
    # elsewhere (an interpreter under /tmp), and /tmp is read-only under the call's root
    tempfile.tempdir = slot.call_dir
    if _PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # Landlock needs it without CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if slot.landlock is not None:
        # the worker (same uid, not root) must read our /proc/PID/fd to count files we unlink
        # while holding them; other calls cannot use that: Landlock keeps them out of /proc
        if slot.uid is None and os.geteuid() != 0:
            _PRCTL(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        slot.landlock.restrict_self()
        slot.landlock.close()
    if slot.seccomp is not None:
        slot.seccomp.load()


def _limit_recursion() -> None:
    """``sys.setrecursionlimit`` keeps working, up to :data:`MAX_RECURSION_DEPTH`."""
    raw = sys.setrecursionlimit

    def setrecursionlimit(limit: int, /) -> None:
        raw(min(int(limit), MAX_RECURSION_DEPTH))

    setrecursionlimit.__doc__ = raw.__doc__
    sys.setrecursionlimit = setrecursionlimit


def split_trailing_expression(code: str) -> tuple[CodeType, CodeType] | None:
    """``code`` compiled as its statements but the last and that last one, an expression, from
    the text alone: split at the last line that starts in column 0, where both halves compile
    (the head as statements, the tail as an expression; then the tail is exactly the module's
    last statement, an expression statement). None where that does not hold: the caller
    parses the code (``ast.parse`` builds a Python object per syntax node, and in a forked
    child each page those touch is copied on write, a cost every call would pay).

    Line numbers stay the code's own: the tail is compiled after as many empty lines."""
    lines = code.split("\n")
    at = len(lines) - 1
    while at >= 0 and (not lines[at][:1] or lines[at][:1].isspace() or lines[at][:1] == "#"):
        at -= 1
    if at < 0:
        return None
    try:  # the tail first: it is what fails when the code ends in a block, and it is short
        tail = compile("\n" * at + "\n".join(lines[at:]), "<string>", "eval")
        head = compile("\n".join(lines[:at]), "<string>", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return head, tail


def _run_user_code(code: str) -> dict[str, Any]:
    """Execute ``code`` as __main__; IPython-style value of a trailing expression."""
    split = split_trailing_expression(code)
    if split is None:
        try:
            tree = ast.parse(code, filename="<string>", mode="exec")
        except SyntaxError:
            return {"status": "error", "traceback": traceback.format_exc(limit=0)}
        except (MemoryError, RecursionError, ValueError) as exc:  # deeply nested or NUL-laden source
            return {"status": "error", "traceback": f"SyntaxError: {type(exc).__name__}: {exc}\n"}
    env: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        if split is None:
            tail = tree.body.pop().value if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<string>", "exec"), env)  # noqa: S102 - this is the sandbox
            last = compile(ast.Expression(tail), "<string>", "eval") if tail is not None else None
        else:
            exec(split[0], env)  # noqa: S102
            last = split[1]
        value = eval(last, env) if last is not None else None  # noqa: S307
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
        # the innermost frames: a runaway recursion has 100k identical ones
        text = "".join(traceback.format_exception(type(exc), exc, tb, limit=-TRACEBACK_FRAMES))
        return {"status": "error", "traceback": text}


def _close_fds(keep: tuple[int, ...]) -> None:
    """Close every descriptor above stderr but ``keep``."""
    low = 3
    for fd in sorted(k for k in set(keep) if k >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


@dataclass
class Pipes:
    """The call's stdout, stderr and result record: pipes the worker opened and reads. A call
    can close or fill its ends, never point them at a file the worker would then read."""

    out: tuple[int, int]
    err: tuple[int, int]
    meta: tuple[int, int]

    @classmethod
    def open(cls) -> Pipes:
        return cls(os.pipe(), os.pipe(), os.pipe())

    def close_write_ends(self) -> None:
        for _, w in (self.out, self.err, self.meta):
            os.close(w)


def set_name(name: bytes) -> None:
    """This process's name in ps (comm)."""
    _PRCTL(_PR_SET_NAME, name, 0, 0, 0)


def run_prepared(slot: Slot, cfg: WorkerConfig, pipes: Pipes, request_r: int) -> NoReturn:
    """A child forked ahead: get ready for a call, wait for the request, run it, exit (never
    returns). Getting ready (its descriptors, the request-independent part of the sandbox)
    happens while the worker waits for the next call: ~1 ms less on every call's path."""
    code = 0
    try:
        if not _STDIO:  # forked by the worker itself: what a zygote sets up once, done here
            _set_up_malloc()
            _limit_recursion()
        devnull = _wire(slot, pipes, request_r)
        _enter_ahead(slot, cfg)
        chunks = []
        while chunk := os.read(request_r, 1 << 16):
            chunks.append(chunk)
        os.close(request_r)
        if not chunks:  # the worker discarded us
            os._exit(0)
        req = decode_request(b"".join(chunks))
        set_name(b"kuberl-call")
        if req["op"] == "verify":
            child_verify(slot, cfg, req, pipes, devnull)
        else:
            os.close(devnull)
            child_exec(slot, cfg, req, pipes)
    except BaseException:  # noqa: BLE001
        code = 70
    finally:
        os._exit(code)


# A request's two texts by op, in the order they travel (plus "timeout" and "op").
_REQUEST_TEXTS = {b"exec": ("code", "stdin"), b"verify": ("prediction", "gold")}


def encode_request(req: dict[str, Any]) -> bytes:
    """The worker's side of the request pipe (pure): ``op timeout length-of-first-text`` on a
    line, then the two texts (UTF-8; lone surrogates pass as they are). Not JSON: decoding
    JSON in the child runs the json module's Python and a regex, copying pages on every call."""
    op = req["op"].encode()
    first, second = (req.get(name, "").encode("utf-8", "surrogatepass") for name in _REQUEST_TEXTS[op])
    return b"%s %r %d\n%s%s" % (op, float(req["timeout"]), len(first), first, second)


def decode_request(data: bytes) -> dict[str, Any]:
    """The child's side (pure): the request :func:`encode_request` sent."""
    head, _, body = data.partition(b"\n")
    op, timeout, size = head.split()
    first, second = _REQUEST_TEXTS[op]
    n = int(size)
    return {
        "op": op.decode(),
        "timeout": float(timeout),
        first: body[:n].decode("utf-8", "surrogatepass"),
        second: body[n:].decode("utf-8", "surrogatepass"),
    }


def _wire(slot: Slot, pipes: Pipes, request_r: int) -> int:
    """The call's descriptors: stdin a memfd (filled once the request is here: in memory,
    nothing on disk the call could swap), stdout and stderr the worker's pipes, nothing else
    of ours open but the result record, the request pipe and (under Landlock) the ruleset.
    Returns /dev/null, for a verification (which sees no output)."""
    stdin = os.memfd_create("stdin", 0)
    for fd, target in ((stdin, 0), (pipes.out[1], 1), (pipes.err[1], 2)):
        os.dup2(fd, target)
    devnull = os.open(os.devnull, os.O_RDWR)
    _close_fds(keep=(pipes.meta[1], request_r, devnull, *slot.child_fds()))
    sys.stdin, sys.stdout, sys.stderr = _STDIO or _open_stdio()
    return devnull


def _open_stdio() -> tuple[Any, Any, Any]:
    return (
        open(0, closefd=False),  # noqa: SIM115
        open(1, "w", closefd=False),  # noqa: SIM115
        open(2, "w", closefd=False),  # noqa: SIM115
    )


def _set_up_malloc() -> None:
    """glibc's malloc as a call's process needs it (settings a fork inherits)."""
    _MALLOPT(_M_PERTURB, 0)  # off: a worker without a zygote scrubs what it hands down, not us
    # one malloc arena per thread reserves 64 MiB of address space each: under RLIMIT_AS eight
    # threads (a ThreadPoolExecutor) would not start; the GIL serialises them anyway
    _MALLOPT(_M_ARENA_MAX, 2)


def prepare_children() -> None:
    """In the zygote, once: what every child would otherwise set up for itself, at a cost in
    copy-on-write page faults on every call.

    - malloc's settings (each ``mallopt`` also consolidates the heap's free chunks, writing
      all over the inherited heap: ~45 faults a call);
    - the text streams on descriptors 0-2 (the io stack's Python and the codec lookups: ~60
      faults a call). A child finds them unused: the zygote never reads or writes them. They
      are made while 1 and 2 are pipes, as they are in a child, so what they learn of their
      descriptor (not seekable, the pipe's block size) is what a child's would; stdin is a
      memfd in a child, seekable like the zygote's /dev/null;
    - the cap on ``sys.setrecursionlimit`` (a closure and an attribute of sys: ~10 faults)."""
    _set_up_malloc()
    _limit_recursion()
    out_r, out_w = os.pipe()
    saved = os.dup(1), os.dup(2)  # the zygote's own: /dev/null and the service's log
    try:
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        _STDIO[:] = _open_stdio()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, out_r, out_w):
            os.close(fd)


def child_exec(slot: Slot, cfg: WorkerConfig, req: dict[str, Any], pipes: Pipes) -> None:
    data = req.get("stdin", "").encode("utf-8", "surrogateescape")
    while data:
        data = data[os.write(0, data) :]
    os.lseek(0, 0, os.SEEK_SET)
    _enter_sandbox(slot, cfg, float(req["timeout"]))
    call = os.getpid()
    meta = _run_user_code(req["code"])
    if os.getpid() != call:
        _leave_as_a_fork(meta)
    _write_meta(pipes.meta[1], meta, cfg.max_output_bytes)


def _leave_as_a_fork(meta: dict[str, Any]) -> NoReturn:
    """A process the code forked came back out of it (``if os.fork() == 0: ...`` without an
    exit): it ends the way a plain ``python`` script's fork would, output flushed, a traceback
    on stderr, and writes no result record, which is the call's own process's to write (two
    records would garble each other)."""
    code = 0
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        if meta.get("status") == "error":
            sys.stderr.write(meta.get("traceback", ""))
            code = 1
        elif meta.get("status") == "memory":
            sys.stderr.write("MemoryError\n")
            code = 1
        sys.stderr.flush()
    os._exit(code)


def _write_meta(fd: int, meta: dict[str, Any], limit: int) -> None:
    for key in ("repr", "traceback"):
        if isinstance(meta.get(key), str):
            meta[key] = valid_text(meta[key])
            if len(meta[key]) > limit:
                meta[key] = meta[key][:limit]
                meta["truncated"] = True
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    data = json.dumps(meta).encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]
    # EOF on every pipe tells the worker the result is complete: it answers before our exit
    for done in (fd, 1, 2):
        with contextlib.suppress(OSError):
            os.close(done)


def child_verify(slot: Slot, cfg: WorkerConfig, req: dict[str, Any], pipes: Pipes, devnull: int) -> None:
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    os.close(devnull)
    meta_w = pipes.meta[1]
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
