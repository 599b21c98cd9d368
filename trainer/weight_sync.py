"""Getting the trainer's new weights into the fleet's engines after every update.

SGLang's documented route for a disaggregated trainer is ``POST /update_weights_from_disk
{"model_path": DIR}``: the server reloads the weights from a directory in Hugging Face layout;
vLLM's is its RL API's in-place ``reload_weights`` with a ``weights_path`` (see
:mod:`kuberl.rollout.vllm_engine`). Either reads the same folder.
The trainer therefore writes each version to a folder both sides mount (the fleet's
``weightSync`` volume, a ReadWriteMany PVC on a cluster), then asks every engine to load it.

A version is written to a hidden temporary folder and renamed into place, so an engine never
sees half a checkpoint; the newest ``keep`` versions stay on disk (an engine that joins while
a push is in flight loads the previous complete one, then the current one).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from kuberl.rollout.fleet import push_weights
from kuberl.trainer.distributed import DistContext, full_state_dict

if TYPE_CHECKING:
    from kuberl.rollout.client import RolloutClient
    from kuberl.trainer.shm_weights import SharedMemorySlots

VERSION_RE = re.compile(r"^v(\d{8})$")


Writer = Callable[[Path], None]  # writes one complete HF model folder at the given path


class WeightTarget(Protocol):
    name: str

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None: ...


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def version_of(path: str | Path) -> int | None:
    """The version a published folder holds (its name ``vNNNNNNNN``), None for other folders."""
    m = VERSION_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def versions(root: str | Path) -> list[int]:
    """Complete versions under ``root``, oldest first."""
    p = Path(root)
    if not p.is_dir():
        return []
    found = [int(m.group(1)) for d in p.iterdir() if d.is_dir() and (m := VERSION_RE.match(d.name))]
    return sorted(found)


def stale_versions(present: Iterable[int], keep: int, current: int | None = None) -> list[int]:
    """The versions to delete so that the newest ``keep`` remain, ``current`` (the one just
    published) the newest of them: folders of later versions are what a run killed after them
    left, and a resumed run replaces them as it gets there."""
    ordered = sorted(present)
    later = [v for v in ordered if current is not None and v > current]
    older = [v for v in ordered if v not in later]
    return older[: max(0, len(older) - keep)] + later


class DiskWeightSync:
    def __init__(self, root: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"weight sync must keep at least one version, got keep={keep}")
        self.root = Path(root)
        self.keep = keep
        self.current: str | None = None

    def publish(self, write: Writer, version: int) -> str:
        """Write version ``version`` with ``write`` (atomically), prune old ones; returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = version_dir(self.root, version)
        tmp = self.root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        if final.exists():  # re-publishing a version after a resume: replace it
            shutil.rmtree(final)
        tmp.rename(final)
        for v in stale_versions(versions(self.root), self.keep, current=version):
            shutil.rmtree(version_dir(self.root, v), ignore_errors=True)
        self.current = str(final)
        return self.current

    async def push(self, engines: Iterable[WeightTarget], path: str | None = None) -> None:
        """Every engine loads ``path`` (default: the last published version); all must succeed."""
        path = path or self.current
        if path is None:
            raise RuntimeError("no weights published yet")
        await push_weights(engines, path, version_of(path))


class LocalWeights:
    """The rollout worker's in-process engine takes the state dict itself (every sync).

    With FSDP every rank calls :meth:`sync` (it gathers the shards); rank 0 hands them over.
    """

    def __init__(self, client: RolloutClient | None, ctx: DistContext | None = None):
        self.client = client
        self.ctx = ctx or DistContext()

    def sync(self, model, version: int) -> None:
        sd = full_state_dict(model, self.ctx)
        if self.client is not None:
            self.client.set_weights(sd, version)


class DiskWeights:
    """Engines behind HTTP load a published folder; a version is published once.

    ``version`` is the trainer's global step: evaluation and the difficulty filter sync too,
    and between two updates there is nothing new to write. With ``slots`` (vLLM servers on this
    host started with the shared-memory backend) a version is a raw weights folder in shared
    memory (:mod:`kuberl.trainer.shm_weights`) rather than a checkpoint folder under ``disk``.
    """

    def __init__(
        self,
        client: RolloutClient | None,
        disk: DiskWeightSync,
        source_dir: str | Path,
        ctx: DistContext | None = None,
        dtype: str = "auto",
        slots: SharedMemorySlots | None = None,
    ):
        self.client = client
        self.disk = disk
        self.slots = slots
        self.source_dir = Path(source_dir)
        self.ctx = ctx or DistContext()
        self.version: int | None = None
        # the engines' --dtype ("auto": the model's own); float32 engines get float32 copies
        self.dtype = None if dtype == "auto" else getattr(torch, dtype)

    def sync(self, model, version: int) -> None:
        push = self.prepare(model, version, copy=False)  # pushed now, before any optimizer step
        if push is not None:
            push()

    def prepare(self, model, version: int, copy: bool = True) -> Callable[[], None] | None:
        """Take version ``version``'s weights now (every rank: the gather is collective) and
        return the push itself, to run later or on another thread: write the folder, engines
        load it (rank 0; None elsewhere and when the version is already out).

        ``copy``: on CPU ``full_state_dict`` hands out the parameters themselves, which the next
        optimizer step changes while a background push would still write them; a push run at
        once (:meth:`sync`) needs no copy.
        """
        if version == self.version:
            return None
        from kuberl.trainer.hf import engine_tensors, write_hf_folder

        sd = full_state_dict(model, self.ctx)
        self.version = version
        if not self.ctx.is_main:
            return None
        if copy:
            sd = {k: v.clone() for k, v in sd.items()}

        def push() -> None:
            if self.slots is not None:
                tensors = engine_tensors(sd, self.source_dir, self.dtype)
                path = self.slots.publish(tensors, version, config_from=self.source_dir)
            else:
                path = self.disk.publish(lambda d: write_hf_folder(sd, self.source_dir, d, self.dtype), version)
            self.client.load_weights(path, version)

        return push
