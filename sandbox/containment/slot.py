"""A worker's slot: the cgroup, uid, scratch space, filesystem view and seccomp filter its
calls run in, and what is done to it before and after each call (see :class:`Slot`).

Split from :mod:`kuberl.sandbox.process.worker` (which owns the protocol and the process setup): the
slot's methods run in three processes, the worker (clearing it after a call), the zygote
(keeping its filter and directory current, living in its cgroup) and a call's child (entering
it), and each says which.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from kuberl.sandbox.containment import landlock
from kuberl.sandbox.containment.cgroups import SlotCgroup, slot_cgroup
from kuberl.sandbox.containment.fsview import (
    DEVICES,
    PrivateRoot,
    clear_dir,
    read_rules,
    readonly_paths,
    service_paths,
    use_call_environment,
)
from kuberl.sandbox.containment.kfiles import write_text
from kuberl.sandbox.containment.procs import (
    descendants,
    kill_children,
    reap_zombies,
    uid_has_processes,
    unlinked_bytes,
    wait_for_exit,
)
from kuberl.sandbox.containment.seccomp import SeccompProgram

if TYPE_CHECKING:
    from kuberl.sandbox.config import WorkerConfig

UNREADABLE_BYTES = 1 << 50  # what a directory the worker cannot read counts as: over any quota
CLEAN_BUDGET_SECONDS = 1.0  # removing what a call left (basic isolation); the rest is moved aside
TRASH_SLICE_SECONDS = 0.05  # what each later call spends removing trees moved aside
ENTRY_BYTES = 4096  # what any file, directory or link counts at least against the disk quota


class Slot:
    """The cgroup, uid, scratch space, filesystem view and seccomp filter one worker's calls run in.

    ``dir`` is the scratch space as the worker sees it, ``call_dir`` as the call does (the same
    path, except under a :class:`PrivateRoot`, where the call sees ``/tmp``, or ``/scratch``
    where the interpreter itself lives under /tmp).
    """

    def __init__(self, cfg: WorkerConfig, python_readable: bool, root: PrivateRoot | None = None) -> None:
        self.cfg = cfg
        full = cfg.isolation == "full"
        # a root worker always drops calls to a slot uid where the interpreter allows it: as
        # root a call would ignore RLIMIT_NPROC and could signal or ptrace anything
        uid_ok = os.geteuid() == 0 and python_readable
        self.uid = cfg.uid_base + cfg.slot if uid_ok else None
        self.root = root
        self.trash: list[str] = []  # what clear_dir could not remove in its budget, moved aside
        if root is not None:
            root.uid = self.uid
            root.fresh_tmp()
            self.dir, self.call_dir = root.tmp, root.scratch
            name = os.path.basename(root.root)
        else:
            # unique even across services: in a PID namespace every worker is pid 1
            self.dir = self._new_dir()
            self.call_dir = self.dir
            name = os.path.basename(self.dir)
        # the interpreter's own pages on top; under a private root the call's files live in
        # memory (tmpfs pages are charged to the cgroup of whoever wrote them)
        memory = (cfg.memory_mb + 64 + (cfg.disk_mb if root is not None else 0)) * 2**20
        self.cgroup = slot_cgroup(name, memory, cfg.max_processes) if full else SlotCgroup()
        # the worker itself (and its threads, if a library started any), and outside a PID
        # namespace the server (our parent); the server adds its threads and the other
        # workers with every batch (see protect())
        own = {1, os.getpid()} | {int(t) for t in os.listdir("/proc/self/task")}
        self.own_pids = frozenset(own | (set() if cfg.in_namespace else {os.getppid()}))
        self.protected = self.own_pids
        # without a private root, host sockets are reachable by path; without a memory cgroup,
        # memfd pages escape the call's memory limit
        self._filter_opts = {"unix_sockets": root is not None, "memfd": self.cgroup.memory}
        self.seccomp = SeccompProgram.compile(self.protected, **self._filter_opts)
        self._filter_pids = self.protected  # what self.seccomp was compiled for
        self.generation = 0  # bumped when the filter or ruleset a child inherits changes
        self.keep_alive: frozenset[int] = (
            frozenset()
        )  # our children that are not calls' (zygotes, children forked ahead)
        self.born_inside = False  # (in a zygote and its children) forked inside the slot's cgroup
        self.clone_fd: int | None = None  # (in a zygote, v2) the cgroup its children are cloned into
        self.ready_inside = False  # (in the worker) children forked ahead wait in the slot's cgroup
        self.landlock_abi = landlock.abi_version()
        self.landlock: landlock.Ruleset | None = None
        self._build_landlock()
        self.protections = {
            "cgroup_memory": self.cgroup.memory,
            "cgroup_pids": self.cgroup.pids,
            "cgroup_cpu": self.cgroup.cpu,  # one core per slot
            "uid": self.uid is not None,
            # a per-call process cap: the pids cgroup, or RLIMIT_NPROC under a non-root uid
            # (root ignores it: a root call in basic isolation has no cap, and says so)
            "pids": self.cgroup.pids or self.uid is not None or os.geteuid() != 0,
            "seccomp": self.seccomp is not None,
            "landlock": self.landlock is not None,
            "disk_quota": True,
            "rlimits": True,
            "setsid": True,
            "home_hidden": root is not None or (python_readable and cfg.in_namespace),
            "env_allowlist": True,
            # reads limited to the interpreter, its packages and shared libraries
            "fs_view": root is not None or self.landlock is not None,
            "private_root": root is not None,
            "call_tmpfs": root is not None,
            "ipc_namespace": cfg.in_namespace,
            "stack_limit": True,
            "capabilities_dropped": True,
        }

    def _new_dir(self) -> str:
        """The slot directory; replacements (after a tree was moved aside) are named after the
        first one, so whoever cleans up after this worker finds them all (``service.workers.remove_leftovers``)."""
        if not hasattr(self, "base_dir"):
            path = self.base_dir = tempfile.mkdtemp(prefix=f"kuberl-sbx-{self.cfg.pool}-{self.cfg.slot}-")
        else:
            path = f"{self.base_dir}.{time.monotonic_ns()}"
            os.mkdir(path, 0o700)
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)
        os.chmod(path, 0o700)
        return path

    def _build_landlock(self) -> None:
        """Basic isolation (and full without a private root): reads and writes allowlisted."""
        if self.root is not None or self.landlock_abi < 1:
            return
        if self.landlock is not None:
            self.landlock.close()
            self.landlock = None
        whole, list_only = read_rules(readonly_paths(), service_paths())
        try:
            self.landlock = landlock.Ruleset.build(
                [self.dir], [os.devnull], self.landlock_abi, [*whole, *DEVICES], list_only
            )
        except OSError as err:  # e.g. a container seccomp profile that allows only some calls
            print(f"landlock unavailable: {err}", file=sys.stderr)

    def protect(self, pids: list[int]) -> None:
        """Also refuse signals to ``pids`` (host pids: meaningless inside a PID namespace).

        Bumps the generation when the set changes (worker restarts); the filter is recompiled
        where children are forked, before the next fork (:meth:`ready_for_fork`)."""
        if self.cfg.in_namespace or self.seccomp is None:
            return
        wanted = self.own_pids | {p for p in pids if isinstance(p, int) and 0 < p < 2**31}
        if wanted != self.protected:
            self.protected = wanted
            self.generation += 1

    def add_own(self, pid: int) -> None:
        """``pid`` is part of this worker (its zygote): no call may signal it, in any mode."""
        self.own_pids |= {pid}
        if self.seccomp is not None:
            self.protected |= {pid}
            self.generation += 1

    def use_state(self, protected: frozenset[int], path: str) -> None:
        """In the zygote: the worker's current filter pids and slot directory."""
        self.protected = protected
        if path != self.dir:
            self.dir = self.call_dir = path
            self._build_landlock()
            use_call_environment(self.call_dir)

    def ready_for_fork(self) -> None:
        """Compile the filter for the current pids if they changed since the last compile."""
        if self.seccomp is not None and self._filter_pids != self.protected:
            self.seccomp = SeccompProgram.compile(self.protected, **self._filter_opts) or self.seccomp
            self._filter_pids = self.protected

    def child_fds(self) -> tuple[int, ...]:
        """Descriptors a call's child needs until it enters the sandbox (the Landlock ruleset)."""
        return (self.landlock.fd,) if self.landlock is not None else ()

    def disk_usage(self) -> tuple[int, bool]:
        """(bytes the call's files hold, whether that is over the quota or the space is full)."""
        if self.root is not None:
            return self.root.tmp_usage()
        # files the call unlinked but holds open count too (they fill the disk all the same)
        used = _dir_bytes(self.dir) + unlinked_bytes(descendants(os.getpid()), self.dir)
        return used, used > self.cfg.disk_mb * 2**20

    def settle_zygote(self) -> None:
        """In a zygote, once it has preloaded: move into the slot's cgroup, so that every child
        it forks is born there. A call's child then joins no cgroup: a migration takes the
        kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period
        whenever the last one was a while ago: milliseconds on a call's tail latency.

        The pages the zygote has so far stay charged where they were (cgroups never move
        charges); the out-of-memory killer, which picks the process of the cgroup with the most
        points, picks the call (:meth:`join` gives it ``oom_score_adj`` 1000: the points of the
        cgroup's whole limit on top of its own pages); the worker makes room for the zygotes
        under ``pids.max`` (:meth:`make_room`) and spares them when it clears the slot
        (``keep_alive``). On cgroup v2 the zygote stays outside (``cgroup.kill`` empties a
        slot there) and clone3 puts each child into the cgroup as it is born
        (:func:`~kuberl.sandbox.process.zygote.fork_sibling`)."""
        if self.cgroup.version == 2:
            self.clone_fd = self.cgroup.open_dir()
            return
        if not (self.cgroup.zygote_inside and self.cgroup.pids):
            return
        try:
            self.cgroup.join(os.getpid())
        except OSError as err:  # the children join one by one instead
            print(f"kuberl sandbox zygote: stays outside the slot's cgroup ({err})", file=sys.stderr)
            return
        self.born_inside = True

    def make_room(self, zygotes: list[int], children_inside: bool) -> None:
        """In the worker: what waits in the slot's cgroup while a call runs does not count
        against the call's ``maxProcesses``: the zygotes that live there (v1), and the child
        each other zygote has forked ahead where children are born there (v1, or v2 clone3).
        While a child waits there, clearing the slot spares it: no ``cgroup.kill``."""
        self.ready_inside = children_inside
        extra = len(set(zygotes) & self.cgroup.members())
        if children_inside:
            extra += len(zygotes) - 1
        if extra:
            self.cgroup.set_pids_max(self.cfg.max_processes + extra)

    def join(self) -> None:
        """In the call's child, before any of its code: into the slot's cgroup (born there when
        a zygote lives inside), and first in line for the out-of-memory killer, before the
        zygotes that share the cgroup and before the service itself."""
        with contextlib.suppress(OSError):  # raising it needs no privilege
            write_text("/proc/self/oom_score_adj", "1000")
        if not self.born_inside:
            self.cgroup.join(os.getpid())

    def enter(self) -> None:
        """In the call's child, as root: into the private root, or into the slot directory."""
        if self.root is not None:
            self.root.enter()
        else:
            os.chdir(self.dir)

    def kill_all(self) -> None:
        """SIGKILL every process of the slot: cgroup members, then all processes of its uid.

        The uid sweep costs a fork of this (large, preloaded) worker, about as much as the call
        itself, so it runs only when something could have escaped the cgroup sweep: no pids
        cgroup, a cgroup that would not empty, or a process of the slot uid still in /proc.
        """
        emptied = False
        if not self.ready_inside:  # (cgroup.kill would take the children waiting there too)
            self.cgroup.kill()
        for _ in range(50):
            pids = self._cgroup_pids()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                emptied = True
                break
            wait_for_exit(pids, 0.002)
        tracked = emptied and self.cgroup.pids
        if not tracked:
            kill_children(self.keep_alive)
        # the call's own process is often still exiting when we get here (we answered first):
        # reaped, it is not mistaken for a process of the uid that escaped (a sweep per call)
        reap_zombies(self.keep_alive)
        if self.uid is not None and (
            not tracked or uid_has_processes(self.uid, self.keep_alive | {os.getpid()})
        ):
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
            reap_zombies(self.keep_alive)

    def _cgroup_pids(self) -> list[int]:
        return sorted(self.cgroup.members() - {os.getpid()} - self.keep_alive)

    def after_call(self) -> None:
        """Once the answer is out: kill whatever the call left running, empty its scratch space."""
        self.kill_all()
        self.recycle()

    def recycle(self) -> None:
        """Empty the scratch space for the next call, in bounded time, whatever the last left.

        Private root: a fresh tmpfs (unless untouched). Otherwise :func:`clear_dir` with a budget; a tree it cannot
        finish is moved aside whole (a new slot directory and Landlock ruleset take its place)
        and removed a slice at a time after later calls, so no call waits long for it."""
        if self.root is not None:
            self.root.recycle_tmp()
            return
        try:
            done = clear_dir(self.dir, CLEAN_BUDGET_SECONDS)
            # what a call can leave on its directory itself (clear_dir restored its mode)
            for name in os.listxattr(self.dir):
                os.removexattr(self.dir, name)
            os.utime(self.dir)
        except OSError as err:
            print(f"kuberl sandbox worker: cleaning {self.dir} failed ({err}); replacing it", file=sys.stderr)
            done = False
        if not done:
            aside = f"{self.base_dir}.trash-{time.monotonic_ns()}"
            os.rename(self.dir, aside)
            self.trash.append(aside)
            self.dir = self.call_dir = self._new_dir()
            self._build_landlock()
            self.generation += 1
        self._empty_trash(TRASH_SLICE_SECONDS)

    def _empty_trash(self, budget: float) -> None:
        while self.trash:
            path = self.trash[0]
            try:
                if not clear_dir(path, budget):
                    return
                os.rmdir(path)
            except OSError as err:
                print(f"kuberl sandbox worker: giving up on {path} ({err})", file=sys.stderr)
            self.trash.pop(0)

    def remove(self) -> None:
        if self.root is None:
            self._empty_trash(5.0)
            with contextlib.suppress(OSError):
                clear_dir(self.dir, 5.0)
            shutil.rmtree(self.dir, ignore_errors=True)
        self.cgroup.remove()


def _dir_bytes(path: str) -> int:
    """Allocated bytes of every file beneath ``path`` (sparse holes are free; links not followed).

    Walks by file descriptor (no path grows past PATH_MAX, a directory swapped for a symlink is
    not followed: O_NOFOLLOW) and opens up directories the call locked (we own them); a
    directory that still cannot be read counts as over any quota. Every entry counts at least
    :data:`ENTRY_BYTES`: empty files hold inodes and directory blocks too, and a call making
    hundreds of thousands of them would otherwise stay at 0 bytes while the filesystem's inodes
    run out and the cleanup after it falls behind."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    total = 0
    try:
        stack = [os.open(path, flags)]
    except OSError:
        return 0
    while stack:
        fd = stack.pop()
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                        total += max(st.st_blocks * 512, ENTRY_BYTES)
                        if entry.is_dir(follow_symlinks=False):
                            with contextlib.suppress(OSError):
                                os.chmod(entry.name, 0o700, dir_fd=fd)
                            stack.append(os.open(entry.name, flags, dir_fd=fd))
                    except OSError:
                        total += UNREADABLE_BYTES
        except OSError:
            total += UNREADABLE_BYTES
        finally:
            os.close(fd)
    return total
