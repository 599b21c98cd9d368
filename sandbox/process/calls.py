"""Running one tool call on a worker: fork ahead, hand over the request, watch, capture, answer.

The expensive part of a call is forking the preloaded interpreter (its page tables) and tearing
the child down again; neither depends on the call. So the next child is forked as soon as the
worker has cleaned up after the last one, by the worker's zygote (:mod:`kuberl.sandbox.process.zygote`)
or, where none can run, by the worker itself (:class:`OwnForks`), and that child waits on a pipe
for its request: a call arriving at an idle worker starts at once (:func:`run_call`). And the answer
goes out as soon as the child has written its result record and every writer of its output
pipes is gone, before the worker waits for the child's exit, kills what the call left and
empties its scratch space (:meth:`Slot.after_call`, run after the answer is sent).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kuberl.sandbox.process.child import Pipes, encode_request, run_prepared, set_name

if TYPE_CHECKING:
    from kuberl.sandbox.config import WorkerConfig
    from kuberl.sandbox.containment.slot import Slot

DISK_POLL_SECONDS = 0.05  # a call may overshoot its disk quota by what it writes in one poll
META_LIMIT = 1 << 20  # what the worker reads of a call's result record (its own code could write there)


class _Capture:
    """What the worker keeps of one pipe: the first ``keep`` bytes; the rest is read and dropped
    (so a writer never blocks on a full pipe) but counted."""

    def __init__(self, fd: int, keep: int) -> None:
        self.fd, self.keep, self.total = fd, keep, 0
        self.chunks: list[bytes] = []
        self.open = True
        os.set_blocking(fd, False)

    def read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.open = False
            return
        room = self.keep - min(self.total, self.keep)
        if room > 0:
            self.chunks.append(data[:room])
        self.total += len(data)

    def data(self) -> bytes:
        return b"".join(self.chunks)


def _drain(captures: list[_Capture], budget: float) -> None:
    """Read what is left once every writer is dead (EOF follows at once), for at most ``budget``."""
    end = time.monotonic() + budget
    while any(c.open for c in captures) and (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([c.fd for c in captures if c.open], [], [], left)
        for c in captures:
            if c.fd in ready:
                c.read()


@dataclass
class Prepared:
    """A child forked ahead, blocked reading its request from ``request_w``'s pipe."""

    pid: int
    pidfd: int
    pipes: Pipes
    request_w: int
    generation: int  # the slot's filter generation it was forked with

    def exited(self) -> bool:
        """Whether the child is gone (killed while it waited: another call of its uid can)."""
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def discard(self) -> None:
        """Kill and reap a child that will not run a call (the worker stops, or the filter changed).

        Signalled through its pidfd: a child forked ahead can wait across calls, and the slot's
        sweep may have reaped it meanwhile, so its pid may be another process's by now."""
        with contextlib.suppress(OSError):
            os.close(self.request_w)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        for fd in (self.pidfd, self.pipes.out[0], self.pipes.err[0], self.pipes.meta[0]):
            with contextlib.suppress(OSError):
                os.close(fd)


def prepare(slot: Slot, cfg: WorkerConfig) -> Prepared:
    """Fork the next call's child from this process now; it waits for :func:`run_call` to send
    it a request."""
    slot.ready_for_fork()
    pipes = Pipes.open()
    request_r, request_w = os.pipe()
    # the child is born named kuberl-ready (ps tells an idle child from a call without a window)
    set_name(b"kuberl-ready")
    pid = os.fork()
    if pid:
        set_name(b"kuberl-worker")
    if pid == 0:  # pragma: no cover - child; coverage cannot follow the fork
        os.close(request_w)
        run_prepared(slot, cfg, pipes, request_r)
    os.close(request_r)
    pipes.close_write_ends()
    return Prepared(pid, os.pidfd_open(pid), pipes, request_w, slot.generation)


class OwnForks:
    """Where no zygote can run (``clone(CLONE_PARENT)`` refused): the worker forks each child
    itself, with the same interface as :class:`~kuberl.sandbox.process.zygote.Zygote`. Its children
    then inherit the worker's heap, so the worker scrubs freed memory (glibc ``M_PERTURB``, at a
    cost in calls/s) and reads calls unbuffered."""

    pid = None
    pids: tuple[int, ...] = ()
    scrub = True
    children_inside = False  # the child joins the slot's cgroup once its request is here

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.pending: Prepared | None = None

    def ask(self, slot: Slot) -> None:
        if self.pending is None:
            self.pending = prepare(slot, self.cfg)

    def take(self, slot: Slot, kind: str = "full") -> Prepared:
        """The child forked ahead (one image here: ``kind`` changes nothing)."""
        self.ask(slot)
        prepared, self.pending = self.pending, None
        assert prepared is not None
        if prepared.generation == slot.generation:
            return prepared
        prepared.discard()  # forked with an older filter or directory
        return prepare(slot, self.cfg)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.discard()
            self.pending = None


class ChildGone(RuntimeError):
    """The child forked ahead died before it got its request (nothing of the call ran)."""


def _send(prepared: Prepared, req: dict[str, Any]) -> None:
    data = encode_request(req)
    try:
        while data:
            data = data[os.write(prepared.request_w, data) :]
    except BrokenPipeError as err:
        raise ChildGone(f"the child forked ahead (pid {prepared.pid}) is gone") from err
    finally:
        os.close(prepared.request_w)


def run_call(slot: Slot, cfg: WorkerConfig, prepared: Prepared, req: dict[str, Any]) -> dict[str, Any]:
    """Run ``req`` in the prepared child, enforce the deadline and the disk quota, report.

    Returns as soon as the result is known; the caller then answers and calls
    ``slot.after_call()`` (the child may still be exiting, a daemon of the call still alive)."""
    timeout = float(req["timeout"])
    limit = cfg.max_output_bytes
    slot.cgroup.mark()
    start = time.monotonic()
    # a call that could signal processes of its uid (basic isolation without Landlock's signal
    # scope) may have stopped the child while it waited: the next call would wait out its deadline
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(prepared.pidfd, signal.SIGCONT)
    try:
        _send(prepared, req)
    except ChildGone:
        prepared.discard()
        raise
    pid, pidfd = prepared.pid, prepared.pidfd
    meta_cap = _Capture(prepared.pipes.meta[0], META_LIMIT + 1)
    out_cap, err_cap = _Capture(prepared.pipes.out[0], limit + 1), _Capture(prepared.pipes.err[0], limit + 1)
    captures = [meta_cap, out_cap, err_cap]
    deadline = start + timeout
    # a private root's tmpfs is its own quota (the kernel refuses writes past it); a plain slot
    # directory is measured while the call runs
    poll_disk = slot.root is None
    next_disk_check = start + DISK_POLL_SECONDS
    timed_out = disk_exceeded = exited = False
    status = None
    try:
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                timed_out = True
                break
            if poll_disk and now >= next_disk_check:
                if slot.disk_usage()[1]:
                    disk_exceeded = True
                    break
                # a slot full of small files takes long to scan: never spend over 1/4 of the call on it
                next_disk_check = time.monotonic() + max(DISK_POLL_SECONDS, 3 * (time.monotonic() - now))
            wait = min(left, next_disk_check - now) if poll_disk else left
            watch = [pidfd, *(c.fd for c in captures if c.open)]
            ready, _, _ = select.select(watch, [], [], max(0.0, wait))
            for c in captures:
                if c.fd in ready:
                    c.read()
            if pidfd in ready:
                exited = True
                break
            if not any(c.open for c in captures) and _parse_meta(meta_cap):
                break  # the result record is complete and nobody can write output any more
        if timed_out or disk_exceeded:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if exited or timed_out or disk_exceeded:
            _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
        duration = time.monotonic() - start
        if any(c.open for c in captures):
            slot.kill_all()  # every process that could still hold a write end
            _drain(captures, 0.5)
        for c in captures:
            os.close(c.fd)
    oom = slot.cgroup.hit_memory_limit()
    # what the call left when it ended counts too (it may have written it faster than one poll)
    disk_exceeded = disk_exceeded or slot.disk_usage()[1]
    meta = _parse_meta(meta_cap, limit) or {}
    out = {"duration_s": duration, "timed_out": timed_out, "meta": meta, "oom": oom}
    if disk_exceeded:
        out["disk_exceeded_mb"] = cfg.disk_mb
    if status is not None:
        out["signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out["exit_code"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    if req["op"] == "exec":
        for name, cap in (("stdout", out_cap), ("stderr", err_cap)):
            out[name] = cap.data()[:limit].decode("utf-8", "replace")
            out[f"{name}_truncated"] = cap.total > limit
    return out


_META_TYPES = {"repr": (str, type(None)), "traceback": str, "truncated": bool, "correct": bool}
_STATUSES = ("ok", "error", "memory")


def _parse_meta(cap: _Capture, limit: int | None = None) -> dict[str, Any] | None:
    """The child's result record, once complete: a JSON object with a known status and fields
    of the right types. The call's own code can write to that pipe too: whatever it wrote is
    checked like any input (a forged record only misreports the call's own result), and its
    texts are cut to ``limit`` characters (the output limit) like the child's own."""
    if cap.open or not cap.chunks or cap.total > META_LIMIT:
        return None
    try:
        meta = json.loads(cap.data())
    except Exception:  # noqa: BLE001 - ValueError, or RecursionError from '[[[[...'
        return None
    if not isinstance(meta, dict) or meta.get("status") not in _STATUSES:
        return None
    clean: dict[str, Any] = {"status": meta["status"]}
    for key, kind in _META_TYPES.items():
        if key in meta:
            if not isinstance(meta[key], kind):
                return None
            clean[key] = meta[key]
    for key in ("repr", "traceback"):
        if limit is not None and isinstance(clean.get(key), str) and len(clean[key]) > limit:
            clean[key] = clean[key][:limit]
            clean["truncated"] = True
    return clean
