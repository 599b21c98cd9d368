"""A copy of the build context one Dockerfile needs (its COPY sources, the Dockerfile and
.dockerignore, less what .dockerignore leaves out), for the tests and the bench that change a
source file and rebuild without touching the checkout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kuberl.cluster.images import copy_sources, ignore_patterns, ignored


def copy_context(root: Path, dest: Path, dockerfile: str) -> None:
    """The files ``dockerfile``'s COPY lines need under ``root``, and the Dockerfile, copied to ``dest``."""
    patterns = ignore_patterns((root / ".dockerignore").read_text())
    for rel in [dockerfile, ".dockerignore", *copy_sources((root / dockerfile).read_text())]:
        src = root / rel.rstrip("/")
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
            continue
        shutil.copytree(src, dest / rel.rstrip("/"), dirs_exist_ok=True,  # a file of it may be copied already
                        ignore=lambda d, names: [n for n in names
                                                 if ignored(os.path.relpath(Path(d, n), root), patterns)])
