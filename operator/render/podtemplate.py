"""Merge a component's ``podTemplate`` override over the pod template the operator renders (pure).

The rules are those of a Kubernetes strategic merge patch on a PodSpec, with two additions that
make "extra" scheduling constraints possible without restating kuberl's own:

* maps merge key by key, recursively; the override's scalars win; ``null`` removes a key;
* lists of named things merge item by item on their key: containers, initContainers,
  ephemeralContainers, volumes, env and imagePullSecrets by ``name``, volumeMounts by
  ``mountPath``, ports by ``containerPort``; an item with a new key is appended;
* tolerations, envFrom, topologySpreadConstraints and readinessGates are appended (kuberl's GPU
  taint toleration stays when a user tolerates another taint);
* any other list (command, args, nodeSelectorTerms, ...) is replaced as a whole.

Labels and annotations of the template are merged the same way (the selector labels cannot be
overridden: ``api.pod_template`` refuses them).
"""

from __future__ import annotations

import copy
from typing import Any

from kuberl.api.pod_template import PodTemplateOverride

MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
APPENDED = frozenset({"tolerations", "envFrom", "topologySpreadConstraints", "readinessGates"})


def merge(base: Any, override: Any, field: str | None = None) -> Any:
    """``override`` merged over ``base`` (neither is modified)."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for key, value in override.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value, key)
        return out
    if isinstance(base, list) and isinstance(override, list):
        if field in MERGE_KEYS:
            key = MERGE_KEYS[field]
            out = copy.deepcopy(base)
            index = {item.get(key): i for i, item in enumerate(out) if isinstance(item, dict)}
            for item in override:
                at = index.get(item.get(key)) if isinstance(item, dict) else None
                if at is None:
                    out.append(copy.deepcopy(item))
                else:
                    out[at] = merge(out[at], item)
            return out
        if field in APPENDED:
            return copy.deepcopy(base) + [copy.deepcopy(i) for i in override if i not in base]
    return copy.deepcopy(override)


def apply(template: dict[str, Any], override: PodTemplateOverride | None) -> dict[str, Any]:
    """A rendered PodTemplateSpec (``metadata`` + ``spec``) with ``override`` merged over it."""
    if override is None:
        return template
    out = copy.deepcopy(template)
    meta = out.setdefault("metadata", {})
    for part in ("labels", "annotations"):
        extra = getattr(override.metadata, part)
        if extra:
            meta[part] = {**meta.get(part, {}), **extra}
    out["spec"] = merge(out.get("spec") or {}, override.spec)
    return out
