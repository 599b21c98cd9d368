"""The rollout side imports nothing from the trainer: they meet at data (issue 42, item 1).

Every import statement of every module under ``rollout/`` counts, wherever it stands: at module
level, inside a function, under ``if TYPE_CHECKING:``, relative or absolute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kuberl.rollout

ROLLOUT = Path(kuberl.rollout.__file__).parent
PACKAGE = "kuberl.rollout"
FORBIDDEN = "kuberl.trainer"


def _package_of(path: Path) -> str:
    """The package a relative import in ``path`` starts from (a module's, or an __init__'s own)."""
    return ".".join((PACKAGE, *path.relative_to(ROLLOUT).parts[:-1]))


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, every nesting level included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _reaches_trainer(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def test_the_scan_sees_function_local_type_checking_and_relative_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kuberl.trainer.grpo import Scored\n"
        "def f():\n    import kuberl.trainer.hf\n"
        "def g():\n    from .. import trainer\n"
        "def h():\n    importlib.import_module('kuberl.trainer.data')\n"
    )
    hits = [line for line, m in imported_modules(source, PACKAGE) if _reaches_trainer(m)]
    assert sorted(set(hits)) == [3, 5, 7, 9]


def test_no_rollout_module_imports_the_trainer():
    files = sorted(ROLLOUT.rglob("*.py"))
    assert len(files) > 10, f"no rollout modules found under {ROLLOUT}"
    offenders = {
        f"{path.relative_to(ROLLOUT.parent)}:{line}": module
        for path in files
        for line, module in reversed(imported_modules(path.read_text(), _package_of(path)))
        if _reaches_trainer(module)
    }
    assert not offenders, "rollout/ imports the trainer:\n" + "\n".join(f"{k}: {v}" for k, v in offenders.items())
