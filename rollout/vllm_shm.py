"""The shared-memory weight handoff to a vLLM server on the trainer's host: the format and the
vLLM weight-transfer backend that reads it.

vLLM 0.32's RL routes (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``)
hand weights to a registered :class:`WeightTransferEngine`; its built-in backends need CUDA or
NIXL. This one reads a *raw weights folder*, which the trainer writes into shared memory
(``/dev/shm``) by a plain copy into buffers it maps once and reuses, where a checkpoint folder
costs a safetensors write into fresh pages every version:

* ``weights.bin``: every tensor's bytes back to back, each at a multiple of :data:`ALIGN`;
* ``manifest.json``: ``{"format": FORMAT, "version": N, "bytes": size of weights.bin,
  "tensors": [{"name", "dtype", "shape", "offset"}, ...]}``, names and dtypes as the model's
  Hugging Face checkpoint has them. Written last and renamed into place; a writer removes it
  before it overwrites ``weights.bin``, so a folder with a manifest holds one whole version.

The worker maps ``weights.bin`` and feeds the tensors to the model's own ``load_weights``
between vLLM's layer-wise reload start and finish, the same loader ``reload_weights`` runs on a
checkpoint: on CPUs the served linear weights are repacked, so no route can copy into them
directly. ``update_info`` is ``{"path": folder, "version": N}``; a folder whose manifest names
another version (overwritten since) is refused before anything is loaded.

Standard library and torch only at import, and no kuberl import: the module also runs in the
vLLM environment, where ``kuberl vllm install`` (and a server start that asks for the backend)
installs it with a ``vllm.general_plugins`` entry point whose :func:`register` adds the backend
in every vLLM process.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

BACKEND = "kuberl_shm"
"""The name the backend registers under: ``--weight-transfer-config '{"backend": "kuberl_shm"}'``."""
FORMAT = "kuberl-raw-weights/1"
MANIFEST = "manifest.json"
DATA = "weights.bin"
ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class RawWeightsError(ValueError):
    """A raw weights folder that cannot be loaded, saying why."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise RawWeightsError(f"dtype {dtype} cannot be handed over raw (one of {', '.join(DTYPES)})")
    return name


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """The manifest entries of ``tensors`` in order, and the size of the data file they need."""
    entries, offset = [], 0
    for name, t in tensors.items():
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return entries, offset


def is_raw_folder(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | os.PathLike[str], version: int | None = None) -> dict[str, Any]:
    """The folder's manifest, checked against its data file (and ``version`` when given)."""
    where = Path(folder)
    try:
        doc = json.loads((where / MANIFEST).read_text())
    except FileNotFoundError:
        raise RawWeightsError(
            f"{where} has no {MANIFEST}: no complete version is there (being written?)"
        ) from None
    except ValueError as err:
        raise RawWeightsError(f"{where / MANIFEST} is not JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RawWeightsError(f"{where / MANIFEST} is not a {FORMAT} manifest")
    if version is not None and doc.get("version") != version:
        raise RawWeightsError(
            f"{where} holds version {doc.get('version')}, not {version}: it was overwritten by a later push"
        )
    size = (where / DATA).stat().st_size if (where / DATA).is_file() else -1
    if size < int(doc.get("bytes", 0)):
        raise RawWeightsError(f"{where / DATA} has {size} bytes; the manifest says {doc.get('bytes')}")
    for t in doc.get("tensors", []):
        if t.get("dtype") not in DTYPES:
            raise RawWeightsError(
                f"{where / MANIFEST}: tensor {t.get('name')} has unknown dtype {t.get('dtype')}"
            )
    return doc


def iter_weights(
    folder: str | os.PathLike[str], version: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the folder: views of one read-only mapping of its
    data file (nothing is copied here; the model's loader copies what it keeps)."""
    doc = read_manifest(folder, version)
    size = int(doc["bytes"])
    if size == 0:
        return
    data = torch.from_file(str(Path(folder) / DATA), shared=False, size=size, dtype=torch.uint8)
    for t in doc["tensors"]:
        dtype = DTYPES[t["dtype"]]
        shape = [int(d) for d in t["shape"]]
        start = int(t["offset"])
        nbytes = math.prod(shape) * dtype.itemsize
        if start + nbytes > size:
            raise RawWeightsError(f"{folder}: tensor {t['name']} runs past the end of {DATA}")
        yield t["name"], data[start : start + nbytes].view(dtype).view(shape)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the backend to vLLM's registry (once per
    process; vLLM loads general plugins in its API, engine-core and worker processes)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


def _engine_class() -> type:
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    @dataclass
    class SharedMemoryInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
        path: str
        version: int | None = None

    class SharedMemoryWeightTransferEngine(
        WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]
    ):
        """Loads a raw weights folder the worker can read (module docstring)."""

        init_info_cls = SharedMemoryInitInfo
        update_info_cls = SharedMemoryUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
            """Nothing to rendezvous: the folder is named with every update."""

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class synchronizes an accelerator, which a CPU worker lacks
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
            # iter_weights refuses another version before it yields a tensor
            self.model.load_weights(iter_weights(update_info.path, update_info.version))
            # a writer removes the manifest before it overwrites the data: still there, whole
            read_manifest(update_info.path, update_info.version)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    return SharedMemoryWeightTransferEngine
