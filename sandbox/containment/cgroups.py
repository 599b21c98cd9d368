"""Per-slot memory + pids (+ cpu) cgroups, on cgroup v1 or the unified v2 hierarchy.

A slot's cgroup bounds what one tool call may use (memory, processes) and lists every
process the call made, however it detached itself, so the worker can kill them all. Where
no cgroup can be created (not root, a read-only /sys/fs/cgroup in a container, v2 without
delegation) the slot runs without one and says so in its protections; the worker then
falls back to its subreaper sweep and rlimits.
"""

from __future__ import annotations

import contextlib
import os

from kuberl.sandbox.containment.kfiles import read_bytes, write_text

CGROUP_ROOT = "/sys/fs/cgroup"
# one core per slot (a worker per core), on request: a call's threads cannot starve the other
# slots and the server. Off by default: joining a third cgroup and CFS bandwidth accounting
# slow every call, and the deadline and RLIMIT_CPU already bound a hog. Where the cpu
# controller is available.
CPU_PERIOD_US = 100_000
V2_PARENT = "kuberl-sandbox"  # one parent for every slot on the host (no processes of its own)


def _read_pids(path: str) -> set[int]:
    try:
        return {int(p) for p in read_bytes(os.path.join(path, "cgroup.procs")).split()}
    except OSError:
        return set()


class SlotCgroup:
    """No cgroup: nothing bounded, nothing listed (the worker reports and compensates)."""

    version = 0
    memory = False
    pids = False
    cpu = False
    # whether a zygote may live in the cgroup, so that the children it forks are born there
    # (no migration per call: see :meth:`Slot.settle_zygote`); v2's cgroup.kill would take it
    zygote_inside = False

    def join(self, pid: int) -> None:
        """Move ``pid`` (the forked call, before it runs user code) into the slot's cgroup."""

    def members(self) -> set[int]:
        return set()

    def set_pids_max(self, pids_max: int) -> None:
        """Change the process cap (room for the zygotes that live inside)."""

    def open_dir(self) -> int | None:
        """A descriptor of the cgroup v2 directory, for clone3's ``CLONE_INTO_CGROUP`` (v2 only)."""
        return None

    def kill(self) -> None:
        """SIGKILL every member at once where the kernel offers it (v2 ``cgroup.kill``)."""

    def mark(self) -> None:
        """Remember the memory-limit counter before a call."""

    def hit_memory_limit(self) -> bool:
        """Did the call run into the memory limit since :meth:`mark`?"""
        return False

    def remove(self) -> None:
        """Delete the cgroup (it must be empty)."""

    def dirs(self) -> list[str]:
        """The cgroup directories, for whoever cleans up after a worker that was killed."""
        return []


class CgroupV1(SlotCgroup):
    """Separate ``memory`` and ``pids`` hierarchies: ``<root>/<controller>/kuberl/<name>``."""

    version = 1
    zygote_inside = True

    def __init__(self, root: str, name: str, memory_bytes: int, pids_max: int, cpu_cap: bool = False) -> None:
        self.paths: dict[str, str] = {}
        limits = {
            "memory": {"memory.limit_in_bytes": str(memory_bytes)},
            "pids": {"pids.max": str(pids_max)},
        }
        if cpu_cap:
            limits["cpu"] = {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": str(CPU_PERIOD_US)}
        for ctrl, files in limits.items():
            path = os.path.join(root, ctrl, "kuberl", name)
            try:
                os.makedirs(path, exist_ok=True)
                for fname, value in files.items():
                    write_text(os.path.join(path, fname), value)
                self.paths[ctrl] = path
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        self.memory = "memory" in self.paths
        self.pids = "pids" in self.paths
        self.cpu = "cpu" in self.paths

    def join(self, pid: int) -> None:
        for path in self.paths.values():
            write_text(os.path.join(path, "cgroup.procs"), str(pid))

    def members(self) -> set[int]:
        out: set[int] = set()
        for path in self.paths.values():
            out |= _read_pids(path)
        return out

    def set_pids_max(self, pids_max: int) -> None:
        if self.pids:
            write_text(os.path.join(self.paths["pids"], "pids.max"), str(pids_max))

    def mark(self) -> None:
        if self.memory:
            with contextlib.suppress(OSError):
                write_text(os.path.join(self.paths["memory"], "memory.failcnt"), "0")

    def hit_memory_limit(self) -> bool:
        if not self.memory:
            return False
        try:
            return int(read_bytes(os.path.join(self.paths["memory"], "memory.failcnt")).strip() or 0) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                os.rmdir(path)

    def dirs(self) -> list[str]:
        return list(self.paths.values())


class CgroupV2(SlotCgroup):
    """Unified hierarchy: ``<root>/kuberl-sandbox/<name>`` with memory and pids enabled.

    The parent holds no processes (v2's no-internal-processes rule), so enabling controllers
    for its children works wherever the parent of ``kuberl-sandbox`` delegates them: the host
    root, or a delegated subtree. v2 counters cannot be reset, so :meth:`mark` remembers the
    ``oom_kill`` count and :meth:`hit_memory_limit` compares with it.
    """

    version = 2

    def __init__(self, root: str, name: str, memory_bytes: int, pids_max: int, cpu_cap: bool = False) -> None:
        parent = os.path.join(root, V2_PARENT)
        self.path = os.path.join(parent, name)
        self._oom_mark = 0
        try:
            self._enable(root, parent)
            os.makedirs(self.path, exist_ok=True)
        except OSError:
            self.path = ""
            return
        self.memory = self._try(("memory.max", str(memory_bytes)), ("memory.swap.max", "0"))
        self.pids = self._try(("pids.max", str(pids_max)))
        self.cpu = cpu_cap and self._try(("cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}"))
        if not (self.memory or self.pids):
            self.remove()
            self.path = ""

    @staticmethod
    def _enable(root: str, parent: str) -> None:
        """Enable memory + pids for the parent's children (and for the parent at the root),
        cpu with them where the host offers it (best effort: a host may refuse cpu, e.g. while
        realtime tasks run; then the slots run without a cpu limit)."""
        need = {"memory", "pids"}
        try:
            with open(os.path.join(root, "cgroup.controllers")) as fh:
                offered = set(fh.read().split())
        except OSError:
            offered = set()
        os.makedirs(parent, exist_ok=True)
        for path in (root, parent):
            control = os.path.join(path, "cgroup.subtree_control")
            try:
                with open(control) as fh:
                    enabled = set(fh.read().split())
            except FileNotFoundError:
                enabled = set()
            if not need <= enabled:
                extra = {"cpu"} & offered - enabled
                try:
                    write_text(control, " ".join(f"+{c}" for c in sorted(need | extra)))
                except OSError:
                    if not extra:
                        raise
                    write_text(control, " ".join(f"+{c}" for c in sorted(need)))

    def _try(self, *files: tuple[str, str]) -> bool:
        """Write the first (required) limit file and any optional ones that exist."""
        first, *rest = files
        try:
            write_text(os.path.join(self.path, first[0]), first[1])
        except OSError:
            return False
        for fname, value in rest:
            with contextlib.suppress(OSError):
                write_text(os.path.join(self.path, fname), value)
        return True

    def join(self, pid: int) -> None:
        if self.path:
            write_text(os.path.join(self.path, "cgroup.procs"), str(pid))

    def members(self) -> set[int]:
        return _read_pids(self.path) if self.path else set()

    def set_pids_max(self, pids_max: int) -> None:
        if self.pids:
            write_text(os.path.join(self.path, "pids.max"), str(pids_max))

    def open_dir(self) -> int | None:
        if not self.path:
            return None
        try:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None

    def kill(self) -> None:
        if self.path:
            with contextlib.suppress(OSError):
                write_text(os.path.join(self.path, "cgroup.kill"), "1")

    def _oom_kills(self) -> int:
        try:
            text = read_bytes(os.path.join(self.path, "memory.events")).decode()
            fields = dict(line.split() for line in text.splitlines() if line.strip())
            return int(fields.get("oom_kill", 0)) + int(fields.get("oom", 0))
        except (OSError, ValueError):
            return 0

    def mark(self) -> None:
        if self.memory:
            self._oom_mark = self._oom_kills()

    def hit_memory_limit(self) -> bool:
        return self.memory and self._oom_kills() > self._oom_mark

    def remove(self) -> None:
        if self.path:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def dirs(self) -> list[str]:
        return [self.path] if self.path else []


def remove_cgroup_dirs(dirs: list[str], patience: float = 2.0) -> None:
    """Kill what is left in ``dirs`` and delete them (a worker died without cleaning up)."""
    import signal
    import time

    deadline = time.monotonic() + patience
    for path in dirs:
        while True:
            for pid in _read_pids(path):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def slot_cgroup(
    name: str, memory_bytes: int, pids_max: int, root: str = CGROUP_ROOT, cpu_cap: bool = False
) -> SlotCgroup:
    """The best cgroup this host lets us create for one slot (a :class:`SlotCgroup` if none)."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        cg: SlotCgroup = CgroupV2(root, name, memory_bytes, pids_max, cpu_cap)
    elif os.path.isdir(os.path.join(root, "memory")) or os.path.isdir(os.path.join(root, "pids")):
        cg = CgroupV1(root, name, memory_bytes, pids_max, cpu_cap)
    else:
        return SlotCgroup()
    return cg if (cg.memory or cg.pids) else SlotCgroup()
