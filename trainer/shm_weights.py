"""Raw weights folders in shared memory for vLLM servers on the trainer's host (``kuberl run``).

The format and the server's side are :mod:`kuberl.rollout.vllm_shm`. Two folders (slots) are
rewritten in turn: a version goes into the slot not holding the last one, so the version an
engine that joins (or restarts) is sent stays whole while the next is written. Each slot's data
file is mapped once and kept: a version is a plain copy into pages already there, where a new
file in tmpfs costs a page fault per 4 KiB, several times the copy itself (bench/README.md,
weight push).

Pushes are serialized (one waits for the last), so a slot is never rewritten while an engine
still loads it; a server that reads a slot after it was rewritten is refused by the manifest's
version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from kuberl.rollout.vllm_shm import DATA, FORMAT, MANIFEST, layout

SHM = Path("/dev/shm")
PREFIX = "kuberl-weights-"
HEADROOM = 1.05  # room beyond two slots' bytes that /dev/shm must have


def owner_id(pid: int) -> str | None:
    """``pid`` with its start time (clock ticks after boot), as a slot root's name ends: a pid the
    kernel reuses for another process has another start time. None where no such process runs;
    the bare pid where /proc is not there to read."""
    if not Path("/proc/self/stat").exists():
        return str(pid) if _pid_alive(pid) else None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}.{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, starttime


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(base: Path = SHM) -> list[Path]:
    """Remove slot roots left by runs whose process is gone (a killed run cannot clean up, and
    shared memory is RAM); returns what was removed."""
    gone = []
    for root in base.glob(f"{PREFIX}*") if base.is_dir() else ():
        owner = root.name.rsplit("-", 1)[-1]
        pid = owner.split(".", 1)[0]
        if not (root.is_dir() and pid.isdigit()):
            continue
        if (owner_id(int(pid)) != owner) if "." in owner else not _pid_alive(int(pid)):
            shutil.rmtree(root, ignore_errors=True)
            gone.append(root)
    return gone


def shm_root(name: str, nbytes: int, base: Path = SHM) -> Path | None:
    """Where this process keeps its slots for ``nbytes`` of weights: under ``base``
    (``/dev/shm``) when it has room for two of them, else None (the caller writes checkpoint
    folders instead; a container's /dev/shm is often 64 MiB)."""
    remove_orphans(base)
    if not base.is_dir() or not os.access(base, os.W_OK):
        return None
    if shutil.disk_usage(base).free < 2 * nbytes * HEADROOM:
        return None
    return base / f"{PREFIX}{name}-{os.getuid()}-{owner_id(os.getpid())}"


class SharedMemorySlots:
    """Two raw weights folders under ``root``, written in turn by :meth:`publish`."""

    def __init__(self, root: str | Path, slots: int = 2):
        if slots < 2:
            raise ValueError(f"shared-memory weights need at least two slots, got {slots}")
        self.root = Path(root)
        self.slots = [self.root / f"slot{i}" for i in range(slots)]
        self._maps: dict[int, torch.Tensor] = {}
        self._last: int | None = None  # the slot holding the newest version

    @property
    def current(self) -> str | None:
        """The folder of the newest version (None before the first and after :meth:`close`)."""
        return None if self._last is None else str(self.slots[self._last])

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, config_from: Path | None = None
    ) -> str:
        """Write ``tensors`` as version ``version`` into the next slot; returns its path.
        ``config_from``: a model folder whose config.json goes beside them (engines read it to
        warn about tied embeddings)."""
        index = 0 if self._last is None else (self._last + 1) % len(self.slots)
        folder = self.slots[index]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # no reader takes the slot while it changes
        entries, size = layout(tensors)
        data = self._mapping(index, size)
        raw = data.numpy()
        for entry, t in zip(entries, tensors.values(), strict=True):
            n = t.numel() * t.element_size()
            start = entry["offset"]
            # one thread's memcpy: torch's copy_ splits a large copy over OpenMP threads, which
            # stall (seen: 1 s for 651 MB against 0.13 s) beside a vLLM server's busy threads
            np.copyto(raw[start : start + n], t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if config_from is not None and (Path(config_from) / "config.json").is_file():
            shutil.copyfile(Path(config_from) / "config.json", folder / "config.json")
        doc = {"format": FORMAT, "version": version, "bytes": size, "tensors": entries}
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(folder / MANIFEST)
        self._last = index
        return str(folder)

    def _mapping(self, index: int, size: int) -> torch.Tensor:
        """Slot ``index``'s data file mapped shared, ``size`` bytes (made again when it changes)."""
        mapped = self._maps.get(index)
        if mapped is not None and mapped.numel() == size:
            return mapped
        path = self.slots[index] / DATA
        self._maps.pop(index, None)
        path.unlink(missing_ok=True)
        mapped = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)[:size]
        self._maps[index] = mapped
        return mapped

    def close(self) -> None:
        """Unmap and remove every slot (the memory goes back to the host)."""
        self._maps.clear()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.root)
        self._last = None
