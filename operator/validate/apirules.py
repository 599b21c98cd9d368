"""What a real API server refuses in the built-in objects kuberl creates, as pure functions.

The OpenAPI schema says which fields exist and their types; the API server
also runs each kind's Go validation, which a schema check misses and which refuses objects
that look fine: a Service named ``7b-fleet`` (Service names are RFC 1035 labels and must start
with a letter), a Job whose pods' hostnames pass 63 characters, ``memory: lots``, a memory
request above its limit. ``object_problems`` is that validation for the kinds and fields
kuberl emits, so that

* ``kuberl validate`` renders a manifest's children and refuses what the API would refuse,
  before anything is created;
* the operator checks the same before applying anything (no Deployment holding GPUs while its
  Service is refused), and reports it in ``status.conditions``;
* the unit tests' API emulator (harness/kube_emulator.py) answers 422 where the API server would;
  tests/test_k8s_validate.py holds these rules to a real API server's.

Each problem is one line naming the object and the field, in the API server's words where
they are clear.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from kuberl.operator.validate.canonical import parse_quantity
from kuberl.operator.validate.podrules import annotation_problems, pod_extras_problems

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
STANDARD_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage", "storage", "pods"})
STATEFULSET_NAME_MAX = 52
"""A StatefulSet's pods carry ``controller-revision-hash: <name>-<10 chars>``, a 63-char label."""

# Kinds whose name becomes a DNS label (Services) or a label value on their pods.
_RFC1035_KINDS = frozenset({"Service", "LeaderWorkerSet"})
_LABEL_NAME_KINDS = frozenset({"Job"})  # batch.kubernetes.io/job-name=<name> on every pod


def name_problem(kind: str, name: str) -> str | None:
    """Why ``name`` is not a valid ``metadata.name`` for ``kind`` (None: it is)."""
    if kind in _RFC1035_KINDS:
        if len(name) > 63:
            return f"must be no more than 63 characters (got {len(name)}: {name!r})"
        if not DNS1035_LABEL.match(name):
            return (
                f"{name!r} is not an RFC 1035 label: lowercase letters, digits and '-', starting with "
                "a letter and ending with a letter or digit"
            )
        return None
    if kind in _LABEL_NAME_KINDS and len(name) > 63:
        return f"must be no more than 63 characters, as it becomes a label value (got {len(name)}: {name!r})"
    if kind == "StatefulSet" and len(name) > STATEFULSET_NAME_MAX:
        return f"must be no more than {STATEFULSET_NAME_MAX} characters (got {len(name)}: {name!r})"
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        return (
            f"{name!r} is not a DNS subdomain: at most 253 characters of lowercase letters, digits, "
            "'-' and '.', starting and ending with a letter or digit"
        )
    return None


def label_problems(labels: dict[str, Any] | None, where: str) -> list[str]:
    out = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))) or (
            len(name) > 63 or not QUALIFIED_NAME.match(name)
        ):
            out.append(f"{where}: label key {key!r} is not a qualified name")
        if not isinstance(value, str):
            out.append(f"{where}[{key}]: label values must be strings (got {value!r})")
        elif len(value) > 63 or not LABEL_VALUE.match(value):
            out.append(
                f"{where}[{key}]: label value {value!r} must be at most 63 characters of letters, digits, "
                "'-', '_' and '.', starting and ending with a letter or digit"
            )
    return out


def quantity_problem(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return f"{value!r} is not a quantity"
    try:
        amount, _ = parse_quantity(value)
    except ValueError:
        return (
            f"{value!r} is not a quantity: a number with an optional suffix (m, k, M, G, Ki, Mi, Gi, ...), "
            "e.g. 500m, 2, 16Gi"
        )
    if amount < 0:
        return f"{value!r} must be greater than or equal to 0"
    return None


def _resource_name_problem(name: str) -> str | None:
    if name in STANDARD_RESOURCES or name.startswith("hugepages-") or "/" in name:
        prefix, _, rest = name.partition("/")
        if "/" in name and (not DNS1123_SUBDOMAIN.match(prefix) or not QUALIFIED_NAME.match(rest)):
            return f"{name!r} is not a valid resource name"
        return None
    return (
        f"{name!r} is not a standard resource (cpu, memory, ephemeral-storage, hugepages-<size>) nor "
        "a fully qualified one such as amd.com/gpu"
    )


def _extended(name: str) -> bool:
    """An extended resource (amd.com/gpu): counted in whole units, requested at its limit."""
    return "/" in name and not name.startswith("kubernetes.io/")


def _hugepages(name: str) -> bool:
    """hugepages-<size>: native, but like an extended resource never overcommitted."""
    return name.startswith("hugepages-")


def _hugepage_problem(name: str, value: Fraction, written: Any) -> str | None:
    """A hugepages amount must be a whole number of its pages (the server rounds it up to bytes)."""
    try:
        page = parse_quantity(name.removeprefix("hugepages-"))[0]
    except ValueError:
        page = Fraction(0)
    if page <= 0 or page.denominator != 1:
        return f"{name!r} does not name a page size (hugepages-2Mi, hugepages-1Gi)"
    if math.ceil(value) % page:
        return f"{written} is not positive integer multiple of {name}"
    return None


def resources_problems(res: dict[str, Any] | None, where: str) -> list[str]:
    """core/v1 ResourceRequirements: names, quantities, requests <= limits, and what is never
    overcommitted -- extended resources (anything with a domain, like amd.com/gpu) and hugepages --
    requested exactly at their limit; hugepages in whole pages."""
    out: list[str] = []
    parsed: dict[str, dict[str, Any]] = {}
    for part in ("requests", "limits"):
        values = (res or {}).get(part) or {}
        if not isinstance(values, dict):
            out.append(f"{where}.{part}: must be a map of resource name to quantity")
            continue
        parsed[part] = {}
        for name, value in values.items():
            problem = _resource_name_problem(name) or quantity_problem(value)
            if problem:
                out.append(f"{where}.{part}[{name}]: {problem}")
            else:
                parsed[part][name] = parse_quantity(value)[0]
    requests, limits = parsed.get("requests", {}), parsed.get("limits", {})
    for part, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            if _hugepages(name) and (problem := _hugepage_problem(name, value, (res or {})[part][name])):
                out.append(f"{where}.{part}[{name}]: {problem}")
    named = set(requests) | set(limits)
    if any(_hugepages(n) for n in named) and not named & {"cpu", "memory"}:
        out.append(f"{where}: Forbidden: HugePages require cpu or memory")
    for name, lim in limits.items():
        if _extended(name) and lim.denominator != 1:
            out.append(f"{where}.limits[{name}]: must be an integer (extended resource)")
    for name, req in requests.items():
        lim = limits.get(name)
        extended = _extended(name)
        if _hugepages(name) and lim is not None and req != lim:
            out.append(
                f"{where}.requests[{name}]: must be equal to {name} limit (hugepages are never overcommitted)"
            )
        elif _hugepages(name) and lim is None:
            out.append(f"{where}.limits[{name}]: Limit must be set for non overcommitable resources ({name})")
        if lim is not None and req > lim and not _hugepages(name):
            out.append(f"{where}.requests[{name}]: must be less than or equal to {name} limit")
        if extended and req.denominator != 1:
            out.append(f"{where}.requests[{name}]: must be a whole number (extended resource)")
        if extended and lim is not None and req != lim:
            out.append(f"{where}.requests[{name}]: must be equal to {name} limit (extended resource)")
        if extended and lim is None:
            out.append(f"{where}.limits[{name}]: extended resource {name} needs a limit equal to its request")
    return out


def _keyed_duplicates(items: Iterable[dict[str, Any]], key: str, where: str) -> list[str]:
    seen: set[Any] = set()
    out = []
    for item in items:
        value = item.get(key)
        if value in seen:
            out.append(f"{where}: duplicate {key} {value!r}")
        seen.add(value)
    return out


IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _container_extras(c: dict[str, Any], at: str) -> list[str]:
    """Env names, ports and the image string, as the API server checks them."""
    out = []
    image = c.get("image")
    if isinstance(image, str) and image != image.strip():
        out.append(f"{at}.image: must not have leading or trailing whitespace")
    for e in c.get("env") or []:
        name = str(e.get("name", ""))
        if not name or "=" in name or not name.isprintable():
            out.append(f"{at}.env[{name}]: a valid environment variable name must consist of printable "
                       "characters other than '='")
    names = [p.get("name") for p in c.get("ports") or [] if p.get("name")]
    out += [f"{at}.ports[{i}].name: Duplicate value: {n!r}" for i, n in enumerate(names) if n in names[:i]]
    for i, p in enumerate(c.get("ports") or []):
        port = p.get("containerPort")
        if not isinstance(port, int) or not 1 <= port <= 65535:
            out.append(f"{at}.ports[{i}].containerPort: {port!r} must be between 1 and 65535")
        name = p.get("name")
        if name is not None and (
            len(name) > 15 or not IANA_SVC_NAME.match(name) or "--" in name or not re.search("[a-z]", name)
        ):
            out.append(f"{at}.ports[{i}].name: port name {name!r} must be an IANA service name (at most 15 "
                       "characters of a-z, 0-9 and '-', with a letter)")
    return out


def _scheduling_problems(spec: dict[str, Any], where: str) -> list[str]:
    out = label_problems(spec.get("nodeSelector"), f"{where}.nodeSelector")
    for i, t in enumerate(spec.get("tolerations") or []):
        op = t.get("operator", "Equal")
        if op not in TOLERATION_OPERATORS:
            out.append(f"{where}.tolerations[{i}].operator: must be Exists or Equal (got {op!r})")
        if op == "Exists" and t.get("value"):
            out.append(f"{where}.tolerations[{i}].operator: value must be empty when operator is Exists")
        if t.get("effect") and t["effect"] not in TAINT_EFFECTS:
            out.append(f"{where}.tolerations[{i}].effect: must be one of {', '.join(TAINT_EFFECTS)}")
        if not t.get("key") and op != "Exists":
            out.append(f"{where}.tolerations[{i}]: an empty key needs operator Exists")
    for field in ("priorityClassName", "serviceAccountName"):
        value = spec.get(field)
        if value is not None and (not isinstance(value, str) or not DNS1123_SUBDOMAIN.match(value)):
            out.append(f"{where}.{field}: {value!r} is not a DNS subdomain")
    for i, s in enumerate(spec.get("imagePullSecrets") or []):
        if not DNS1123_SUBDOMAIN.match(str(s.get("name", ""))):
            out.append(f"{where}.imagePullSecrets[{i}].name: {s.get('name')!r} is not a DNS subdomain")
    return out


def pod_spec_problems(spec: dict[str, Any], where: str) -> list[str]:
    """A PodSpec: container and volume names, images, resources, emptyDir sizes, mounts, env
    names, ports, tolerations, nodeSelector."""
    out: list[str] = _scheduling_problems(spec, where)
    volumes = spec.get("volumes") or []
    out += _keyed_duplicates(volumes, "name", f"{where}.volumes")
    names = {v.get("name") for v in volumes}
    for i, vol in enumerate(volumes):
        if not DNS1123_LABEL.match(str(vol.get("name", ""))) or len(str(vol.get("name"))) > 63:
            out.append(f"{where}.volumes[{i}].name: {vol.get('name')!r} is not an RFC 1123 label")
        size = (vol.get("emptyDir") or {}).get("sizeLimit")
        if size is not None and (problem := quantity_problem(size)):
            out.append(f"{where}.volumes[{i}].emptyDir.sizeLimit: {problem}")
    containers = [("containers", c) for c in spec.get("containers") or []]
    containers += [("initContainers", c) for c in spec.get("initContainers") or []]
    if not spec.get("containers"):
        out.append(f"{where}.containers: Required value")
    out += _keyed_duplicates((c for _, c in containers), "name", f"{where}.containers")
    for i, (field, c) in enumerate(containers):
        at = f"{where}.{field}[{c.get('name', i)}]"
        if not DNS1123_LABEL.match(str(c.get("name", ""))) or len(str(c.get("name"))) > 63:
            out.append(f"{at}.name: {c.get('name')!r} is not an RFC 1123 label")
        if not c.get("image"):
            out.append(f"{at}.image: Required value")
        out += resources_problems(c.get("resources"), f"{at}.resources")
        out += _keyed_duplicates(c.get("volumeMounts") or [], "mountPath", f"{at}.volumeMounts")
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in names:
                out.append(f"{at}.volumeMounts[{m.get('name')}]: volume {m.get('name')!r} not found")
        out += _keyed_duplicates(c.get("env") or [], "name", f"{at}.env")
        out += _container_extras(c, at)
    return out + pod_extras_problems(spec, where)


def _template_problems(template: dict[str, Any], where: str) -> list[str]:
    meta = template.get("metadata") or {}
    return label_problems(meta.get("labels"), f"{where}.metadata.labels") + annotation_problems(
        meta.get("annotations"), f"{where}.metadata.annotations"
    ) + pod_spec_problems(
        template.get("spec") or {}, f"{where}.spec"
    )


def _digits(n: int) -> int:
    return len(str(max(0, n)))


def object_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server (or the controller that makes its pods) would refuse ``obj``.

    Covers ``metadata`` (name rule of the kind, labels), pod templates of Deployments, Jobs and
    LeaderWorkerSets, and the names their controllers derive: an Indexed Job's pods are named
    ``<job>-<index>`` as hostnames, a LeaderWorkerSet's ``<lws>-<group>-<worker>`` (and each
    group is a StatefulSet ``<lws>-<group>``). Objects of other kinds get the metadata checks.
    """
    kind, meta = obj.get("kind", "?"), obj.get("metadata") or {}
    name = str(meta.get("name", ""))
    what = f"{kind}/{name}"
    out: list[str] = []
    if (problem := name_problem(kind, name)) is not None:
        out.append(f"{what}: metadata.name: {problem}")
    out += label_problems(meta.get("labels"), f"{what}: metadata.labels")
    out += annotation_problems(meta.get("annotations"), f"{what}: metadata.annotations")
    spec = obj.get("spec") or {}
    if kind == "PersistentVolumeClaim":
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
        if storage is None or (problem := quantity_problem(storage)):
            out.append(f"{what}: spec.resources.requests.storage: {problem if storage is not None else 'Required value'}")
        cls = spec.get("storageClassName")
        if cls is not None and not DNS1123_SUBDOMAIN.match(str(cls)):
            out.append(f"{what}: spec.storageClassName: {cls!r} is not a DNS subdomain")
    if kind == "Deployment":
        out += [f"{what}: {p}" for p in _template_problems(spec.get("template") or {}, "spec.template")]
    elif kind == "Job":
        out += [f"{what}: {p}" for p in _template_problems(spec.get("template") or {}, "spec.template")]
        if spec.get("completionMode") == "Indexed":
            last = f"{name}-{int(spec.get('completions', 1)) - 1}"
            if len(last) > 63:
                out.append(
                    f"{what}: its pods' hostnames <job>-<index> pass 63 characters ({last!r}, "
                    f"{len(last)}); shorten the name"
                )
    elif kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        for part in ("leaderTemplate", "workerTemplate"):
            if part in lwt:
                out += [f"{what}: {p}" for p in _template_problems(lwt[part], f"spec.leaderWorkerTemplate.{part}")]
        groups, size = int(spec.get("replicas", 1)), int(lwt.get("size", 1))
        sts = len(name) + 1 + _digits(groups - 1)
        pod = sts + 1 + _digits(size - 1)
        too_long = []
        if sts > STATEFULSET_NAME_MAX:
            too_long.append(f"each group's StatefulSet <name>-<group> has {sts} > {STATEFULSET_NAME_MAX} characters")
        if pod > 63:
            too_long.append(f"its pods <name>-<group>-<worker> have {pod} > 63 characters")
        if too_long:
            out.append(f"{what}: the names it derives are too long ({'; '.join(too_long)}); shorten the name")
    return out


def children_problems(objs: Iterable[dict[str, Any]]) -> list[str]:
    """Every problem of every object, in order (empty: the API server would take them all)."""
    return [p for obj in objs for p in object_problems(obj)]


RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)


def restricted_problems(spec: dict[str, Any]) -> list[str]:
    """Where a PodSpec breaks the Pod Security Standard "restricted" (what the admission
    controller of a namespace labelled ``pod-security.kubernetes.io/enforce: restricted`` refuses).

    The sandbox runs model-written code; its pods meet this profile as rendered, and a
    ``podTemplate`` override must not take that away.
    """
    out: list[str] = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            out.append(f"{flag}=true")
    pod_sc = spec.get("securityContext") or {}
    for kind in ("volumes",):
        for v in spec.get(kind) or []:
            types = set(v) - {"name"}
            if not types <= RESTRICTED_VOLUMES:
                out.append(f"volume {v.get('name')!r} uses {', '.join(sorted(types - RESTRICTED_VOLUMES))}")
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c.get("name", "?")
        if sc.get("privileged"):
            out.append(f"container {name!r}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name!r}: allowPrivilegeEscalation != false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name!r}: capabilities.drop must include ALL")
        added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"container {name!r}: capabilities.add {sorted(added)}")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
            out.append(f"container {name!r}: runAsNonRoot != true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"container {name!r}: runAsUser=0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"container {name!r}: seccompProfile.type must be RuntimeDefault or Localhost")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"container {name!r}: hostPort")
    return out
