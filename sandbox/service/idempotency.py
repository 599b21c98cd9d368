"""What makes a retried call answer its first result instead of running again.

A call is known by ``(op, id)`` (an execute and a verify may share an id without meeting)
plus a digest of its payload: the same key with a different payload is a client bug that
must not be answered with someone else's result, so it is refused as a conflict. Answers
are remembered for ``ttl_s`` and within a count and a byte budget (a few huge outputs
must not hold the service's memory); the oldest go first.

Exactly-once holds per service process: a SandboxPool's Kubernetes Service spreads
connections over pods, and a retry that lands on another pod runs the call there again
(the caller still gets exactly one answer).
"""

from __future__ import annotations

import collections
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str]


class Conflict(ValueError):
    """The id was already used for a different payload."""


def payload_digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class _Entry:
    digest: str
    value: Any
    size: int
    expires: float


class ResultMemory:
    """Remembered answers by key, bounded by count, bytes and age."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.nbytes = 0
        self._entries: collections.OrderedDict[Key, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def recall(self, key: Key, digest: str) -> tuple[bool, Any]:
        """(True, answer) for a remembered key; raises Conflict for a different payload."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if entry.digest != digest:
            raise Conflict(f"{key[0]} id {key[1]!r} was already used for a different call")
        return True, entry.value

    def remember(self, key: Key, digest: str, value: Any, size: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.size
        self._entries[key] = _Entry(digest, value, size, self.clock() + self.ttl_s)
        self.nbytes += size
        self._expire()
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self._drop_oldest()

    def _expire(self) -> None:
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.size


def answer_size(value: Any) -> int:
    """Approximate bytes one remembered answer holds (its texts plus bookkeeping). A flat dict
    of texts and scalars (every answer the service keeps) is measured in memory, without
    serialising it (``sys.getsizeof``: a text of wide characters counts what it holds)."""
    if isinstance(value, dict) and all(
        isinstance(v, str | bool | int | float | None) for v in value.values()
    ):
        return 200 + sum(len(k) + (sys.getsizeof(v) if isinstance(v, str) else 8) for k, v in value.items())
    return len(json.dumps(value)) + 200
