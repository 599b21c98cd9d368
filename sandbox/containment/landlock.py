"""Landlock: confine what a tool call may read and write, unprivileged.

Without a slot uid (``--isolation basic``, a non-root pod) a call shares the uid of the
server and the other workers: it could read the service's files and the other slots', fill
``/tmp`` around the slot's disk quota, tamper with another slot's files or signal the server.
Landlock (Linux 5.13+) lets any process that set ``no_new_privs`` drop those rights for itself
and its descendants, root included: writes are allowed only beneath the slot directory (and to
``/dev/null``), reads only beneath the interpreter, its packages and the shared libraries
(:func:`kuberl.sandbox.containment.fsview.readonly_paths`) and the slot directory.
From ABI 6 (Linux 6.12) the same domain also scopes signals and abstract unix sockets to
the call's own processes. Where the kernel or the container's seccomp profile lacks
Landlock, :func:`abi_version` is 0 and the worker reports ``landlock: false``.
"""

from __future__ import annotations

import ctypes
import os
import struct

from kuberl.sandbox.libc import LIBC

_SYS_CREATE_RULESET = 444  # the same number on every architecture (added after the unification)
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# LANDLOCK_ACCESS_FS_* (uapi/linux/landlock.h)
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6

_WRITES_V1 = (
    WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
    | MAKE_BLOCK | MAKE_SYM
)  # fmt: skip
_READS = EXECUTE | READ_FILE | READ_DIR
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # the subset that applies to a non-directory


def abi_version() -> int:
    """The kernel's Landlock ABI, 0 where Landlock is missing, disabled or filtered out."""
    version = LIBC.syscall(
        _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    return max(0, int(version))


def handled_rights(abi: int, reads: bool = False) -> tuple[int, int]:
    """(filesystem rights, scopes) a ruleset of this ABI restricts (pure; unit-tested).

    ``reads``: reading and listing are restricted too (then only the readable paths given to
    :meth:`Ruleset.build` can be read)."""
    if abi < 1:
        return 0, 0
    fs = _WRITES_V1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | (_READS if reads else 0)
    scoped = SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET if abi >= 6 else 0
    return fs, scoped


class Ruleset:
    """A ruleset allowing writes only beneath some directories and to some files, and, where
    readable paths are given, reads only beneath those and the writable ones.

    Built once (by the worker, per slot) and enforced by each call's child with one
    ``landlock_restrict_self``: building it in every child cost ~0.6 ms of a ~4 ms call (the
    syscalls are cheap; the ctypes set-up and the pages it touches after ``fork`` are not).
    The ruleset's file descriptor is inherited by the forked child, which must keep it open
    until :meth:`restrict_self` (see ``worker._close_fds``).
    """

    def __init__(self, fd: int, syscall: ctypes._CFuncPtr) -> None:
        self.fd = fd
        self._syscall = syscall
        self._fd_arg, self._flags_arg = ctypes.c_int(fd), ctypes.c_uint32(0)

    @classmethod
    def build(
        cls,
        writable_dirs: list[str],
        writable_files: list[str],
        abi: int,
        readable: list[str] | None = None,
        list_only: list[str] = (),
    ) -> Ruleset:
        """Raises OSError where Landlock is missing or a writable path cannot be opened
        (readable paths that do not exist are skipped: not every system has /lib64).
        ``list_only``: directories whose entries may be listed, not read (only with ``readable``)."""
        fs, scoped = handled_rights(abi, reads=readable is not None)
        if not fs:
            raise OSError(0, "Landlock is not available")
        syscall = LIBC.syscall
        # struct landlock_ruleset_attr {u64 handled_access_fs; u64 handled_access_net; u64 scoped}:
        # older kernels only know a prefix of it, and reject a size they do not know
        attr = struct.pack("=QQQ", fs, 0, scoped)
        size = 24 if abi >= 6 else 8
        buf = ctypes.create_string_buffer(attr[:size], size)
        ruleset = syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
        if ruleset < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
        try:
            reads = fs & _READS
            rules = [(p, fs, True) for p in writable_dirs] + [
                (p, fs & _FILE_RIGHTS, True) for p in writable_files
            ]
            rules += [(p, reads, False) for p in readable or ()]
            rules += [(p, reads & READ_DIR, False) for p in (list_only if readable is not None else ())]
            for path, rights, required in rules:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    if required:
                        raise
                    continue
                if not os.path.isdir(path):
                    rights &= _FILE_RIGHTS
                try:
                    # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} (packed)
                    rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                    if syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                               ctypes.c_uint32(0)) != 0:  # fmt: skip
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
                finally:
                    os.close(fd)
        except BaseException:
            os.close(ruleset)
            raise
        return cls(ruleset, syscall)

    def restrict_self(self) -> None:
        """Enforce the ruleset on this process and everything it forks. Needs ``no_new_privs``
        (or CAP_SYS_ADMIN). Raises OSError."""
        if self._syscall(_SYS_RESTRICT_SELF, self._fd_arg, self._flags_arg) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
