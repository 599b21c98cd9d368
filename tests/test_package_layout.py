"""The package layout: imports among kuberl's components point one way.

An AST scan of every product module (each folder ``pyproject.toml`` maps to a ``kuberl.*``
package) reads every import: module-level, inside functions and under ``if TYPE_CHECKING:``,
``import x`` and ``from x import y``, absolute and relative. From them it builds

* the package graph among the components (``kuberl.api``, ``kuberl.operator``, ...; the top
  package ``kuberl``, the CLI's, is a node of its own), which has no cycle;
* the graph among the operator's rooms: ``runtime`` -> ``decide`` / ``validate`` -> ``render``.
"""

from __future__ import annotations

import ast
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP = "kuberl"
OPERATOR = "kuberl.operator"
ROOMS_MAY_IMPORT = {
    "render": {"render"},
    "validate": {"validate", "render"},
    "decide": {"decide", "render"},
    "runtime": {"runtime", "decide", "validate", "render"},
}
PURE_ROOMS = ("render", "decide")
IO_LIBRARIES = ("kopf", "kubernetes", "aiohttp")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    target: str  # dotted name of what it imports (a module, a package or a name in one)
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.target}"


def _package_dirs() -> dict[str, Path]:
    """``kuberl.<component>`` -> its folder, from pyproject's package-dir."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in config["package-dir"].items()}


def _modules() -> Iterator[tuple[str, Path]]:
    """Every product module as (dotted name, path); a package's ``__init__`` is the package."""
    for package, folder in _package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def _imports_of(module: str, path: Path) -> Iterator[Import]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for node in ast.walk(tree):
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from kuberl import operator`` imports the package kuberl.operator
                yield Import(module, f"{source}.{alias.name}", where)


def _all_imports() -> list[Import]:
    return [imp for module, path in _modules() for imp in _imports_of(module, path)]


def _node(name: str, nodes: set[str]) -> str | None:
    """The longest node that ``name`` lies in (``kuberl.operator.render.keda`` -> the node
    ``kuberl.operator`` among components); None outside kuberl."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in nodes:
            return ".".join(parts[:n])
    return None


def _graph(nodes: set[str], imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        src, dst = _node(imp.importer, nodes), _node(imp.target, nodes)
        if src and dst and src != dst:
            edges.setdefault((src, dst), []).append(imp)
    return edges


def _cycles(edges: dict[tuple[str, str], list[Import]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one node, and each
    edge of the component on some cycle: every edge (a, b) with a path back from b to a."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)

    def path(start: str, goal: str) -> list[str] | None:
        seen, stack = {start}, [[start]]
        while stack:
            trail = stack.pop()
            if trail[-1] == goal:
                return trail
            for nxt in sorted(succ.get(trail[-1], ())):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append([*trail, nxt])
        return None

    found = []
    for a, b in sorted(edges):
        back = path(b, a)
        if back is not None:
            found.append([a, *back])
    return found


def _describe(cycles: list[list[str]], edges: dict[tuple[str, str], list[Import]]) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        a, b = cycle[0], cycle[1]
        lines += [f"    {imp}" for imp in edges[(a, b)]]
    return "\n".join(lines)


def _components() -> set[str]:
    return set(_package_dirs())


def test_every_package_folder_is_in_the_wheel():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {m for m, path in _modules() if path.name == "__init__.py"}
    assert folders == set(config["packages"])


def test_no_product_module_is_ignored_by_git():
    """A package folder named like a build output (``build/``) would be ignored: its new files
    never committed, and skipped by ruff's default excludes."""
    paths = [str(path.relative_to(REPO)) for _, path in _modules()]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip(f"not a git checkout: {ignored.stderr.strip()}")
    assert not ignored.stdout.split(), ignored.stdout


def test_the_scan_sees_every_component_and_every_kind_of_import():
    modules = dict(_modules())
    assert _components() <= set(modules), "a package-dir folder without __init__.py"
    imports = _all_imports()
    # one import of each kind the scan must count, from modules known to hold them
    kinds = {
        "function-local": ("kuberl.cli", "kuberl.operator.runtime.main"),
        "module-level": ("kuberl.operator.runtime.handlers", "kuberl.operator.runtime.context"),
    }
    for kind, (importer, target) in kinds.items():
        assert any(i.importer == importer and i.target.startswith(target) for i in imports), kind


def test_relative_and_type_checking_imports_are_read(tmp_path):
    pkg = tmp_path / "kuberl" / "rollout"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import x\n")
    (pkg / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kuberl.trainer.grpo import Scored\n"
        "def f():\n    from ..sandbox import config\n    import kuberl.api.job\n"
    )
    got = {i.target for i in _imports_of("kuberl.rollout.x", pkg / "x.py")} | {
        i.target for i in _imports_of("kuberl.rollout", pkg / "__init__.py")
    }
    assert {"kuberl.trainer.grpo.Scored", "kuberl.sandbox.config", "kuberl.api.job", "kuberl.rollout.x"} <= got


def test_no_cycle_among_the_kuberl_packages():
    components = _components()
    edges = _graph(components, _all_imports())
    cycles = _cycles(edges)
    print("package graph:")
    for a, b in sorted(edges):
        print(f"  {a} -> {b} ({len(edges[(a, b)])})")
    assert not cycles, "import cycles among kuberl's packages:\n" + _describe(cycles, edges)


def test_nothing_below_the_cli_imports_the_top_package():
    components = _components()
    offending = [
        imp
        for imp in _all_imports()
        if _node(imp.importer, components) != TOP and _node(imp.target, components) == TOP
    ]
    assert not offending, "\n".join(map(str, offending))


def test_the_utilities_import_no_other_kuberl_package():
    components = _components()
    offending = [
        imp
        for imp in _all_imports()
        if _node(imp.importer, components) == "kuberl.util"
        and _node(imp.target, components) not in (None, "kuberl.util")
    ]
    assert not offending, "\n".join(map(str, offending))


def test_the_operator_rooms_import_one_way():
    rooms = {f"{OPERATOR}.{room}" for room in ROOMS_MAY_IMPORT}
    modules = [m for m, _ in _modules() if m.startswith(OPERATOR + ".")]
    assert all(_node(m, rooms) for m in modules), "an operator module outside the rooms"
    wrong = []
    for imp in _all_imports():
        src = _node(imp.importer, rooms)
        dst = _node(imp.target, rooms | {OPERATOR})
        if src is None or dst is None:
            continue
        if dst == OPERATOR or dst.rsplit(".", 1)[1] not in ROOMS_MAY_IMPORT[src.rsplit(".", 1)[1]]:
            wrong.append(imp)
    assert not wrong, "imports against runtime -> decide/validate -> build:\n" + "\n".join(map(str, wrong))


def test_the_pure_rooms_do_no_io():
    pure = {f"{OPERATOR}.{room}" for room in PURE_ROOMS}
    offending = [
        imp
        for imp in _all_imports()
        if _node(imp.importer, pure) and imp.target.split(".")[0] in IO_LIBRARIES
    ]
    assert not offending, "\n".join(map(str, offending))


def test_bench_harness_and_tests_share_no_module_name():
    """bench/, harness/ and tests/ are put on sys.path side by side (bench scripts and tests
    import harness modules by bare name), so a name in two of them imports whichever folder came
    first: bench/real_node.py once shadowed the node tests' harness module."""
    seen: dict[str, str] = {}
    clashes = []
    for folder in ("bench", "harness", "tests"):
        for path in sorted((REPO / folder).glob("*.py")):
            if path.stem in seen and path.stem != "__init__":
                clashes.append(f"{seen[path.stem]}/{path.name} and {folder}/{path.name}")
            seen.setdefault(path.stem, folder)
    assert clashes == []
