"""Validation of every manifest the builders emit, including the non-built-in kinds.

Built-in kinds go through ``kubernetes_validate`` (the upstream OpenAPI schemas, strict: an
unknown field is an error). Custom resources cannot be validated that way:

* kuberl kinds are validated against the CRDs generated into ``crds/`` (the same
  openAPIV3Schema the API server enforces; ``exclusiveMinimum: true`` is draft-4 style);
* LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) and KEDA ScaledObject (keda.sh/v1alpha1) are
  validated against the subsets of their upstream CRD schemas written down below from the
  projects' API references; their embedded pod templates are validated strictly as
  core/v1 PodTemplates.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kuberl.api.group import GROUP

CRD_DIR = Path(__file__).resolve().parent.parent / "crds"  # the checkout's generated CRDs
K8S_VERSION = "1.33"

_STR = {"type": "string"}
_INT = {"type": "integer"}
_OBJ = {"type": "object"}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _STR,
        "namespace": _STR,
        "labels": _OBJ,
        "annotations": _OBJ,
        "ownerReferences": {},
    },
}

# sigs.k8s.io/lws api/leaderworkerset/v1 (LeaderWorkerSetSpec, LeaderWorkerTemplate, RolloutStrategy).
LWS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": ["leaderworkerset.x-k8s.io/v1"]},
        "kind": {"enum": ["LeaderWorkerSet"]},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {
                    "type": "object",
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "maxUnavailable": {"type": ["integer", "string"]},
                                "maxSurge": {"type": ["integer", "string"]},
                            },
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "subGroupPolicy": {"type": "object", "properties": {"subGroupSize": _INT}},
                        "leaderTemplate": _OBJ,
                        "workerTemplate": _OBJ,
                    },
                },
            },
        },
    },
}

_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "additionalProperties": False,
    "properties": {
        "type": _STR,
        "name": _STR,
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "useCachedMetrics": {"type": "boolean"},
        "metadata": {"type": "object", "additionalProperties": _STR},
        "authenticationRef": {"type": "object", "properties": {"name": _STR, "kind": _STR}},
    },
}
# keda.sh/v1alpha1 ScaledObjectSpec (https://keda.sh/docs/latest/reference/scaledobject-spec/).
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": ["keda.sh/v1alpha1"]},
        "kind": {"enum": ["ScaledObject"]},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": _STR,
                        "kind": _STR,
                        "name": _STR,
                        "envSourceContainerName": _STR,
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": _OBJ,
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": _STR, "behavior": _OBJ},
                        },
                        "scalingModifiers": _OBJ,
                    },
                },
                "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
            },
        },
    },
}


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of a generated kuberl CRD, by kind."""
    for path in sorted(CRD_DIR.glob(f"*.{GROUP}.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise KeyError(f"no generated CRD for kind {kind!r} in {CRD_DIR}")


def _check(schema: dict[str, Any], obj: dict[str, Any], what: str) -> None:
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise ValueError(f"{what} is invalid:\n  " + "\n  ".join(lines))


def _check_pod_template(template: dict[str, Any], what: str) -> None:
    import kubernetes_validate

    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "check"},
        "template": template,
    }
    try:
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise ValueError(f"{what}: pod template is invalid: {err}") from None


def validate_manifest(obj: dict[str, Any]) -> None:
    """Raise ValueError (with the failing paths) unless ``obj`` is a valid object of its kind."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    what = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    if api_version.startswith(f"{GROUP}/"):
        _check(crd_schema(kind), obj, what)
    elif api_version == "leaderworkerset.x-k8s.io/v1":
        _check(LWS_SCHEMA, obj, what)
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                _check_pod_template(lwt[key], f"{what} {key}")
    elif api_version == "keda.sh/v1alpha1":
        _check(SCALED_OBJECT_SCHEMA, obj, what)
    else:
        import kubernetes_validate

        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise ValueError(f"{what} is invalid: {err}") from None
