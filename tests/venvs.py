"""Virtual environments that see the running interpreter's packages, whatever it is: the
system's, pyenv's, or itself a venv (``python -m venv --system-site-packages`` run from a venv
builds on the base interpreter and sees its packages, not the venv's)."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path


def site_setup() -> str:
    """A .pth line that puts the running interpreter's site prefixes ahead of the base
    interpreter's in a venv made with ``--system-site-packages``: ``site`` then adds their
    site-packages after the venv's own, reading their .pth files, and ``site.getsitepackages()``
    lists them, as the sandbox's view of an interpreter's files reads it. No comprehension: a
    .pth line runs inside ``site``'s own function, whose names a nested scope cannot see."""
    prefixes = list(dict.fromkeys(site.PREFIXES))
    return (
        f"import site; new = {prefixes!r}; "
        "site.PREFIXES[0:0] = sorted(set(new) - set(site.PREFIXES), key=new.index)\n"
    )


def venv_like_this_interpreter(dest: Path) -> Path:
    """A venv at ``dest`` without pip whose own site-packages come first, then the running
    interpreter's, then the base interpreter's; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "running-interpreter.pth").write_text(site_setup())
    return python
