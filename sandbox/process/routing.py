"""Which of a worker's two zygotes forks a call's process, and the pair of zygotes itself.

A trivial call's CPU floor is forking and tearing down the image its process is forked from:
the full zygote holds numpy, scipy, sympy and math-verify (~100 MB), the light one only the
interpreter and the preloaded standard library (~25 MB). :func:`zygote_for` sends a call to the light zygote only when its code plainly uses
nothing but the standard library. It is a scan of the text, nothing the worker has to parse or
run, and it errs only one way: anything that could import a module by a name it builds at run
time (``__import__``, ``importlib``, ``exec``/``eval``/``compile``, ``getattr`` on builtins,
``sys.modules``, pickle, ...) goes to the full zygote. Routing is about speed, never about
safety: both zygotes' children get the same sandbox, and a call sent to the light one that
imports numpy after all simply imports it cold (slower, same result).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from typing import Any, Literal

from kuberl.sandbox.process.calls import Prepared
from kuberl.sandbox.process.zygote import Zygote, ZygoteGone

Kind = Literal["light", "full"]

# Substrings (of the NFKC-normalised, lower-cased code) that may reach an import by a computed
# name, or that name what the full zygote preloads. False positives only cost a little speed.
DYNAMIC_MARKERS = (
    "numpy", "scipy", "sympy", "math_verify", "mpmath",  # what only the full zygote holds
    "import__", "importlib", "exec", "eval", "compile", "getattr", "builtins", "sys.modules",
    "globals", "vars", "__dict__", "__subclasses__", "__globals__", "__base", "__mro__",
    "__loader__", "__spec__", "attrgetter", "methodcaller", "get_type_hints", "forwardref",
    "pickle", "marshal", "shelve", "runpy", "pkgutil", "pydoc", "help", "breakpoint", "timeit",
)  # fmt: skip

# Standard-library modules that can import or run code named by a string (the pattern above
# cannot follow them): a call importing one goes to the full zygote.
_DYNAMIC_STDLIB = frozenset({
    "code", "codeop", "copyreg", "ctypes", "doctest", "idlelib", "importlib", "inspect", "logging",
    "marshal", "multiprocessing", "pdb", "pickle", "pickletools", "pkgutil", "pydoc", "runpy",
    "shelve", "site", "timeit", "unittest", "xmlrpc", "zipimport", "concurrent", "typing_extensions",
})  # fmt: skip
LIGHT_MODULES = frozenset(sys.stdlib_module_names) - _DYNAMIC_STDLIB

# ``from a.b import (x, y)`` (the names imported from it are not modules: cut out), then ``import``
_FROM = re.compile(r"\bfrom\s+([\w.]+)\s+import\s*(\([^)]*\)|[^\n;]*)")
_IMPORT = re.compile(r"\bimport\s+([^\n;#]+)")


def _imported(code: str) -> list[str]:
    """Top-level module names the code's import statements (and anything like them in strings
    or comments: harmless extras) name; ``import a.b as c, d`` gives a and d, a relative
    ``from . import x`` gives "" (no module we know)."""
    names = [m.group(1).split(".")[0] for m in _FROM.finditer(code)]
    for m in _IMPORT.finditer(_FROM.sub(" ", code)):
        for part in m.group(1).split(","):
            words = part.replace("(", " ").replace(")", " ").split()
            if words:
                names.append(words[0].split(".")[0])
    return names


def zygote_for(req: dict[str, Any]) -> Kind:
    """``"light"`` for an ``exec`` call whose code imports only standard-library modules and
    names nothing that could import by a computed name; ``"full"`` for everything else
    (verifications run math-verify: always full). Pure; safe on any input."""
    code = req.get("code") if isinstance(req, dict) and req.get("op") == "exec" else None
    if not isinstance(code, str):
        return "full"
    # Python reads identifiers NFKC-normalised (a fullwidth ｅｘｅｃ is exec) and joins lines
    # that end in a backslash: scan the code as the compiler will read it
    text = unicodedata.normalize("NFKC", code).replace("\\\r\n", " ").replace("\\\n", " ")
    lowered = text.lower()
    if any(marker in lowered for marker in DYNAMIC_MARKERS):
        return "full"
    if any(name not in LIGHT_MODULES for name in _imported(text)):
        return "full"
    return "light"


class Zygotes:
    """A worker's full and light zygotes, with :class:`Zygote`'s interface plus the call's kind.

    Each zygote has at most one child forked ahead, so a call of either kind starts at once;
    only the one used forks again. If one zygote is gone (killed, out of memory), calls go to
    the other, which can run any call (the light one imports cold): a lost zygote never fails a
    call. The worker cannot start a new one itself (it has read calls since: a zygote forked
    from it now would hand their bytes to every later call); the server replaces a worker whose
    zygotes are both gone."""

    scrub = False

    def __init__(self, full: Zygote, light: Zygote | None) -> None:
        self.full: Zygote | None = full
        self.light = light

    @property
    def pids(self) -> tuple[int, ...]:
        """The zygotes alive (as far as we know). A lost one's pid is dropped: a later call's
        process could be given it."""
        return tuple(z.pid for z in self._alive("full"))

    @property
    def keep(self) -> tuple[int, ...]:
        """The worker's children that are not calls': the zygotes and the children they forked
        ahead that the worker has received (clearing the slot after a call spares them)."""
        ready = tuple(z.ready.pid for z in self._alive("full") if z.ready is not None)
        return self.pids + ready

    @property
    def children_inside(self) -> bool:
        """Whether the zygotes' children are born in the slot's cgroup (one wait there ahead)."""
        return any(z.children_inside for z in self._alive("full"))

    def _alive(self, kind: Kind) -> list[Zygote]:
        order = [self.light, self.full] if kind == "light" else [self.full, self.light]
        return [z for z in order if z is not None]

    def _lose(self, zygote: Zygote, err: ZygoteGone) -> None:
        which = "light" if zygote is self.light else "full"
        print(
            f"kuberl sandbox worker: the {which} zygote is gone ({err}); the other forks every call",
            file=sys.stderr,
        )
        zygote.close()
        if zygote is self.light:
            self.light = None
        else:
            self.full = None
        if not self._alive("full"):
            raise ZygoteGone(f"both zygotes are gone (last: {err})")

    def ask(self, slot: Any) -> None:
        """Have each zygote fork its next child now (the next call may be of either kind)."""
        for zygote in self._alive("full"):
            try:
                zygote.ask(slot)
            except ZygoteGone as err:
                self._lose(zygote, err)

    def take(self, slot: Any, kind: Kind = "full") -> Prepared:
        """A child of the zygote for ``kind`` (of the other one, if that one is gone); the
        slot's ``keep_alive`` becomes the zygotes and the other's child forked ahead."""
        while zygotes := self._alive(kind):
            try:
                prepared = zygotes[0].take(slot)
            except ZygoteGone as err:
                self._lose(zygotes[0], err)
                continue
            for other in zygotes[1:]:  # its child forked ahead must survive this call's cleanup
                try:
                    other.collect()
                except ZygoteGone as err:
                    self._lose(other, err)
            # from now on (the call may be killed, its slot cleared) the slot spares these
            slot.keep_alive = frozenset(self.keep)
            return prepared
        raise ZygoteGone("no zygote left")

    def close(self) -> None:
        for zygote in self._alive("full"):  # the lost ones were closed (and reaped) already
            zygote.close()
