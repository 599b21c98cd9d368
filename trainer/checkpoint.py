"""Checkpoint and resume to a local folder or ``s3://bucket/prefix`` (boto3).

A checkpoint is one ``torch.save`` blob ``ckpt-<global step, 8 digits>.pt`` holding the model,
the optimizer, the RNG states of python/numpy/torch, the trainer position (stage index, step in
stage, global step, data cursor), the tokenizer (as its JSON) and free-form ``extra`` state.
Only the newest ``keep`` are kept. S3 uses the endpoint in ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) when set, so MinIO/moto work the same as AWS.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuberl.trainer.distributed import DistContext

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class TrainState:
    """Where the run is; everything needed to continue exactly where it stopped."""

    stage_index: int = 0
    stage_step: int = 0  # steps completed in the current stage
    global_step: int = 0
    cursor: int = 0  # next training example / prompt index
    extra: dict[str, Any] = field(default_factory=dict)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested payload: a lower bound on its checkpoint's size."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class CheckpointSpaceError(OSError):
    """A checkpoint did not fit on its disk; the message says how much it needs and where."""


def _write_blob(payload: dict[str, Any], path: Path, name: str) -> None:
    """``torch.save`` to ``path``, or a clear error that names the folder and the space missing.

    A full disk surfaces from torch's zip writer as ``unexpected pos N vs M``, which says nothing
    about disks. The space is checked first (the tensors' bytes are a lower bound), and a failed
    write removes its partial file, so the checkpoints already there are untouched.
    """
    need = tensor_bytes(payload)
    folder = path.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CheckpointSpaceError(_space_message(name, folder, need, free))
    try:
        torch.save(payload, path)
    except (OSError, RuntimeError) as err:
        path.unlink(missing_ok=True)
        free = shutil.disk_usage(folder).free
        if free < need or "unexpected pos" in str(err) or getattr(err, "errno", None) == errno.ENOSPC:
            raise CheckpointSpaceError(_space_message(name, folder, need, free, err)) from err
        raise


def _space_message(name: str, folder: Path, need: int, free: int, err: BaseException | None = None) -> str:
    gib = 1024**3
    what = f"stopped short ({err}); the disk is likely full" if err else "does not fit"
    return (
        f"checkpoint {name} {what}: it needs at least {need / gib:.2f} GiB in {folder} and "
        f"{free / gib:.2f} GiB is free there. Free space on that disk, lower spec.checkpoint.keep, "
        "or point spec.checkpoint.uri at a larger volume (the checkpoints already written are untouched)"
    )


class CheckpointStore:
    """Save/list/load/prune checkpoints under a local path or an s3:// URI."""

    def __init__(self, uri: str, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.uri = uri.rstrip("/")
        self.keep = keep
        if self.uri.startswith("s3://"):
            rest = self.uri[len("s3://") :]
            self.bucket, _, self.prefix = rest.partition("/")
            if not self.bucket:
                raise ValueError(f"checkpoint uri {uri!r}: missing bucket")
            import boto3

            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            self._s3 = boto3.client("s3", endpoint_url=endpoint)
        else:
            self._s3 = None
            Path(self.uri).mkdir(parents=True, exist_ok=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _location(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def names(self) -> list[str]:
        """Checkpoint names, oldest first."""
        if self._s3 is None:
            found = [p.name for p in Path(self.uri).iterdir() if _NAME.match(p.name)]
        else:
            found = []
            paginator = self._s3.get_paginator("list_objects_v2")
            prefix = self._key("")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if _NAME.match(name):
                        found.append(name)
        return sorted(found)

    def save(self, payload: dict[str, Any], step: int) -> str:
        """Write one checkpoint, prune old ones; returns its location.

        The blob goes through a temporary file, never a bytes copy in memory: a policy's
        checkpoint can be larger than RAM headroom, and S3 takes it as a multipart upload
        (``upload_file``; a single PUT stops at 5 GB).
        """
        name = f"ckpt-{step:08d}.pt"
        if self._s3 is None:
            tmp = Path(self.uri) / f".{name}.tmp"
            _write_blob(payload, tmp, name)
            tmp.replace(Path(self.uri) / name)  # atomic: a crash never leaves a torn checkpoint
        else:
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                _write_blob(payload, Path(f.name), name)
                # S3 objects appear whole or not at all, so no rename is needed.
                self._s3.upload_file(f.name, self.bucket, self._key(name))
        for old in self.names()[: -self.keep]:
            self.delete(old)
        return self._location(name)

    def put_file(self, path: str | Path, name: str) -> str:
        """Copy a run file (e.g. events.jsonl) next to the checkpoints; returns its location.

        A trainer pod's run folder is an emptyDir that goes with the pod; the checkpoint store
        outlives it, so what Grafana annotations are made from is kept there too.
        """
        if self._s3 is None:
            tmp = Path(self.uri) / f".{name}.tmp"
            tmp.write_bytes(Path(path).read_bytes())
            tmp.replace(Path(self.uri) / name)
        else:
            self._s3.upload_file(str(path), self.bucket, self._key(name))
        return self._location(name)

    def get_file(self, name: str, dest: str | Path) -> bool:
        """Copy a file kept by :meth:`put_file` to ``dest``; False when there is none."""
        if self._s3 is None:
            src = Path(self.uri) / name
            if not src.is_file():
                return False
            Path(dest).write_bytes(src.read_bytes())
            return True
        from botocore.exceptions import ClientError

        try:
            self._s3.download_file(self.bucket, self._key(name), str(dest))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        if self._s3 is None:
            (Path(self.uri) / name).unlink(missing_ok=True)
        else:
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    def load(self, name: str | None = None) -> dict[str, Any] | None:
        """The named (default: newest) checkpoint, or None when there is none."""
        names = self.names()
        if name is None:
            if not names:
                return None
            name = names[-1]
        elif name not in names:
            raise FileNotFoundError(f"no checkpoint {name!r} in {self.uri}")
        if self._s3 is None:
            return torch.load(Path(self.uri) / name, map_location="cpu", weights_only=False)
        with tempfile.NamedTemporaryFile(suffix=".pt") as f:
            self._s3.download_fileobj(self.bucket, self._key(name), f)
            f.flush()
            return torch.load(f.name, map_location="cpu", weights_only=False)


def make_payload(
    model, optimizer, state: TrainState, tokenizer_json: str, config: dict, ctx: DistContext | None = None
) -> dict[str, Any] | None:
    """The checkpoint of the run at ``state`` (None on FSDP ranks other than 0).

    Model and optimizer are stored unsharded, the optimizer state keyed by parameter name
    (``torch.distributed.checkpoint.state_dict``), so a checkpoint written by any number of
    FSDP ranks resumes on any other number, one process included. With FSDP every rank must
    call this (it gathers the shards). An optimizer that has not stepped yet is stored as None:
    the gather would otherwise create its state by stepping it with zero gradients, which
    advances Adam's step count.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    ctx = ctx or DistContext()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer.state else None
    if not ctx.is_main:
        return None
    return {
        "model": model_sd,
        "optimizer": optim_sd,
        "optimizer_format": "by-name",
        "rng": capture_rng(),
        "state": {
            "stage_index": state.stage_index,
            "stage_step": state.stage_step,
            "global_step": state.global_step,
            "cursor": state.cursor,
            "extra": state.extra,
        },
        "tokenizer": tokenizer_json,
        "model_config": config,
    }


def apply_payload(
    payload: dict[str, Any] | None, model, optimizer, ctx: DistContext | None = None
) -> tuple[TrainState, bool]:
    """Load model/optimizer/RNG from ``payload``; returns (the trainer position, whether the
    optimizer state it holds was restored).

    With FSDP every rank calls this; only rank 0 needs the payload (the others pass None and
    receive the tensors from it). A checkpoint of the older by-index optimizer layout restores
    its optimizer in a single process only; elsewhere the optimizer starts fresh.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ctx = ctx or DistContext()
    meta = ctx.broadcast(
        {
            "rng": payload["rng"],
            "state": payload["state"],
            "optimizer": payload["optimizer"] is not None,
            "format": payload.get("optimizer_format", "by-index"),
        }
        if ctx.is_main and payload
        else None
    )
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.enabled)
    set_model_state_dict(model, payload["model"] if ctx.is_main else {}, options=opts)
    restored = meta["optimizer"] and (meta["format"] == "by-name" or not ctx.enabled)
    if restored and meta["format"] == "by-name":
        set_optimizer_state_dict(model, optimizer, payload["optimizer"] if ctx.is_main else {}, options=opts)
        for group in optimizer.param_groups:  # the gather hands tuples back as lists
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])
    elif restored:
        optimizer.load_state_dict(payload["optimizer"])
    restore_rng(meta["rng"])
    s = meta["state"]
    state = TrainState(s["stage_index"], s["stage_step"], s["global_step"], s["cursor"], dict(s["extra"]))
    return state, restored or not meta["optimizer"]
