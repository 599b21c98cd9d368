"""The operator's periodic log line: what it manages, by kind and phase, and where running jobs are.

kopf logs each handler run, but nothing says how the whole picture stands; whoever reads the
operator's log (``kubectl logs deploy/kuberl-operator``) gets one line after a resync pass in
which something changed, and at least every few minutes. Pure: objects in, text out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

KIND_ORDER = ("AgenticRLJob", "RolloutFleet", "SandboxPool")
MAX_JOBS_NAMED = 5


def summary_line(objects: Iterable[dict[str, Any]]) -> str:
    """``AgenticRLJob 2 (Running 1, Succeeded 1: ml/a rl step 312 reward 0.41); RolloutFleet 1
    (Ready 1; 2/2 replicas ready); ...``: counts by phase, replicas of the scaled kinds, and the
    stage, step and reward of up to five running jobs."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj.get("kind", "?"), []).append(obj)
    if not by_kind:
        return "resync: no kuberl objects"
    parts = []
    for kind in [*KIND_ORDER, *sorted(set(by_kind) - set(KIND_ORDER))]:
        objs = by_kind.get(kind)
        if not objs:
            continue
        phases = Counter((o.get("status") or {}).get("phase") or "New" for o in objs)
        text = f"{kind} {len(objs)} (" + ", ".join(f"{p} {n}" for p, n in sorted(phases.items()))
        if kind == "AgenticRLJob":
            running = [o for o in objs if (o.get("status") or {}).get("phase") == "Running"]
            named = [_job(o) for o in sorted(running, key=_key)[:MAX_JOBS_NAMED]]
            if named:
                text += ": " + ", ".join(named) + (", ..." if len(running) > MAX_JOBS_NAMED else "")
        else:
            ready = sum(int((o.get("status") or {}).get("readyReplicas") or 0) for o in objs)
            want = sum(int((o.get("spec") or {}).get("replicas") or 0) for o in objs)
            text += f"; {ready}/{want} replicas ready"
        parts.append(text + ")")
    return "resync: " + "; ".join(parts)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def _job(obj: dict[str, Any]) -> str:
    ns, name = _key(obj)
    st = obj.get("status") or {}
    reward = (st.get("summary") or {}).get("rewardMean")
    text = f"{ns}/{name}"
    if st.get("stage") is not None:
        text += f" {st['stage']} step {st.get('step', '-')}"
    if isinstance(reward, (int, float)):
        text += f" reward {reward:.2f}"
    return text
