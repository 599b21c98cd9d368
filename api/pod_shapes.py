"""The JSON types of a core/v1 PodSpec, for ``podTemplate`` overrides (pure).

The CRDs keep a podTemplate's spec free-form (the PodSpec schema would triple their size), so
the API server's own type check happens only when the rendered child is written: ``tolerations:
all`` or ``env: ["A=B"]`` passed `kuberl validate` and then crashed its rule checks (and the
operator's pre-flight) on a string where a list of objects belongs. ``shape_problems`` checks the
types of every field kuberl or its rules read, the way the API server's decoder would refuse
them ("must be a list of objects (got str 'all')"); fields it does not list are left to the
server.
"""

from __future__ import annotations

from typing import Any

Shape = Any  # "str" | "int" | "bool" | "object" | ("list", Shape) | ("map", Shape) | dict[str, Shape]

_STRS = ("list", "str")
_SELECTOR: dict[str, Shape] = {
    "matchLabels": ("map", "str"),
    "matchExpressions": ("list", {"key": "str", "operator": "str", "values": _STRS}),
}
_NODE_TERM: dict[str, Shape] = {
    "matchExpressions": ("list", {"key": "str", "operator": "str", "values": _STRS}),
    "matchFields": ("list", {"key": "str", "operator": "str", "values": _STRS}),
}
_POD_TERM: dict[str, Shape] = {
    "labelSelector": _SELECTOR,
    "namespaceSelector": _SELECTOR,
    "namespaces": _STRS,
    "topologyKey": "str",
}
_POD_AFFINITY: dict[str, Shape] = {
    "requiredDuringSchedulingIgnoredDuringExecution": ("list", _POD_TERM),
    "preferredDuringSchedulingIgnoredDuringExecution": ("list", {"weight": "int", "podAffinityTerm": _POD_TERM}),
}
_KEY_REF: dict[str, Shape] = {"name": "str", "key": "str", "optional": "bool"}
_ITEMS = ("list", {"key": "str", "path": "str", "mode": "int"})
_SECURITY: dict[str, Shape] = {
    "runAsUser": "int",
    "runAsGroup": "int",
    "runAsNonRoot": "bool",
    "fsGroup": "int",
    "supplementalGroups": ("list", "int"),
    "seccompProfile": {"type": "str", "localhostProfile": "str"},
    "capabilities": {"add": _STRS, "drop": _STRS},
    "privileged": "bool",
    "allowPrivilegeEscalation": "bool",
    "readOnlyRootFilesystem": "bool",
}
_CONTAINER: dict[str, Shape] = {
    "name": "str",
    "image": "str",
    "imagePullPolicy": "str",
    "command": _STRS,
    "args": _STRS,
    "workingDir": "str",
    "env": (
        "list",
        {
            "name": "str",
            "value": "str",
            "valueFrom": {
                "secretKeyRef": _KEY_REF,
                "configMapKeyRef": _KEY_REF,
                "fieldRef": {"fieldPath": "str", "apiVersion": "str"},
                "resourceFieldRef": {"resource": "str", "containerName": "str"},
            },
        },
    ),
    "envFrom": ("list", {"prefix": "str", "secretRef": _KEY_REF, "configMapRef": _KEY_REF}),
    "ports": ("list", {"name": "str", "containerPort": "int", "protocol": "str", "hostPort": "int"}),
    "resources": {"requests": ("map", "quantity"), "limits": ("map", "quantity")},
    "volumeMounts": ("list", {"name": "str", "mountPath": "str", "subPath": "str", "readOnly": "bool"}),
    "securityContext": _SECURITY,
    "livenessProbe": "object",
    "readinessProbe": "object",
    "startupProbe": "object",
    "lifecycle": "object",
    "terminationMessagePolicy": "str",
}
_VOLUME: dict[str, Shape] = {
    "name": "str",
    "emptyDir": {"medium": "str", "sizeLimit": "quantity"},
    "secret": {"secretName": "str", "items": _ITEMS, "optional": "bool", "defaultMode": "int"},
    "configMap": {"name": "str", "items": _ITEMS, "optional": "bool", "defaultMode": "int"},
    "persistentVolumeClaim": {"claimName": "str", "readOnly": "bool"},
    "hostPath": {"path": "str", "type": "str"},
}
POD_SPEC: dict[str, Shape] = {
    "containers": ("list", _CONTAINER),
    "initContainers": ("list", _CONTAINER),
    "volumes": ("list", _VOLUME),
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": ("list", _NODE_TERM)},
            "preferredDuringSchedulingIgnoredDuringExecution": ("list", {"weight": "int", "preference": _NODE_TERM}),
        },
        "podAffinity": _POD_AFFINITY,
        "podAntiAffinity": _POD_AFFINITY,
    },
    "tolerations": (
        "list",
        {"key": "str", "operator": "str", "value": "str", "effect": "str", "tolerationSeconds": "int"},
    ),
    "nodeSelector": ("map", "str"),
    "topologySpreadConstraints": (
        "list",
        {"maxSkew": "int", "topologyKey": "str", "whenUnsatisfiable": "str", "labelSelector": _SELECTOR},
    ),
    "hostAliases": ("list", {"ip": "str", "hostnames": _STRS}),
    "imagePullSecrets": ("list", {"name": "str"}),
    "securityContext": _SECURITY,
    "priorityClassName": "str",
    "schedulerName": "str",
    "runtimeClassName": "str",
    "serviceAccountName": "str",
    "dnsPolicy": "str",
    "terminationGracePeriodSeconds": "int",
    "activeDeadlineSeconds": "int",
    "hostNetwork": "bool",
    "hostPID": "bool",
    "hostIPC": "bool",
    "dnsConfig": "object",
}
_NAMES = {"str": "a string", "int": "an integer", "bool": "true or false", "object": "an object",
          "quantity": "a quantity (a string such as 16Gi, or a number)"}  # fmt: skip


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _want(shape: Shape) -> str:
    if isinstance(shape, str):
        return _NAMES[shape]
    if isinstance(shape, tuple):
        inner = _want(shape[1]).removeprefix("a ").removeprefix("an ")
        return f"a list of {inner}s" if shape[0] == "list" else f"a map of {inner}s"
    return "an object"


def _fits(value: Any, shape: Shape) -> bool:
    if shape == "str":
        return isinstance(value, str)
    if shape == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if shape == "bool":
        return isinstance(value, bool)
    if shape == "quantity":
        return isinstance(value, str | int | float) and not isinstance(value, bool)
    if isinstance(shape, tuple):
        return isinstance(value, list) if shape[0] == "list" else isinstance(value, dict)
    return isinstance(value, dict)  # "object" or a dict of fields


def shape_problems(value: Any, shape: Shape, where: str) -> list[str]:
    """Where ``value`` does not have the JSON types of ``shape`` (null counts as absent)."""
    if value is None:
        return []
    if not _fits(value, shape):
        return [f"{where}: must be {_want(shape)} (got {_short(value)})"]
    if isinstance(shape, tuple):
        items = enumerate(value) if shape[0] == "list" else value.items()
        return [
            p
            for k, v in items
            for p in (
                [f"{where}[{k}]: must be {_want(shape[1])} (got null)"]  # an empty item, not an absent field
                if v is None
                else shape_problems(v, shape[1], f"{where}[{k}]")
            )
        ]
    if isinstance(shape, dict):
        return [p for k, sub in shape.items() if k in value for p in shape_problems(value[k], sub, f"{where}.{k}")]
    return []
