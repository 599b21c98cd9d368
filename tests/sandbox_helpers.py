"""Helpers shared by the sandbox tests: one call, a liveness check, a memory probe; /readyz and
the non-root wrapper are the bench's (bench/sandbox_service.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

from kuberl.sandbox.service.client import SandboxClient
from kuberl.sandbox.types import ExecResult


async def _exec(url: str, code: str, stdin: str = "") -> ExecResult:
    async with SandboxClient(url) as c:
        return await c.execute(code, stdin)


def exec_code(url: str, code: str, stdin: str = "") -> ExecResult:
    return asyncio.run(_exec(url, code, stdin))


def alive(url: str) -> None:
    r = exec_code(url, "print('alive')")
    assert (r.outcome, r.output) == ("stdout", "alive\n"), r


def memory_probe(reversed_needles: list[str]) -> str:
    """Code for a call that counts each needle's bytes in its own memory and prints
    ``{"counts": [...], "how": ...}``: every writable or anonymous mapping of
    ``/proc/self/maps`` ("maps"), or where the call cannot read ``/proc`` (Landlock, basic
    isolation) the whole malloc heap, from ``sbrk(0) - mallinfo2().arena`` up to the break
    ("heap"). The needles are given and travel reversed, so the probe's code holds none of
    them: each is found as the probe's own two copies (its str and its bytes), more only if it
    was in the memory the call started with. A needle that exists nowhere but in the probe (the
    caller never reverses it) is the control."""
    rev = list(reversed_needles)
    return (
        "import ctypes, json, mmap\n"
        f"strs = [r[::-1] for r in {rev!r}]\n"
        "keys = [s.encode() for s in strs]\n"
        "counts = [0] * len(keys)\n"
        "CH, OV = 1 << 22, max(map(len, keys)) - 1\n"
        "SKIP = ('[vvar]', '[vvar_vclock]', '[vsyscall]', '[vdso]')\n"
        "try:\n"
        "    regions, how = [], 'maps'\n"
        "    for line in open('/proc/self/maps').read().splitlines():\n"
        "        f = line.split()\n"
        "        lo, hi = (int(x, 16) for x in f[0].split('-'))\n"
        "        name = f[5] if len(f) > 5 else ''\n"
        "        if f[1][0] == 'r' and name not in SKIP and ('w' in f[1] or not name or name[0] == '['):\n"
        "            regions.append((lo, hi))\n"
        "except OSError:\n"
        "    names = ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')\n"
        "    class MI(ctypes.Structure):\n"
        "        _fields_ = [(n, ctypes.c_size_t) for n in names]\n"
        "    libc = ctypes.CDLL(None)\n"
        "    libc.mallinfo2.restype, libc.sbrk.restype = MI, ctypes.c_void_p\n"
        "    top = libc.sbrk(0)\n"
        "    regions, how = [(top - libc.mallinfo2().arena, top)], 'heap'\n"
        # a mapping of its own, made after the list was taken: no copy made while scanning lands
        # in memory that is scanned later
        "buf = mmap.mmap(-1, CH + OV)\n"
        "dst = ctypes.addressof(ctypes.c_char.from_buffer(buf))\n"
        "for lo, hi in regions:\n"
        "    for at in range(lo, hi, CH):\n"
        "        n = min(CH + OV, hi - at)\n"
        "        ctypes.memmove(dst, at, n)\n"
        "        for i, k in enumerate(keys):\n"
        "            pos, end = 0, min(n, CH + len(k) - 1)\n"  # occurrences starting in this chunk
        "            while (pos := buf.find(k, pos, end)) >= 0:\n"
        "                counts[i] += 1\n"
        "                pos += 1\n"
        "print(json.dumps({'counts': counts, 'how': how}))\n"
    )


class Served(NamedTuple):
    """A running sandbox service (the svc fixture): its isolation mode, URL and log file."""

    mode: str
    url: str
    log: Path | None
