"""Benchmark: kuberl's images built here (issue 38, item 4: image builds, cold and warm).

    python -P bench/image_build.py                         # sandbox + operator, into a fresh store
    python -P bench/image_build.py --images trainer-cpu    # the CPU trainer (PyPI's torch, GBs)
    python -P bench/image_build.py --images rollout-cpu --cache ~/.cache/kuberl/images --no-load   # vLLM's, warm
    python -P bench/image_build.py --cache ~/.cache/kuberl/images   # warm figures of the CI store

1. Cold: the debootstrap base, then each image, into an empty buildah store (``--cache``,
   default a fresh folder under /tmp removed afterwards); pip downloads everything again.
2. Warm: the same builds again (each a cache hit on its inputs digest).
3. A source change: one file of the image's own folder (CHANGED_FILE: sandbox/, rollout/)
   changed in a copy of the build context, the image rebuilt under a test tag (the dependency
   layers are reused).
4. Sizes (buildah's) and the import into a private containerd, first and again (skipped).

Prints one line per figure and a JSON summary; the machine's load average is part of it, since
every figure here is the machine's (2 cores shared with other builds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "harness"))

from image_context import copy_context  # noqa: E402

from kuberl.cluster.image_build import (  # noqa: E402
    Buildah,
    build_image,
    default_base,
    ensure_base,
    load_into,
    require_tools,
)
from kuberl.cluster.images import IMAGES  # noqa: E402


def _say(line: str) -> None:
    print(line, flush=True)


def _size(store: Buildah, image_id: str) -> str:
    """The image's size as buildah reports it (uncompressed layers, e.g. ``581 MB``)."""
    res = subprocess.run(store.cmd("images", "--json", "--no-trunc"), capture_output=True, text=True, timeout=120)
    return next((row["size"] for row in json.loads(res.stdout or "[]") if row["id"].removeprefix("sha256:") == image_id), "?")


# The source file step 3 changes, per image: one its own component's folder holds.
CHANGED_FILE = {"sandbox": "sandbox/__init__.py", "rollout-cpu": "rollout/__init__.py"}


def _changed_context(dest: Path, dockerfile: str, changed: str) -> None:
    copy_context(ROOT, dest, dockerfile)
    init = dest / changed
    init.write_text(init.read_text() + f"\n# changed by bench/image_build.py at {time.time()}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", nargs="+", default=["sandbox", "operator"], choices=list(IMAGES))
    ap.add_argument("--cache", default=None, help="the store to build into (default: a fresh one, removed after)")
    ap.add_argument("--no-load", action="store_true", help="skip the containerd import")
    args = ap.parse_args()
    require_tools(("buildah", "debootstrap", "runc", "ctr", "containerd"))
    fresh = args.cache is None
    cache = Path(args.cache).expanduser() if args.cache else Path(tempfile.mkdtemp(prefix="kimg-bench-", dir="/tmp"))
    store = Buildah(cache)
    recipe = default_base()
    summary: dict = {"load_before": os.getloadavg(), "cache": str(cache), "fresh_store": fresh}
    try:
        base = ensure_base(store, recipe, log=_say)
        summary["base"] = {"cached": base.cached, "s": round(base.seconds, 1), "size": _size(store, base.image_id)}
        _say(f"base: {'cached' if base.cached else 'built'} in {base.seconds:.0f} s, {summary['base']['size']}")
        built = {}
        for name in args.images:
            b = build_image(store, IMAGES[name], ROOT, recipe, log=_say)
            built[name] = b
            summary[name] = {"first_cached": b.cached, "first_s": round(b.seconds, 1),
                             "size": _size(store, b.image_id), "layers": len(store.layers(b.image_id))}
            _say(f"{name}: {'cached' if b.cached else 'built'} in {b.seconds:.0f} s, {summary[name]['size']}")
        for name in args.images:
            again = build_image(store, IMAGES[name], ROOT, recipe)
            summary[name]["warm_s"] = round(again.seconds, 2)
            _say(f"{name}: warm {again.seconds:.2f} s (cached: {again.cached})")
        for name in [n for n in args.images if n in CHANGED_FILE]:
            with tempfile.TemporaryDirectory(prefix="kimg-ctx-") as tmp:
                _changed_context(Path(tmp), IMAGES[name].dockerfile, CHANGED_FILE[name])
                ref = f"localhost/kuberl-bench/{name}:changed"
                b = build_image(store, IMAGES[name], Path(tmp), recipe, ref=ref)
                old, new = store.layers(built[name].image_id), store.layers(b.image_id)
                kept = next((i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y), len(old))
                summary[name]["source_change_s"] = round(b.seconds, 1)
                summary[name]["source_change_layers_kept"] = f"{kept}/{len(new)}"
                _say(f"{name} after a change to {CHANGED_FILE[name]}: {b.seconds:.0f} s, "
                     f"{kept} of {len(new)} layers kept")
                subprocess.run(store.cmd("rmi", ref), capture_output=True, timeout=300)
        if not args.no_load:
            from private_containerd import private_containerd

            with private_containerd() as ctd:
                for name in args.images:
                    t0 = time.monotonic()
                    load_into(store, IMAGES[name].ref, ctd.address, image_id=built[name].image_id)
                    first = time.monotonic() - t0
                    t0 = time.monotonic()
                    skipped = not load_into(store, IMAGES[name].ref, ctd.address, image_id=built[name].image_id)
                    summary[name]["load_s"] = round(first, 1)
                    summary[name]["reload_s"] = round(time.monotonic() - t0, 2)
                    _say(f"{name}: into containerd {first:.0f} s, again {summary[name]['reload_s']} s (skipped: {skipped})")
    finally:
        summary["load_after"] = os.getloadavg()
        if fresh:
            subprocess.run(store.cmd("rmi", "--all", "--force"), capture_output=True, timeout=600)
            subprocess.run(["umount", "-l", str(cache / "storage" / "overlay")], capture_output=True, timeout=60)
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
