"""What the API server answers with a ``Warning:`` (it stores the object anyway) for the pod
templates kuberl renders: the pod warning paths of kube-apiserver (pkg/api/pod/warnings.go)
that a field a user can set reaches.

* fractional byte values of memory and ephemeral-storage (``2500m`` of memory is 2.5 bytes);
* an env var defined twice in one container (the later hides the earlier, and apply may drop it);
* duplicate or empty imagePullSecrets names;
* ports: hostIP without hostPort, one port number and protocol twice, one name on two ports;
* a negative terminationGracePeriodSeconds (treated as 1);
* a topology spread constraint or pod affinity term with no labelSelector (matches no pod);
* deprecated volume types and the seccomp/AppArmor annotations the securityContext replaced.

Paths are the child's own, as the server writes them (containers by name, as ``apirules``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuberl.api.common import quantity_value
from kuberl.operator.validate.apirules import quantity_problem

BYTE_RESOURCES = ("memory", "ephemeral-storage")
DEPRECATED_VOLUMES = {
    "photonPersistentDisk": "deprecated in v1.11, non-functional in v1.16+",
    "gitRepo": "deprecated in v1.11, and disabled by default in v1.33+",
    "scaleIO": "deprecated in v1.16, non-functional in v1.22+",
    "flocker": "deprecated in v1.22, non-functional in v1.25+",
    "storageOS": "deprecated in v1.22, non-functional in v1.25+",
    "quobyte": "deprecated in v1.22, non-functional in v1.25+",
    "glusterfs": "deprecated in v1.25, non-functional in v1.26+",
    "cephfs": "deprecated in v1.28, non-functional in v1.31+",
    "rbd": "deprecated in v1.28, non-functional in v1.31+",
}
SECCOMP_POD = "seccomp.security.alpha.kubernetes.io/pod"
SECCOMP_CONTAINER = "container.seccomp.security.alpha.kubernetes.io/"
APPARMOR_CONTAINER = "container.apparmor.security.beta.kubernetes.io/"


def fractional_bytes(resources: Any, at: str, kinds: Iterable[str] = ("limits", "requests")) -> list[str]:
    """Byte quantities that are not a whole number of bytes."""
    out = []
    for kind in kinds:
        amounts = (resources or {}).get(kind) if kind else resources
        for name in BYTE_RESOURCES:
            value = (amounts or {}).get(name)
            if value is None or quantity_problem(value):
                continue  # absent, or refused as a quantity by apirules
            if quantity_value(value).denominator != 1:
                where = f"{at}.{kind}[{name}]" if kind else f"{at}[{name}]"
                out.append(f'{where}: fractional byte value "{value}" is invalid, must be an integer')
    return out


def _container_warnings(c: dict[str, Any], at: str) -> list[str]:
    out = fractional_bytes(c.get("resources"), f"{at}.resources")
    seen: set[str] = set()
    for i, item in enumerate(c.get("env") or []):
        name = item.get("name")
        if name in seen:
            out.append(f'{at}.env[{i}]: hides previous definition of "{name}", which may be dropped when using apply')
        seen.add(name)
    for i, port in enumerate(c.get("ports") or []):
        if port.get("hostIP") and not port.get("hostPort"):
            out.append(f"{at}.ports[{i}]: hostIP set without hostPort")
    return out


def _port_warnings(containers: list[tuple[str, dict[str, Any]]]) -> list[str]:
    by_number: dict[str, str] = {}
    by_name: dict[str, str] = {}
    out = []
    for at, c in containers:
        for i, port in enumerate(c.get("ports") or []):
            here = f"{at}.ports[{i}]"
            key = f"{port.get('containerPort')}/{port.get('protocol', 'TCP')}"
            if key in by_number:
                out.append(f"{here}: duplicate port definition with {by_number[key]}")
            by_number.setdefault(key, here)
            name = port.get("name")
            if name and name in by_name:
                out.append(
                    f'{here}: duplicate port name "{name}" with {by_name[name]}, services and probes that '
                    f"select ports by name will use {by_name[name]}"
                )
            if name:
                by_name.setdefault(name, here)
    return out


def _null_selectors(terms: Any, at: str, nested: bool) -> list[str]:
    out = []
    for i, term in enumerate(terms or []):
        inner = (term or {}).get("podAffinityTerm") if nested else term
        if isinstance(inner, dict) and inner.get("labelSelector") is None:
            sub = ".podAffinityTerm" if nested else ""
            out.append(f"{at}[{i}]{sub}.labelSelector: a null labelSelector results in matching no pod")
    return out


def _affinity_warnings(affinity: Any, where: str) -> list[str]:
    out = []
    for kind in ("podAffinity", "podAntiAffinity"):
        block = (affinity or {}).get(kind) or {}
        at = f"{where}.affinity.{kind}"
        out += _null_selectors(
            block.get("requiredDuringSchedulingIgnoredDuringExecution"),
            f"{at}.requiredDuringSchedulingIgnoredDuringExecution",
            nested=False,
        )
        out += _null_selectors(
            block.get("preferredDuringSchedulingIgnoredDuringExecution"),
            f"{at}.preferredDuringSchedulingIgnoredDuringExecution",
            nested=True,
        )
    return out


def pod_spec_warnings(spec: dict[str, Any], where: str) -> list[str]:
    """The server's warnings for one PodSpec at ``where`` (e.g. ``spec.template.spec``)."""
    containers = [(f"{where}.containers[{c.get('name', i)}]", c) for i, c in enumerate(spec.get("containers") or [])]
    containers += [
        (f"{where}.initContainers[{c.get('name', i)}]", c) for i, c in enumerate(spec.get("initContainers") or [])
    ]
    out = fractional_bytes(spec.get("overhead"), f"{where}.overhead", kinds=("",))
    for at, c in containers:
        out += _container_warnings(c, at)
    out += _port_warnings(containers)
    seen: set[str] = set()
    for i, secret in enumerate(spec.get("imagePullSecrets") or []):
        name = (secret or {}).get("name") or ""
        if not name:
            out.append(f'{where}.imagePullSecrets[{i}].name: invalid empty name ""')
        elif name in seen:
            out.append(f'{where}.imagePullSecrets[{i}].name: duplicate name "{name}"')
        seen.add(name)
    grace = spec.get("terminationGracePeriodSeconds")
    if isinstance(grace, int) and grace < 0:
        out.append(
            f"{where}.terminationGracePeriodSeconds: must be >= 0; negative values are invalid and will be treated as 1"
        )
    out += _null_selectors(spec.get("topologySpreadConstraints"), f"{where}.topologySpreadConstraints", nested=False)
    out += _affinity_warnings(spec.get("affinity"), where)
    for i, vol in enumerate(spec.get("volumes") or []):
        for kind, why in DEPRECATED_VOLUMES.items():
            if kind in vol:
                out.append(f"{where}.volumes[{i}].{kind}: {why}")
    return out


def _template_warnings(template: dict[str, Any], where: str) -> list[str]:
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    out = []
    for key in sorted(annotations):
        if key == SECCOMP_POD or key.startswith(SECCOMP_CONTAINER):
            out.append(
                f'{where}.metadata.annotations[{key}]: non-functional in v1.27+; use the "seccompProfile" field instead'
            )
        elif key.startswith(APPARMOR_CONTAINER):
            out.append(
                f'{where}.metadata.annotations[{key}]: deprecated since v1.30; use the "appArmorProfile" field instead'
            )
    return out + pod_spec_warnings(template.get("spec") or {}, f"{where}.spec")


def object_warnings(obj: dict[str, Any]) -> list[str]:
    """``Kind/name: path: text`` for every warning the server gives on creating ``obj``."""
    kind, spec = obj.get("kind", "?"), obj.get("spec") or {}
    what = f"{kind}/{(obj.get('metadata') or {}).get('name', '')}"
    templates: list[tuple[dict[str, Any], str]] = []
    if kind in ("Deployment", "Job"):
        templates.append((spec.get("template") or {}, "spec.template"))
    elif kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        templates += [(lwt[p], f"spec.leaderWorkerTemplate.{p}") for p in ("leaderTemplate", "workerTemplate") if p in lwt]
    return [f"{what}: {w}" for template, at in templates for w in _template_warnings(template, at)]
