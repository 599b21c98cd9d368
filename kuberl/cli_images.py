"""`kuberl images build|ls`: kuberl's own images built here with buildah from a debootstrap base."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _context(given: str | None) -> Path:
    """The build context: ``--context``, else the current folder or the checkout kuberl runs from,
    whichever holds images/sandbox/Dockerfile."""
    if given:
        root = Path(given).absolute()
        if not (root / "images" / "sandbox" / "Dockerfile").is_file():
            raise ValueError(f"--context {given} is not a kuberl checkout (no images/sandbox/Dockerfile there)")
        return root
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / "images" / "sandbox" / "Dockerfile").is_file():
            return root
    raise ValueError("no kuberl checkout here to build from: run in one, or pass --context DIR")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cmd_build(args: argparse.Namespace) -> int:
    from kuberl.cluster.errors import ClusterError
    from kuberl.cluster.image_build import build_images
    from kuberl.cluster.images import select

    select(args.names)  # an unknown name fails before anything is built
    context = _context(args.context)
    try:
        for built, loaded in build_images(args.names, context, address=args.load_into, namespace=args.namespace,
                                          log=_say):
            line = f"{built.ref}\t{built.image_id[:12]}"
            if loaded is not None:
                line += "\tloaded" if loaded else "\talready loaded"
            print(line, flush=True)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from kuberl.cluster.image_build import Buildah, cache_dir
    from kuberl.cluster.images import IMAGES

    buildah = Buildah(cache_dir())
    for spec in IMAGES.values():
        print(f"{spec.name}\t{spec.ref}\t{spec.dockerfile}\t{(buildah.image_id(spec.ref) or 'not built')[:12]}"
              f"\t{spec.note}")
    return 0


def add_command(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    from kuberl.cluster.images import DEFAULT_IMAGES, IMAGES

    c = sub.add_parser(
        "images",
        help="build kuberl's images here (buildah, a debootstrap base, no registry)",
        description="Build images/*/Dockerfile with buildah on a Debian base made by debootstrap (no registry), "
        "tagged with the names pods use by default, cached by the digest of their inputs ($KUBERL_IMAGES_CACHE, "
        "default ~/.cache/kuberl/images). Needs root and Debian's buildah, debootstrap and runc (plus containerd's "
        "ctr for --load-into).",
        formatter_class=fmt,
    )
    csub = c.add_subparsers(dest="images_command", metavar="SUBCOMMAND", required=True)
    b = csub.add_parser(
        "build",
        help="build (or reuse) images; print each name and image id",
        description="Build each NAME (default: " + " ".join(DEFAULT_IMAGES) + "), reusing an image whose inputs "
        "(Dockerfile, base recipe, build arguments, the files it COPYs) are unchanged; a source change rebuilds "
        "only the layers after the dependencies. Prints NAME<TAB>IMAGE-ID per image.",
        formatter_class=fmt,
    )
    b.add_argument("names", nargs="*", metavar="NAME", help="of: " + ", ".join(IMAGES))
    b.add_argument("--load-into", metavar="SOCKET", default=None,
                   help="then import each into the containerd at this socket (skipped where it has the same image id)")
    b.add_argument("--namespace", default="k8s.io", help="containerd namespace for --load-into (default k8s.io, the CRI's)")
    b.add_argument("--context", default=None, help="the kuberl checkout to build from (default: this one)")
    b.set_defaults(func=_cmd_build)
    s = csub.add_parser(
        "ls",
        help="the images kuberl builds and their ids in the store",
        description="Print NAME, the reference pods use, the Dockerfile, the image id in the store (or `not built`) "
        "and what the image runs.",
        formatter_class=fmt,
    )
    s.set_defaults(func=_cmd_ls)
