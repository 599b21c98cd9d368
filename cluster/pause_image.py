"""The pod sandbox ("pause") image, built here: there is no registry to pull it from.

Kubernetes' own ``build/pause/linux/pause.c`` (from the ``k8s.io/kubernetes`` module the node's
programs are built from) is compiled statically with ``gcc`` and wrapped as a one-layer OCI
image archive, tagged ``registry.k8s.io/pause:3.10`` so that containerd's ``sandbox_image``
names the tag a cluster would pull. The archive is cached beside the node's programs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import platform
import shutil
import subprocess
import tarfile
from pathlib import Path

from kuberl.cluster.errors import ClusterError

PAUSE_TAG = "registry.k8s.io/pause:3.10"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def _blob(data: bytes, media_type: str) -> tuple[dict, bytes]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return {"mediaType": media_type, "digest": digest, "size": len(data)}, data


def _layer(binary: Path, name: str) -> tuple[bytes, str]:
    """(gzipped layer, diff id) with ``/NAME``, mode 0755, owned by root."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        data = binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    return gzip.compress(raw.getvalue(), mtime=0), diff_id


def oci_archive(binary: Path, tag: str, out: Path, *, name: str = "pause", user: str = "65535:65535") -> None:
    """A one-layer OCI image archive (what ``ctr images import`` reads) running ``binary`` as
    ``/NAME`` under ``user``, its index entry annotated with ``tag``."""
    layer_bytes, diff_id = _layer(binary, name)
    layer, _ = _blob(layer_bytes, "application/vnd.oci.image.layer.v1.tar+gzip")
    config_doc = {
        "architecture": ARCH, "os": "linux",
        "config": {"Entrypoint": [f"/{name}"], "User": user},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }  # fmt: skip
    config, config_bytes = _blob(json.dumps(config_doc).encode(), "application/vnd.oci.image.config.v1+json")
    manifest_doc = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config, "layers": [layer]}
    manifest, manifest_bytes = _blob(json.dumps(manifest_doc).encode(), MANIFEST_TYPE)
    manifest["platform"] = {"architecture": ARCH, "os": "linux"}
    manifest["annotations"] = {"io.containerd.image.name": tag, "org.opencontainers.image.ref.name": tag}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest]}
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
    }
    for desc, data in ((layer, layer_bytes), (config, config_bytes), (manifest, manifest_bytes)):
        files["blobs/sha256/" + desc["digest"].split(":")[1]] = data
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(out)


def pause_source(go_mod_cache: Path, kubernetes_version: str) -> Path:
    src = go_mod_cache / f"k8s.io/kubernetes@{kubernetes_version}" / "build" / "pause" / "linux" / "pause.c"
    if not src.is_file():
        raise ClusterError(f"{src} is missing: build the node's programs first (`kuberl cluster build`)")
    return src


def ensure_pause_archive(cache: Path, go_mod_cache: Path, kubernetes_version: str) -> Path:
    """The pause image's OCI archive under ``cache``, compiled and packed the first time."""
    out = cache / "pause.tar"
    if out.is_file():
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ClusterError("the real node's pause image is compiled with gcc: apt-get install gcc libc6-dev")
    cache.mkdir(parents=True, exist_ok=True)
    binary = cache / "pause"
    proc = subprocess.run([gcc, "-Os", "-static", "-Wall", "-DVERSION=v3.10", "-o", str(binary),
                           str(pause_source(go_mod_cache, kubernetes_version))], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"gcc could not build the pause binary (apt-get install libc6-dev?): {proc.stderr[-400:]}")
    subprocess.run(["strip", str(binary)], capture_output=True)  # optional: binutils comes with gcc
    oci_archive(binary, PAUSE_TAG, out)
    return out
