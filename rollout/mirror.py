"""A remote rollout worker's per-engine metrics, mirrored into this process's registry.

Under Ray the Scheduler's and engines' ``kuberl_rollout_*`` series live in the actor's
registry, which nothing serves; the driver polls ``RolloutWorker.rollout_metrics()`` and
:class:`RolloutMirror` copies the snapshot into the registry this process exports.
"""

from __future__ import annotations

from typing import Any

from kuberl.rollout.engine import GENERATED_TOKENS
from kuberl.rollout.scheduler import KV_UTILIZATION, REQUESTS_INFLIGHT, REQUESTS_WAITING


class RolloutMirror:
    """Copies a remote rollout worker's per-engine metrics into this process's registry.

    ``apply`` takes ``RolloutWorker.rollout_metrics()``: gauges are set to the reported values,
    the generated-tokens counter advances by what the engine generated since the last call
    (an engine whose total went down was restarted: its whole new total counts).
    """

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def apply(self, snapshot: list[dict[str, Any]]) -> None:
        for row in snapshot:
            name = row["engine"]
            KV_UTILIZATION.labels(engine=name).set(row["kv_cache_utilization"])
            REQUESTS_INFLIGHT.labels(engine=name).set(row["requests_inflight"])
            if "requests_waiting" in row:
                REQUESTS_WAITING.set(row["requests_waiting"])
            total = row.get("generated_tokens")
            if total is None:
                continue
            last = self._seen.get(name, 0)
            GENERATED_TOKENS.labels(engine=name).inc(total - last if total >= last else total)
            self._seen[name] = total
