"""Small kernel files (/proc, cgroupfs) read and written with raw syscalls.

The worker reads and writes a few of them after every call (the slot's cgroup members, its
memory failure count, its own children). Python's ``open()`` costs seven syscalls per file
(open, fstat, an isatty ioctl, lseek, reads, close) and the io stack's objects around them;
``os.open`` and ``os.read`` cost three or four and none of those objects. In a call's child
(before the code runs) the objects matter more than the syscalls: each page of the inherited
heap they touch is copied for it.
"""

from __future__ import annotations

import os

_CHUNK = 65536


def read_bytes(path: str) -> bytes:
    """The whole file (raises OSError like ``open``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_text(path: str, value: str) -> None:
    """``open(path, "w").write(value)``: the same flags (created, truncated), one ``write`` for
    a small value (cgroupfs takes one value per write); OSError as ``open``/``write`` raise it,
    e.g. EINVAL for a value the kernel refuses."""
    data = value.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
