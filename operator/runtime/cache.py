"""An informer-like read cache for the operator's REST client: one LIST per kind and namespace
per resync pass instead of a GET per child and a LIST per child kind per object.

Without it a resync pass costs several reads per object, growing with the number of objects.
With it, the first read of a kind in a
namespace after ``invalidate`` LISTs that kind once (children and pods: only kuberl's, by the
``app.kubernetes.io/name=kuberl`` label every child and pod carries; kuberl's own kinds: all),
and every later GET or label-selected LIST of it is answered from memory. The client's own
writes go into the cache as the API server answered them, so a pass sees what it created,
patched or deleted. The resync and autoscale loops invalidate at the start of each pass, so no
read is older than one pass; anything that must not be (admission's reference checks) asks for
``fresh`` reads.

Pure bookkeeping here (no I/O): ``KubeClient`` decides when to load.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Every child and every pod of one carries it (render_common.selector_labels is in every label set).
KUBERL_SELECTOR = {"app.kubernetes.io/name": "kuberl"}

Key = tuple[str, str, str]  # (apiVersion, kind, namespace)


def selects(labels: dict[str, str] | None, selector: dict[str, str] | None) -> bool:
    """Equality-based label selection (all the operator uses)."""
    have = labels or {}
    return all(have.get(k) == v for k, v in (selector or {}).items())


@dataclass
class ListCache:
    """Objects per (apiVersion, kind, namespace), each loaded by one LIST with ``selector``."""

    # kind -> the selector its LIST uses; kinds not here are never cached
    selectors: dict[tuple[str, str], dict[str, str]]
    _store: dict[Key, dict[str, dict[str, Any]]] = field(default_factory=dict)
    missing_kinds: set[tuple[str, str]] = field(default_factory=set)  # not served (404 on LIST)

    def cacheable(self, api_version: str, kind: str) -> bool:
        return (api_version, kind) in self.selectors

    def loaded(self, key: Key) -> bool:
        return key in self._store

    def load(self, key: Key, items: Iterable[dict[str, Any]]) -> None:
        self._store[key] = {o["metadata"]["name"]: copy.deepcopy(o) for o in items}

    def get(self, key: Key, name: str) -> dict[str, Any] | None:
        obj = self._store[key].get(name)
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, key: Key, labels: dict[str, str] | None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for _, o in sorted(self._store[key].items())
            if selects((o.get("metadata") or {}).get("labels"), labels)
        ]

    def put(self, key: Key, obj: dict[str, Any]) -> None:
        """Record a write's answer (only into a loaded list, and only what its LIST would show)."""
        if key not in self._store:
            return
        name = obj["metadata"]["name"]
        selector = self.selectors.get(key[:2])
        if selects((obj.get("metadata") or {}).get("labels"), selector):
            self._store[key][name] = copy.deepcopy(obj)
        else:
            self._store[key].pop(name, None)

    def drop(self, key: Key, name: str) -> None:
        if key in self._store:
            self._store[key].pop(name, None)

    def invalidate(self, kinds: Iterable[tuple[str, str]] | None = None) -> None:
        """Forget everything (or the given kinds): their next read LISTs again."""
        if kinds is None:
            self._store.clear()
            self.missing_kinds.clear()
            return
        wanted = set(kinds)
        for key in [k for k in self._store if k[:2] in wanted]:
            del self._store[key]
        self.missing_kinds -= wanted
