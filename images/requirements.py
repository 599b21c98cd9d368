"""Print the pip requirements pyproject.toml declares, one a line: the core dependencies plus the
named extras (``kuberl[x]`` self-references expanded). The Dockerfiles run it before the source is
copied, so the dependency layer is rebuilt only when pyproject.toml changes.

Usage: python3 requirements.py PYPROJECT [EXTRA ...]
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(project: dict, extras: list[str]) -> list[str]:
    """Core dependencies then each extra's, self-references (``name[a,b]``) followed, no repeats."""
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(sorted(optional))})")
        seen.add(extra)
        for req in optional[extra]:
            m = re.fullmatch(rf"{re.escape(name)}\[([\w,\s-]+)\]", req.strip())
            if m:
                todo += [e.strip() for e in m[1].split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1], "rb") as f:
        print("\n".join(requirements(tomllib.load(f)["project"], sys.argv[2:])))
