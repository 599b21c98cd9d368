"""The shell around ``cluster/images.py``: debootstrap the base, build with buildah, load containerd.

Images live in a buildah store of their own under ``$KUBERL_IMAGES_CACHE`` (default
~/.cache/kuberl/images): ``storage/`` (overlay driver), ``run/`` and ``logs/<name>-<digest>.log``
(each build's output). Checkouts sharing the store share its layers, and its tags: the last build
of a name wins. Builds run with ``--isolation chroot`` (no systemd, cgroup v1 and a VM without
user namespaces are all fine) and ``--layers`` (a source change keeps the dependency layer).
Nothing needs a registry: the base is ``debootstrap``'s, and images reach a containerd as a
``docker-archive`` through ``ctr images import``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kuberl.cluster.errors import ClusterError
from kuberl.cluster.images import (
    INPUTS_LABEL,
    BaseRecipe,
    ImageSpec,
    build_args,
    image_inputs_digest,
    render_build_args,
    select,
)

# command -> the Debian package that provides it
TOOLS = {"buildah": "buildah", "debootstrap": "debootstrap", "ctr": "containerd", "containerd": "containerd",
         "runc": "runc"}
HOST_CAS = Path("/usr/local/share/ca-certificates")
HELD_SUFFIX = "-previous"  # the tag suffix of the image a name had while a new one is imported under it
Log = Callable[[str], None]


def cache_dir() -> Path:
    return Path(os.environ.get("KUBERL_IMAGES_CACHE") or Path.home() / ".cache" / "kuberl" / "images")


def require_tools(commands: tuple[str, ...] = ("buildah", "debootstrap", "runc"),
                  search_path: str | None = None) -> None:
    """A ClusterError naming the apt packages to install when any of ``commands`` is missing from
    ``search_path`` (default: $PATH and the sbin folders, where debootstrap and runc live)."""
    if search_path is None:
        search_path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [c for c in commands if shutil.which(c, path=search_path) is None]
    if missing:
        packages = " ".join(dict.fromkeys(TOOLS[c] for c in missing))
        raise ClusterError(f"{', '.join(missing)} not found: `apt-get install -y {packages}` "
                           "(Debian's packages; building kuberl's images needs no registry)")
    if os.geteuid() != 0:
        raise ClusterError("kuberl images build runs buildah and debootstrap as root (run it with sudo)")


def host_extra_cas(folder: Path = HOST_CAS) -> tuple[tuple[str, str], ...]:
    """The CA certificates this host adds to Debian's list (``update-ca-certificates`` reads them)."""
    if not folder.is_dir():
        return ()
    return tuple((p.relative_to(folder).as_posix(), p.read_text())
                 for p in sorted(folder.rglob("*.crt")) if p.is_file())


def default_base() -> BaseRecipe:
    return BaseRecipe(extra_cas=host_extra_cas())


def _run(cmd: list[str], log_file: Path | None = None, timeout: float = 3600, **kw) -> str:
    """Run ``cmd``; its output goes to ``log_file`` (appended) or is returned. A failure raises a
    ClusterError with the output's tail."""
    if log_file is not None:
        with log_file.open("a") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
        if res.returncode != 0:
            tail = "".join(log_file.read_text().splitlines(keepends=True)[-25:])
            raise ClusterError(f"`{' '.join(cmd[:6])} ...` failed ({res.returncode}); the end of "
                               f"{log_file}:\n{tail}")
        return ""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if res.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd[:6])} ...` failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return res.stdout


@dataclass(frozen=True)
class Buildah:
    """buildah on the store under ``cache``."""

    cache: Path

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", "--root", str(self.cache / "storage"), "--runroot", str(self.cache / "run"),
                "--storage-driver", "overlay", *args]

    def inspect(self, ref: str) -> dict | None:
        """The image's buildah inspect JSON, None when the store has no such image."""
        res = subprocess.run(self.cmd("inspect", "--type", "image", ref), capture_output=True, text=True,
                             timeout=120)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def label(self, ref: str, key: str = INPUTS_LABEL) -> str | None:
        found = self.inspect(ref)
        return ((found or {}).get("OCIv1", {}).get("config", {}).get("Labels") or {}).get(key)

    def image_id(self, ref: str) -> str | None:
        found = self.inspect(ref)
        return found["FromImageID"] if found else None

    def layers(self, ref: str) -> list[str]:
        """The image's layer diff ids, base first."""
        found = self.inspect(ref)
        return list(found["OCIv1"]["rootfs"]["diff_ids"]) if found else []


@dataclass(frozen=True)
class Built:
    name: str
    ref: str
    image_id: str
    cached: bool  # the store already had this image with the same inputs digest
    seconds: float
    log: Path | None = None  # the build's output, where it ran


def ensure_base(buildah: Buildah, recipe: BaseRecipe, log: Log = lambda _: None) -> Built:
    """``recipe.ref`` in the store, debootstrapped only when no image carries its recipe's digest."""
    t0 = time.monotonic()
    digest = recipe.digest()
    if buildah.label(recipe.ref) == digest:
        return Built("base", recipe.ref, buildah.image_id(recipe.ref) or "", True, time.monotonic() - t0)
    logs = buildah.cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / f"base-{digest[:12]}.log"
    log_file.write_text("")
    log(f"base: debootstrap {recipe.variant} {recipe.suite} + {', '.join(recipe.packages)} (about a minute) ...")
    with tempfile.TemporaryDirectory(prefix="base-", dir=buildah.cache) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(recipe.debootstrap_args(rootfs), log_file)
        if recipe.extra_cas:
            for name, pem in recipe.extra_cas:
                dest = rootfs / "usr/local/share/ca-certificates" / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(pem)
            _run(["chroot", str(rootfs), "update-ca-certificates"], log_file)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / cache).glob("*"):
                if p.is_file():
                    p.unlink()
        tarball = Path(tmp) / "rootfs.tar"
        _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], log_file)
        container = _run(buildah.cmd("from", "scratch")).strip()
        try:
            _run(buildah.cmd("add", container, str(tarball), "/"), log_file)
            env = [w for k, v in recipe.env for w in ("--env", f"{k}={v}")]
            _run(buildah.cmd("config", *env, "--cmd", "/bin/bash", "--label", f"{INPUTS_LABEL}={digest}",
                             container), log_file)
            _run(buildah.cmd("commit", "--rm", container, recipe.ref), log_file)
        except ClusterError:
            subprocess.run(buildah.cmd("rm", container), capture_output=True, timeout=120)
            raise
    return Built("base", recipe.ref, buildah.image_id(recipe.ref) or "", False, time.monotonic() - t0, log_file)


def build_image(buildah: Buildah, spec: ImageSpec, context: Path, recipe: BaseRecipe,
                ref: str | None = None, log: Log = lambda _: None) -> Built:
    """``spec`` built from ``context`` and tagged ``ref`` (default: the name pods use), or left as it
    is when the store's image under that name carries the same inputs digest."""
    t0 = time.monotonic()
    ref = ref or spec.ref
    digest = image_inputs_digest(context, spec, recipe)
    if buildah.label(ref) == digest:
        return Built(spec.name, ref, buildah.image_id(ref) or "", True, time.monotonic() - t0)
    logs = buildah.cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # one log per inputs digest: builds from two checkouts into one store at once keep theirs apart
    log_file = logs / f"{spec.name}-{digest[:12]}.log"
    log_file.write_text("")
    log(f"{spec.name}: building {ref} from {spec.dockerfile} (log: {log_file}) ...")
    _run(buildah.cmd("bud", "--layers", "--isolation", "chroot", "--format", "docker",
                     "-f", str(context / spec.dockerfile), "-t", ref, "--label", f"{INPUTS_LABEL}={digest}",
                     *render_build_args(build_args(spec, recipe.ref)), str(context)), log_file)
    return Built(spec.name, ref, buildah.image_id(ref) or "", False, time.monotonic() - t0, log_file)


def _ctr(address: str, namespace: str, *args: str) -> list[str]:
    return ["ctr", "--address", address, "-n", namespace, *args]


def containerd_image_id(address: str, namespace: str, ref: str) -> str | None:
    """The config digest (the image id, without ``sha256:``) of ``ref`` in that containerd, if any."""
    res = subprocess.run(_ctr(address, namespace, "images", "ls", f"name=={ref}"), capture_output=True,
                         text=True, timeout=60)
    if res.returncode != 0:
        raise ClusterError(f"cannot reach containerd at {address}: {res.stderr.strip()}")
    rows = [line.split() for line in res.stdout.splitlines()[1:] if line.split()[:1] == [ref]]
    if not rows:
        return None
    manifest = json.loads(_run(_ctr(address, namespace, "content", "get", rows[0][2])))
    if "manifests" in manifest:  # an index: take the first platform's manifest
        manifest = json.loads(_run(_ctr(address, namespace, "content", "get", manifest["manifests"][0]["digest"])))
    return manifest["config"]["digest"].removeprefix("sha256:")


def chain_id(diff_ids: list[str]) -> str:
    """The OCI ChainID of layers ``diff_ids`` (base first): the key of the snapshot containerd
    unpacks the top layer to."""
    chain = diff_ids[0]
    for diff_id in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {diff_id}".encode()).hexdigest()
    return chain


def unpacked(address: str, namespace: str, diff_ids: list[str], snapshotter: str = "overlayfs") -> bool:
    """Whether that containerd has the layers ``diff_ids`` unpacked (a pod's container can start)."""
    res = subprocess.run(_ctr(address, namespace, "snapshots", "--snapshotter", snapshotter, "info",
                              chain_id(diff_ids)), capture_output=True, text=True, timeout=60)
    return res.returncode == 0


@contextlib.contextmanager
def previous_image_held(address: str, namespace: str, ref: str, current: str | None) -> Iterator[None]:
    """While ``ref`` is imported again, the image it names now (``current``, its id; None where
    there is none) stays referenced under a second name. ``ctr images import`` moves the name before it
    unpacks, and containerd collects the snapshots of an image no name refers to: a collection in
    between took the layers both images share, which were then unpacked again (minutes for the
    trainer's dependencies) or, when it fell between the unpack's look at a layer and the next
    one's extraction, failed the import ("parent snapshot ... does not exist")."""
    if current is None:
        yield
        return
    held = f"{ref}{HELD_SUFFIX}"
    _run(_ctr(address, namespace, "images", "tag", "--force", ref, held))
    try:
        yield
    finally:
        _run(_ctr(address, namespace, "images", "rm", held))


def load_into(buildah: Buildah, ref: str, address: str, namespace: str = "k8s.io",
              log: Log = lambda _: None, image_id: str | None = None) -> bool:
    """Import ``ref`` (or the image ``image_id``, named ``ref`` there) from the store into the
    containerd at ``address`` and unpack it; False (nothing done) where that containerd already
    has the same image id under that name, unpacked."""
    want = buildah.image_id(image_id or ref)
    if want is None:
        raise ClusterError(f"no image {ref} in {buildah.cache}: build it first (`kuberl images build`)")
    layers = buildah.layers(want)
    current = containerd_image_id(address, namespace, ref)
    if current == want and unpacked(address, namespace, layers):
        return False
    log(f"loading {ref} into containerd {address} (namespace {namespace}) ...")
    with tempfile.TemporaryDirectory(prefix="load-", dir=buildah.cache) as tmp:
        archive = Path(tmp) / "image.tar"
        _run(buildah.cmd("push", "--quiet", want, f"docker-archive:{archive}:{ref}"))
        with previous_image_held(address, namespace, ref, current):
            _run(_ctr(address, namespace, "images", "import", str(archive)))
    got = containerd_image_id(address, namespace, ref)
    if got != want:
        raise ClusterError(f"containerd at {address} has {ref} as {got} after the import, not {want}")
    if not unpacked(address, namespace, layers):
        raise ClusterError(f"containerd at {address} has {ref} but not its layers unpacked after the import")
    return True


def build_images(names: list[str], context: Path, *, address: str | None = None, namespace: str = "k8s.io",
                 log: Log = lambda _: None) -> Iterator[tuple[Built, bool | None]]:
    """Build (or reuse) the base and each of ``names`` from ``context``, one at a time, and with
    ``address`` load each into that containerd: (what was built, whether it was loaded; None
    without ``address``). ClusterError before anything runs where a tool is missing."""
    require_tools(("buildah", "debootstrap", "runc", *(("ctr",) if address else ())))
    buildah, recipe = Buildah(cache_dir()), default_base()
    base = ensure_base(buildah, recipe, log=log)
    log(f"base {base.ref}: {'cached' if base.cached else 'built'} ({base.seconds:.0f} s)")
    for spec in select(names):
        built = build_image(buildah, spec, context, recipe, log=log)
        log(f"{spec.name}: {'cached' if built.cached else 'built'} ({built.seconds:.0f} s)")
        loaded = load_into(buildah, built.ref, address, namespace, log=log) if address else None
        yield built, loaded
