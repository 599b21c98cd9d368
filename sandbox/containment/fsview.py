"""What of the host filesystem a tool call sees, and the private scratch space it writes in.

A call needs the interpreter, its packages, the shared libraries they load and a few device
files; it needs nothing else of the host: not the checkout the service runs from, not ``/home``,
``/root``, ``/tmp`` or ``/var/run/secrets``, not the service's files or the other slots'.
:func:`readonly_paths` names that minimum once, and both isolation modes enforce it:

* ``full`` (root, in the worker's own mount namespace): :class:`PrivateRoot` builds a root of
  read-only bind mounts of exactly those paths, the device files, a fresh ``/proc`` of the
  worker's PID namespace (other uids' processes hidden) and ``/tmp``, a tmpfs mounted fresh
  for every call and detached after it. Calls ``chroot`` into it. The tmpfs is the call's disk
  quota (the kernel enforces size and inode count, files unlinked while open included) and
  removing what a call left costs one ``umount``, whatever it left.
* ``basic`` (a non-root pod): a Landlock ruleset allows reads only beneath the same paths and
  the slot directory; :func:`clear_dir` removes what a call left with a bounded budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import site
import stat
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable

from kuberl.sandbox.libc import LIBC

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_PRIVATE, MS_REC = 32, 4096, 1 << 18, 16384
MNT_DETACH = 2

# shared libraries a late import may load (sqlite3, ssl, ctypes' libffi, ...) and the loader's cache
SYSTEM_PATHS = (
    "/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib",
    "/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo",
)  # fmt: skip
# device files a call may use; everything else of /dev is absent
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# the environment a call gets: nothing of the service's (cloud keys, tokens, the user's shell)
CHILD_ENV_FIXED = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "USER": "sandbox",  # getpass.getuser() without a passwd file
    "LOGNAME": "sandbox",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# what the worker process itself keeps of the service's environment (it starts the interpreter)
WORKER_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "PYTHONHOME", "PYTHONMALLOC", "GLIBC_TUNABLES")


def child_env(home: str, tmpdir: str) -> dict[str, str]:
    """The whole environment of a call (pure): HOME and TMPDIR in its scratch space, library
    caches beneath HOME, nothing inherited."""
    return {
        **CHILD_ENV_FIXED,
        "HOME": home,
        "TMPDIR": tmpdir,
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "MPLCONFIGDIR": os.path.join(home, ".config", "matplotlib"),
    }


def worker_env(service_env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The worker's environment (pure): an allowlist of the service's, plus ``extra``.

    The worker's own start-up environment is what ``/proc/self/environ`` shows every call
    forked from it, so nothing secret may be in it."""
    env = {k: v for k, v in service_env.items() if k in WORKER_ENV_KEEP}
    env.setdefault("PATH", CHILD_ENV_FIXED["PATH"])
    return {**env, **extra}


def _python_paths() -> list[str]:
    """The interpreter's standard library and the site-packages of its (virtual) environment,
    not ``sys.path`` as such: that may hold the current directory (a checkout, with ``-m``) or
    an editable project's source, which are exactly what a call must not read."""
    found: set[str] = set()
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars) if scheme_vars else sysconfig.get_paths()
        found.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    with contextlib.suppress(AttributeError):
        found.update(site.getsitepackages())
    libdir = sysconfig.get_config_var("LIBDIR")  # libpython, where the interpreter is shared
    if isinstance(libdir, str):
        found.add(libdir)
    lib_dynload = os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload")
    found.add(lib_dynload)
    return sorted(found)


def minimal(paths: list[str]) -> list[str]:
    """Drop paths beneath another path of the list (pure; unit-tested)."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths}):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def readonly_paths() -> list[str]:
    """Everything a call may read besides its scratch space and the device files (real paths,
    existing, none beneath another)."""
    real = [os.path.realpath(p) for p in (*_python_paths(), *SYSTEM_PATHS)]
    return minimal([p for p in real if os.path.exists(p)])


def service_paths() -> list[str]:
    """kuberl's own package directories (the service's code and its configuration defaults).

    Installed from a wheel they lie inside site-packages, which calls may read: they are cut
    out of the view (an empty mount in a private root, no file rights under Landlock)."""
    dirs = {
        os.path.dirname(os.path.realpath(mod.__file__))
        for name, mod in list(sys.modules.items())
        if (name == "kuberl" or name.startswith("kuberl.")) and getattr(mod, "__file__", None)
    }
    return minimal(sorted(dirs))


def hidden_beneath(readable: list[str], hidden: list[str]) -> list[str]:
    """The hidden paths that lie strictly inside a readable path (pure; unit-tested)."""
    return [h for h in hidden if any(h.startswith(r.rstrip("/") + "/") for r in readable)]


def read_rules(
    readable: list[str], hidden: list[str], listdir: Callable[[str], list[str]] = os.listdir
) -> tuple[list[str], list[str]]:
    """Landlock read rules for ``readable`` minus ``hidden``: (paths readable whole, directories
    that may only be listed). An allowlist cannot subtract, so a readable directory holding a
    hidden one becomes list-only and each of its other entries readable whole, level by level
    down to the hidden one (pure but for ``listdir``; unit-tested)."""
    whole: list[str] = []
    list_only: list[str] = []
    for top in readable:
        inside = [h for h in hidden if h.startswith(top.rstrip("/") + "/")]
        if not inside:
            whole.append(top)
            continue
        stack = [top]
        while stack:
            cur = stack.pop()
            list_only.append(cur)
            for name in sorted(listdir(cur)):
                path = os.path.join(cur, name)
                if path in inside:
                    continue
                if any(h.startswith(path + "/") for h in inside):
                    stack.append(path)
                else:
                    whole.append(path)
    return whole, list_only


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    if LIBC.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


class PrivateRoot:
    """The read-only root calls ``chroot`` into (``full`` isolation; built by the worker, pid 1
    of its own mount, PID and IPC namespaces, before it forks any call).

    ``root/tmp`` is the call's scratch space: :meth:`fresh_tmp` mounts a new tmpfs there before
    a call (size = the disk quota, inodes bounded, owned by the slot uid) and detaches the last
    one, which drops whatever the previous call left in one step. :meth:`recycle_tmp` keeps a
    tmpfs that the last call left exactly as it was mounted (most calls never touch it): the
    detach waits for an RCU grace period (~0.5 ms, up to 5 ms, of every call's turnaround).
    """

    def __init__(self, base: str, disk_mb: int, uid: int | None, scratch: str = "/tmp") -> None:
        self.root = base
        self.scratch = scratch  # where the call finds its scratch space (its HOME and TMPDIR)
        self.tmp = base + scratch
        self.disk_mb = disk_mb
        self.uid = uid
        self.inodes = max(4096, disk_mb * 1024)  # ~1 KiB of kernel memory each, charged to the call
        self.mounted = False
        self._as_mounted: tuple[object, ...] | None = None  # _tmp_state() of the fresh tmpfs

    @classmethod
    def build(cls, base: str, disk_mb: int, uid: int | None) -> PrivateRoot:
        """Raises OSError where mounts are not allowed (the worker then falls back to Landlock)."""
        paths = readonly_paths()
        # an interpreter or packages under /tmp (a venv made there) are bound into root/tmp,
        # which a call's tmpfs would hide: the scratch space moves out of their way
        under_tmp = any(p == "/tmp" or p.startswith("/tmp/") for p in paths)
        self = cls(base, disk_mb, uid, scratch="/scratch" if under_tmp else "/tmp")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
        _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755")
        try:
            self._populate(paths)
        except OSError:
            with contextlib.suppress(OSError):  # what we built lives on that tmpfs: gone with it
                _umount(base)
            raise
        return self

    def _populate(self, paths: list[str]) -> None:
        base = self.root
        for src in paths:
            self._bind_readonly(src)
        for hidden in hidden_beneath(paths, service_paths()):  # the service's own code
            _mount("tmpfs", base + hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
        os.makedirs(os.path.join(base, "dev"), mode=0o755)
        for dev in DEVICES:
            if os.path.exists(dev) and stat.S_ISCHR(os.stat(dev).st_mode):
                target = base + dev
                open(target, "w").close()  # noqa: SIM115 - a mount point
                _mount(dev, target, None, MS_BIND)
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
        os.symlink(self.scratch, os.path.join(base, "dev", "shm"))  # POSIX semaphores and shared memory
        os.symlink("/proc/self/fd", os.path.join(base, "dev", "fd"))
        os.makedirs(os.path.join(base, "proc"))
        _mount(
            "proc", os.path.join(base, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible"
        )
        os.makedirs(self.tmp)
        _mount(None, base, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        self.fresh_tmp()

    def _bind_readonly(self, src: str) -> None:
        target = self.root + src
        if os.path.isdir(src):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            open(target, "w").close()  # noqa: SIM115 - a mount point
        _mount(src, target, None, MS_BIND)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)

    def fresh_tmp(self) -> None:
        """Detach the last call's scratch space (whatever it holds) and mount an empty one."""
        if self.mounted:
            _umount(self.tmp)
            self.mounted = False
        owner = self.uid if self.uid is not None else 0
        opts = f"size={self.disk_mb}m,nr_inodes={self.inodes},mode=0700,uid={owner},gid={owner}"
        _mount("tmpfs", self.tmp, "tmpfs", MS_NOSUID | MS_NODEV, opts)
        self.mounted = True
        self._as_mounted = self._tmp_state()

    def _tmp_state(self) -> tuple[object, ...]:
        """All a call can change of an empty tmpfs without an entry in it: the root directory's
        owner, mode, links, size, timestamps and extended attributes, the blocks and inodes in
        use (every file, directory, link, socket, FIFO or POSIX shm object takes an inode)."""
        st = os.lstat(self.tmp)
        vfs = os.statvfs(self.tmp)
        fields = (st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size)
        times = (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)
        return (*fields, *times, vfs.f_bfree, vfs.f_ffree, tuple(os.listxattr(self.tmp)))

    def recycle_tmp(self) -> None:
        """After a call (all its processes dead): a fresh tmpfs, unless it left the one it had
        exactly as mounted. Anything a call creates, even deletes again a moment later, changes
        the directory's times or the counts; it cannot set ctime back. A call that changed
        nothing leaves the next nothing to find, and saves the next call the detach."""
        if self.mounted and self._tmp_state() == self._as_mounted:
            return
        self.fresh_tmp()

    def tmp_usage(self) -> tuple[int, bool]:
        """(bytes the call's files hold, whether it ran out of space or inodes)."""
        st = os.statvfs(self.tmp)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return used, st.f_bavail * st.f_frsize < 64 * 1024 or st.f_favail == 0

    def enter(self) -> None:
        """In the call's child (as root, before dropping privileges): this root becomes ``/``."""
        os.chroot(self.root)
        os.chdir(self.scratch)


def clear_dir(path: str, budget_s: float) -> bool:
    """Remove everything beneath ``path`` (kept itself) within ``budget_s`` seconds.

    Works for any tree a call can leave: any depth (descends by file descriptor, never by path,
    so PATH_MAX does not apply, and keeps no recursion), directories without permissions
    (restored on the way down), symlinks (removed, never followed), FIFOs (unlinked, never
    opened), any name. Returns False when the budget ran out first (the caller moves the rest
    aside). The call's processes are all dead by then, so nothing changes the tree meanwhile.
    """
    deadline = time.monotonic() + budget_s
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    os.chmod(path, 0o700)  # a call running as our uid may have locked its own directory
    fd = os.open(path, flags)
    names: list[str] = []  # the directories we are inside of, below ``path``
    try:
        while True:
            if time.monotonic() > deadline:
                return False
            with os.scandir(fd) as it:
                entries = [next(it, None) for _ in range(256)]
            entries = [e for e in entries if e is not None]
            if not entries:
                if not names:
                    return True
                parent = os.open("..", flags & ~os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(names.pop(), dir_fd=fd)
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.chmod(entry.name, 0o700, dir_fd=fd)
                    child = os.open(entry.name, flags, dir_fd=fd)
                    os.close(fd)
                    fd = child
                    names.append(entry.name)
                    break
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)


_env_for: list[str | None] = [None]  # the call directory os.environ was last set up for


def use_call_environment(call_dir: str) -> None:
    """Make this process's environment the call's: nothing of the service's (the worker started
    with an allowlist), only the call's own HOME and TMPDIR on top of fixed values.

    The zygote does this once per slot directory, so its children inherit the environment
    instead of rebuilding it (and copying the pages that touches) per call."""
    os.environ.clear()
    os.environ.update(child_env(call_dir, call_dir))
    tempfile.tempdir = None  # the worker's cached choice (/tmp) is not the call's
    _env_for[0] = call_dir


def environment_for() -> str | None:
    """The call directory this process's environment was last made for (None: the service's)."""
    return _env_for[0]
