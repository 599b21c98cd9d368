"""The interpreter's after-fork hooks, trimmed for the zygote's children.

Every fork of the interpreter (``os.fork``, and the zygote's ``fork_sibling``) runs each
``os.register_at_fork(after_in_child=...)`` hook in the child. A zygote has two, both from the
standard library: threading's ``_after_fork`` and random's reseeding. On a light zygote they
are most of a child's copy-on-write page faults from fork to its first line, mostly
threading's Python walking its thread registry.

threading's hook repairs a fork taken while *other* threads ran: it re-creates the locks one
of them may have held and forgets the threads that did not survive. The zygote has a single
thread and forks from its own loop, holding none of those locks, so in its children the hook
would rebuild exactly what is already there. While the zygote has one thread its children
skip it. random's reseeding stays (no two calls may draw the same random numbers) but runs as
the C method itself: the Python ``Random.seed`` around it only resets ``gauss_next``, which
the zygote clears once here and never sets.

A child puts the full list back (:meth:`ForkHooks.restore`) before the call's code runs, so a
call that forks, with threads or without, gets the interpreter's standard behaviour.
"""

from __future__ import annotations

import _random
import _thread
import gc
import os
import sys
import threading
from typing import Any


def _hook_list() -> list[Any] | None:
    """The interpreter's own list of after-in-child hooks, found by registering a marker and
    asking which list holds it (the marker is taken out again); None where that is not a
    plain list (another interpreter than CPython)."""

    def marker() -> None:
        return None

    os.register_at_fork(after_in_child=marker)
    holders = [r for r in gc.get_referrers(marker) if type(r) is list and r and r[-1] is marker]
    for holder in holders:
        holder.remove(marker)
    return holders[0] if len(holders) == 1 else None


def _c_reseed(hook: Any) -> Any | None:
    """The C-level reseed for random's hook (a ``Random`` instance's ``seed``), else None."""
    random = sys.modules.get("random")
    inst = getattr(hook, "__self__", None)
    if random is None or not isinstance(inst, random.Random):
        return None
    if getattr(hook, "__func__", None) is not random.Random.seed:  # a subclass's own seed
        return None
    inst.gauss_next = None  # what Random.seed would reset in every child
    return _random.Random.seed.__get__(inst)


def single_threaded() -> bool:
    """No thread but this one, in threading's registry or started through ``_thread``."""
    return threading.active_count() == 1 and _thread._count() == 0  # noqa: SLF001 - the only count of raw threads


class ForkHooks:
    """The hook list as registered and the lean one the zygote forks with."""

    def __init__(self, hooks: list[Any], full: list[Any], lean: list[Any]) -> None:
        self.hooks = hooks
        self.full = full
        self.lean = lean

    @classmethod
    def trim(cls) -> ForkHooks | None:
        """In the zygote, once its preload is done: fork with the lean list from now on.
        None (nothing changed) where the list cannot be found or other threads run. Call it
        before ``gc.freeze``: ``gc.get_referrers`` does not see frozen objects."""
        hooks = _hook_list()
        if hooks is None or not single_threaded():
            return None
        full = list(hooks)
        lean = []
        for hook in full:
            if hook == threading._after_fork:  # noqa: SLF001 - the hook registered by threading
                continue
            lean.append(_c_reseed(hook) or hook)
        hooks[:] = lean
        return cls(hooks, full, lean)

    def restore(self) -> None:
        """In a child, before the call's code: the full list again, for the call's own forks."""
        self.hooks[:] = self.full
