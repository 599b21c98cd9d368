"""The seccomp filter every tool call runs under, compiled once per worker.

What it refuses and why: programs (execve), calls aimed at another process by pid (prlimit,
scheduling, priorities, page migration: only the caller's own), every socket family but AF_UNIX
(and without a private root, sockets at all: host sockets would be reachable by path) (calls have no network, and vsock,
netlink, packet or AF_ALG sockets reach the host or the kernel without one), the calls that reach the
kernel's global state or other processes (ptrace, mounts, namespaces, modules, keyrings, BPF,
perf, io_uring, userfaultfd, the kernel log, clocks), new namespaces of any kind (``unshare``,
``setns``, ``clone`` with a ``CLONE_NEW*`` flag; ``clone3``, whose flags a filter cannot read,
answers ENOSYS so that libc falls back to ``clone``), and System V IPC and POSIX message
queues: those objects live in the kernel, not in a process, and would outlive the call that
made them. Also refused: ``setsid`` (a session per process is a CPU share per process under
the scheduler's autogroups), inode flags (``chattr``), ``memfd_secret``, and ``memfd_create``
where no memory cgroup counts its pages. Signals are refused where they are aimed at the
service (see :class:`SeccompProgram`).
Everything else is allowed: ordinary Python (threads, fork, files, pipes, mmap) works unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import tempfile

from kuberl.sandbox.libc import LIBC

_PRCTL = LIBC.prctl  # looked up in the worker, used by every forked child
PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
DENY = (
    "ptrace", "mount", "umount2", "unshare", "setns", "reboot", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "swapon", "swapoff", "pivot_root", "chroot",
    "bpf", "perf_event_open", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
    "request_key",
    # a pidfd for any pid can also come from open("/proc/PID"): no signals through pidfds at all
    "pidfd_send_signal",
    # the new mount API, handle-based opens (a classic container escape), the kernel log
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "open_by_handle_at", "name_to_handle_at", "syslog", "quotactl", "acct", "uselib",
    "lookup_dcookie", "vhangup", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    # large kernel attack surface no Python tool call needs
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
    # kernel objects that outlive their creator: SysV IPC and POSIX message queues
    "shmget", "semget", "msgget", "mq_open",
    # memory no cgroup or rlimit sees the way it sees the rest (secret memory is unmapped from
    # the kernel's own map, and only RLIMIT_MEMLOCK bounds it)
    "memfd_secret",
    # a session (and so a scheduler autogroup) per process: a call's processes each get a fair
    # CPU share of their own and starve a concurrent call; the child made its session already
    "setsid",
    # no programs: the interpreter is already running, and nothing else is needed
    "execve", "execveat",
)  # fmt: skip
# calls that act on another process named by pid in argument 0 (0 = the caller): a call under
# the service's uid could otherwise lower the server's open-file limit, pin or deprioritise it
SELF_ONLY = (
    "prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
    "migrate_pages", "move_pages",
)  # fmt: skip
_PR_SET_DUMPABLE = 4  # the worker reads a basic-mode call's /proc/PID/fd (its unlinked files)
# clone flags that create a namespace (uapi/linux/sched.h)
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# syscalls that signal a pid given in argument N (tgkill checks that its tid belongs to tgid)
SIGNAL_PID_ARGS = {
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
# inode flags and project attributes (chattr): on a directory the call does not own for good
# (basic isolation's slot directory) they outlive it (+S, +D, +A slow or change every later call)
_FS_IOC_SETFLAGS, _FS_IOC32_SETFLAGS, _FS_IOC_FSSETXATTR = 0x40086602, 0x40046602, 0x401C5820
_PID_MASK = 0xFFFFFFFF  # pid_t is 32 bits: compare only what the kernel reads of the register


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


class SeccompProgram:
    """The call filter, compiled to classic BPF once per worker.

    libseccomp needs ~10 ms to build and compile the filter, as much as the rest of a call, so
    the worker compiles it at start and each child only hands the ready program to the kernel
    (two prctl calls). Denies what the module docstring lists with EPERM (``clone3``: ENOSYS).

    Without a slot uid (basic isolation) a call may signal every process of its uid, the server
    and the workers included; the filter therefore also refuses kill/tkill/tgkill/
    rt_(tg)sigqueueinfo/pidfd_open aimed at a protected pid (the worker, the server and its
    threads, the other workers, pid 1) or at a negative pid (a process group, or -1: everyone),
    any pidfd_send_signal, and the fcntl/ioctl commands that route SIGIO to another process.
    """

    def __init__(self, bpf: bytes) -> None:
        self.bpf = bpf
        self._prog = _SockFprog(len(bpf) // 8, bpf)

    @classmethod
    def compile(
        cls, protected: frozenset[int] = frozenset(), unix_sockets: bool = True, memfd: bool = True
    ) -> SeccompProgram | None:
        """None where libseccomp/pyseccomp is unavailable (the worker degrades and reports it).

        ``memfd``: allow memfd_create, whose pages only a memory cgroup counts (RLIMIT_AS counts
        what is mapped, and a memfd can be closed after a one-page mapping); without a memory
        cgroup (basic isolation) gigabytes would escape the call's limit.

        Arguments the kernel reads as 32-bit (fcntl's command, prctl's option, ioctl's request,
        pids) are compared on their low 32 bits only: a call passing the same value with junk
        in the upper half must meet the same rule."""
        try:
            import pyseccomp as sc
        except Exception:  # noqa: BLE001 - libseccomp missing
            return None
        import socket

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        deny = sc.ERRNO(errno.EPERM)
        # unix sockets only: no IP, and none of the families that reach the kernel or the host
        # without IP (netlink, packet, vsock to a VM's host, AF_ALG crypto, bluetooth, ...)
        for name in ("socket", "socketpair"):
            f.add_rule(deny, name, sc.Arg(0, sc.NE, socket.AF_UNIX))
        if not unix_sockets:  # host sockets are reachable by path (no private root): pairs only
            f.add_rule(deny, "socket")
        for name in SELF_ONLY:
            with contextlib.suppress(Exception):
                f.add_rule(deny, name, sc.Arg(0, sc.NE, 0))
        # (which, who): only the caller itself (PRIO_PROCESS = 0, IOPRIO_WHO_PROCESS = 1; who 0)
        for name, own in (("setpriority", 0), ("ioprio_set", 1)):
            with contextlib.suppress(Exception):
                f.add_rule(deny, name, sc.Arg(0, sc.NE, own))
                f.add_rule(deny, name, sc.Arg(1, sc.NE, 0))
        f.add_rule(deny, "prctl", sc.Arg(0, sc.MASKED_EQ, _PID_MASK, _PR_SET_DUMPABLE))
        if not memfd:
            f.add_rule(deny, "memfd_create")
        for name in DENY:
            with contextlib.suppress(Exception):  # a syscall this arch does not have
                f.add_rule(deny, name)
        with contextlib.suppress(Exception):
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for flag in CLONE_NEW_FLAGS:  # clone(flags, ...) on x86_64 and aarch64
            f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        for name, arg in SIGNAL_PID_ARGS.items():
            with contextlib.suppress(Exception):
                f.add_rule(deny, name, sc.Arg(arg, sc.MASKED_EQ, 0x80000000, 0x80000000))  # pid < 0
                for pid in sorted(protected):
                    f.add_rule(deny, name, sc.Arg(arg, sc.MASKED_EQ, _PID_MASK, pid))
        for cmd in (_F_SETOWN, _F_SETSIG, _F_SETOWN_EX):
            f.add_rule(deny, "fcntl", sc.Arg(1, sc.MASKED_EQ, _PID_MASK, cmd))
        for cmd in (_FIOSETOWN, _SIOCSPGRP, _FS_IOC_SETFLAGS, _FS_IOC32_SETFLAGS, _FS_IOC_FSSETXATTR):
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
        if _PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if _PRCTL(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
