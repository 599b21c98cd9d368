"""The rest of the API server's PodSpec validation: references, sources and enumerations.

``apirules.pod_spec_problems`` checks what kuberl itself renders (names, images, resources,
mounts); a ``podTemplate`` override can put anything a PodSpec holds into a trainer, engine or
sandbox pod, and a real API server refuses whole classes of it that a schema check passes
(k8s.io/kubernetes pkg/apis/core/validation: ``validateVolumes``, ``validateEnv``,
``validateEnvFrom``, ``ValidateTolerations``, ``validateAffinity``, ``ValidatePodSecurityContext``,
``ValidateAnnotations``). Without these, `kuberl validate` said "ok" to a manifest whose trainer
Job the API server then refused at run time. Pure functions; each problem names the field.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from kuberl.api.common import ANNOTATIONS_MAX_BYTES, annotations_size

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_ID = 2**31 - 1

ENUMS: dict[str, tuple[str, ...]] = {
    "imagePullPolicy": ("Always", "Never", "IfNotPresent"),
    "terminationMessagePolicy": ("File", "FallbackToLogsOnError"),
    "dnsPolicy": ("ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"),
    "protocol": ("TCP", "UDP", "SCTP"),
    "whenUnsatisfiable": ("DoNotSchedule", "ScheduleAnyway"),
    "preemptionPolicy": ("PreemptLowerPriority", "Never"),
    "fsGroupChangePolicy": ("Always", "OnRootMismatch"),
    "scheme": ("HTTP", "HTTPS"),
}
_SYSCTL = re.compile(r"^([a-z0-9]([-_a-z0-9]*[a-z0-9])?[./])*[a-z0-9]([-_a-z0-9]*[a-z0-9])?$")
_IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def subdomain_problem(value: Any) -> str | None:
    """Why ``value`` is not a DNS-1123 subdomain (the names of Secrets, ConfigMaps, classes)."""
    if not isinstance(value, str) or not value:
        return "Required value"
    if len(value) > 253 or not _SUBDOMAIN.match(value):
        return (
            f"{value!r} is not a DNS subdomain: at most 253 characters of lowercase letters, digits, '-' "
            "and '.', starting and ending with a letter or digit"
        )
    return None


def qualified_key_problem(key: Any) -> str | None:
    """Why ``key`` is not a qualified name (label, annotation, selector and taint keys)."""
    if not isinstance(key, str):
        return f"{key!r} is not a qualified name"
    prefix, slash, name = key.rpartition("/")
    if (slash and (not prefix or subdomain_problem(prefix))) or len(name) > 63 or not _QUALIFIED.match(name):
        return (
            f"{key!r} is not a qualified name: at most 63 characters of letters, digits, '-', '_' and '.' "
            "(starting and ending with a letter or digit), optionally behind a DNS prefix and '/'"
        )
    return None


def config_key_problem(key: Any) -> str | None:
    """Keys of a Secret or ConfigMap (``IsConfigMapKey``)."""
    if not isinstance(key, str) or not key:
        return "Required value"
    if len(key) > 253 or not _CONFIG_KEY.match(key) or key in (".", "..") or key.startswith(".."):
        return f"{key!r} is not a valid key: letters, digits, '-', '_' and '.' (not '.', '..' or '..'-prefixed)"
    return None


def annotation_problems(annotations: Any, where: str) -> list[str]:
    if not annotations:
        return []
    if not isinstance(annotations, dict):
        return [f"{where}: must be a map of strings"]
    out = [f"{where}: {p}" for k in annotations if (p := qualified_key_problem(k))]
    size = annotations_size(annotations)
    if size > ANNOTATIONS_MAX_BYTES:
        out.append(f"{where}: total size {size} bytes is more than the limit of {ANNOTATIONS_MAX_BYTES}")
    return out


def _relative_path_problem(path: Any) -> str | None:
    if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/"):
        return f"{path!r} must be a relative path without '..'"
    return None


def volume_problems(vol: dict[str, Any], at: str) -> list[str]:
    """Exactly one source per volume, and the names each source must carry."""
    sources = sorted(k for k, v in vol.items() if k != "name" and v is not None)  # null: not set
    if not sources:
        return [f"{at}: must specify a volume type (emptyDir, secret, persistentVolumeClaim, ...)"]
    if len(sources) > 1:
        return [f"{at}: may not specify more than 1 volume type (got {', '.join(sources)})"]
    src, body = sources[0], vol[sources[0]] or {}
    if not isinstance(body, dict):
        return [f"{at}.{src}: must be an object"]
    required = {"secret": "secretName", "persistentVolumeClaim": "claimName", "configMap": "name", "hostPath": "path"}
    field = required.get(src)
    if field is not None and not body.get(field):
        return [f"{at}.{src}.{field}: Required value"]
    out = []
    for i, item in enumerate(body.get("items") or []):
        if p := config_key_problem(item.get("key")):
            out.append(f"{at}.{src}.items[{i}].key: {p}")
        if p := _relative_path_problem(item.get("path")):
            out.append(f"{at}.{src}.items[{i}].path: {p}")
    return out


def _key_ref_problems(ref: Any, at: str) -> list[str]:
    if not isinstance(ref, dict):
        return [f"{at}: must be an object"]
    out = [f"{at}.name: {p}" for p in [subdomain_problem(ref.get("name"))] if p]
    out += [f"{at}.key: {p}" for p in [config_key_problem(ref.get("key"))] if p]
    return out


def env_problems(container: dict[str, Any], at: str) -> list[str]:
    """``env`` values from exactly one place, ``envFrom`` from exactly one Secret or ConfigMap,
    each named as the API server requires (a Secret called ``AWS_Creds`` is refused)."""
    out = []
    for e in container.get("env") or []:
        where = f"{at}.env[{e.get('name')}]"
        source = e.get("valueFrom")
        if source is None:
            continue
        if e.get("value"):
            out.append(f"{where}.valueFrom: may not be specified when `value` is not empty")
        kinds = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef", "fileKeyRef") if k in (source or {})]
        if len(kinds) != 1:
            out.append(f"{where}.valueFrom: must specify exactly one of fieldRef, resourceFieldRef, "
                       f"configMapKeyRef, secretKeyRef (got {kinds or 'none'})")
        for k in ("configMapKeyRef", "secretKeyRef"):
            if k in (source or {}):
                out += _key_ref_problems(source[k], f"{where}.valueFrom.{k}")
        if "fieldRef" in (source or {}) and not (source["fieldRef"] or {}).get("fieldPath"):
            out.append(f"{where}.valueFrom.fieldRef.fieldPath: Required value")
    for i, src in enumerate(container.get("envFrom") or []):
        where = f"{at}.envFrom[{i}]"
        kinds = [k for k in ("configMapRef", "secretRef") if k in src]
        if len(kinds) != 1:
            out.append(f"{where}: must specify exactly one of configMapRef, secretRef (got {kinds or 'none'})")
        for k in kinds:
            if p := subdomain_problem((src[k] or {}).get("name")):
                out.append(f"{where}.{k}.name: {p}")
        prefix = src.get("prefix")
        if prefix is not None and (not isinstance(prefix, str) or "=" in prefix or not prefix.isprintable()):
            out.append(f"{where}.prefix: {prefix!r} must be printable characters other than '='")
    return out


def mount_problems(container: dict[str, Any], at: str) -> list[str]:
    out = []
    for m in container.get("volumeMounts") or []:
        where = f"{at}.volumeMounts[{m.get('name')}]"
        if not m.get("name"):
            out.append(f"{where}.name: Required value")
        if not m.get("mountPath"):
            out.append(f"{where}.mountPath: Required value")
        if m.get("subPath") and (p := _relative_path_problem(m["subPath"])):
            out.append(f"{where}.subPath: {p}")
    return out


def _enum_problems(obj: dict[str, Any], fields: tuple[str, ...], at: str) -> list[str]:
    return [
        f"{at}.{f}: Unsupported value {obj[f]!r}: supported values: {', '.join(ENUMS[f])}"
        for f in fields
        if f in obj and obj[f] not in ENUMS[f]
    ]


def container_problems(container: dict[str, Any], at: str) -> list[str]:
    """What ``apirules`` does not check of one container: env sources, mounts, enumerations, ids."""
    out = env_problems(container, at) + mount_problems(container, at)
    out += _enum_problems(container, ("imagePullPolicy", "terminationMessagePolicy"), at)
    for p in container.get("ports") or []:
        out += _enum_problems(p, ("protocol",), f"{at}.ports[{p.get('containerPort')}]")
    out += _id_problems(container.get("securityContext") or {}, f"{at}.securityContext")
    for field in PROBES:
        if container.get(field) is not None:
            out += probe_problems(container[field], field, f"{at}.{field}")
    for hook in ("postStart", "preStop"):
        handler = (container.get("lifecycle") or {}).get(hook)
        if handler is not None:
            out += _handler_problems(handler, f"{at}.lifecycle.{hook}")
    return out


def port_problem(port: Any) -> str | None:
    """An int-or-string port (ValidatePortNumOrName): 1-65535, or a port name, which must contain
    a letter (the string "8080" is neither)."""
    if isinstance(port, bool) or not isinstance(port, (int, str)):
        return f"{port!r} must be a port number or name"
    if isinstance(port, int):
        return None if 1 <= port <= 65535 else f"{port} must be between 1 and 65535, inclusive"
    if len(port) > 15 or not _IANA_SVC_NAME.match(port) or "--" in port or not re.search("[a-z]", port):
        return (f"{port!r} must be a port number, or a port name: at most 15 characters of a-z, 0-9 and '-', "
                "containing at least one letter (a-z)")
    return None


def _handler_problems(handler: dict[str, Any], at: str) -> list[str]:
    kinds = [k for k in ("exec", "httpGet", "tcpSocket", "grpc", "sleep") if handler.get(k) is not None]
    if len(kinds) != 1:
        return [f"{at}: must specify exactly one handler type (got {', '.join(kinds) or 'none'})"]
    kind, out = kinds[0], []
    if kind in ("httpGet", "tcpSocket", "grpc"):
        port = handler[kind].get("port")
        problem = "Required value" if port is None else port_problem(port)
        if kind == "grpc" and isinstance(port, str):
            problem = f"{port!r}: a gRPC probe's port is a number"
        if problem:
            out.append(f"{at}.{kind}.port: {problem}")
    if kind == "httpGet":
        out += _enum_problems(handler[kind], ("scheme",), f"{at}.httpGet")
    return out


def probe_problems(probe: dict[str, Any], field: str, at: str) -> list[str]:
    """validateProbe: one handler, its port, and the timing fields' bounds."""
    out = _handler_problems(probe, at)
    for f, low in (("initialDelaySeconds", 0), ("timeoutSeconds", 1), ("periodSeconds", 1),
                   ("successThreshold", 1), ("failureThreshold", 1)):
        v = probe.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            out.append(f"{at}.{f}: {v!r} must be an integer >= {low}")
    if field != "readinessProbe" and probe.get("successThreshold") not in (None, 1):
        out.append(f"{at}.successThreshold: must be 1 for a {field}")
    return out


def spread_problems(constraints: Any, where: str) -> list[str]:
    """validateTopologySpreadConstraints: skew, key, when, minDomains, no (key, when) twice."""
    out, seen = [], set()
    for i, c in enumerate(constraints or []):
        at = f"{where}[{i}]"
        skew = c.get("maxSkew")
        if isinstance(skew, bool) or not isinstance(skew, int) or skew <= 0:
            out.append(f"{at}.maxSkew: {skew!r} must be greater than zero")
        key = c.get("topologyKey")
        if not key:
            out.append(f"{at}.topologyKey: Required value")
        elif p := qualified_key_problem(key):
            out.append(f"{at}.topologyKey: {p}")
        when = c.get("whenUnsatisfiable")
        if when is None:
            out.append(f"{at}.whenUnsatisfiable: Required value")
        out += _enum_problems(c, ("whenUnsatisfiable",), at)
        if (key, when) in seen:
            out.append(f"{at}: Duplicate value: topologyKey {key!r} with whenUnsatisfiable {when!r}")
        seen.add((key, when))
        if c.get("minDomains") is not None:
            if not isinstance(c["minDomains"], int) or c["minDomains"] <= 0:
                out.append(f"{at}.minDomains: {c['minDomains']!r} must be greater than zero")
            elif when != "DoNotSchedule":
                out.append(f"{at}.minDomains: can only be used with whenUnsatisfiable DoNotSchedule")
        out += _selector_problems(c.get("labelSelector"), f"{at}.labelSelector")
    return out


def _id_problems(sc: dict[str, Any], at: str) -> list[str]:
    out = []
    for f in ("runAsUser", "runAsGroup", "fsGroup"):
        v = sc.get(f)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ID):
            out.append(f"{at}.{f}: {v!r} must be between 0 and {MAX_ID}, inclusive")
    for v in sc.get("supplementalGroups") or []:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ID:
            out.append(f"{at}.supplementalGroups: {v!r} must be between 0 and {MAX_ID}, inclusive")
    out += _enum_problems(sc, ("fsGroupChangePolicy",), at)
    for i, sysctl in enumerate(sc.get("sysctls") or []):
        name = str(sysctl.get("name", ""))
        if len(name) > 253 or not _SYSCTL.match(name):
            out.append(f"{at}.sysctls[{i}].name: {name!r} is not a sysctl name (dotted or slashed segments of "
                       "a-z, 0-9, '-' and '_')")
    return out


def _expression_problems(exprs: Any, operators: tuple[str, ...], at: str) -> list[str]:
    out = []
    for i, e in enumerate(exprs or []):
        where = f"{at}[{i}]"
        if p := qualified_key_problem(e.get("key")):
            out.append(f"{where}.key: {p}")
        op, values = e.get("operator"), e.get("values") or []
        if op not in operators:
            out.append(f"{where}.operator: Unsupported value {op!r}: supported values: {', '.join(operators)}")
        elif op in ("In", "NotIn") and not values:
            out.append(f"{where}.values: must be specified when `operator` is 'In' or 'NotIn'")
        elif op in ("Exists", "DoesNotExist") and values:
            out.append(f"{where}.values: may not be specified when `operator` is 'Exists' or 'DoesNotExist'")
        elif op in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?\d+", str(values[0]))):
            out.append(f"{where}.values: must be one integer when `operator` is 'Gt' or 'Lt'")
    return out


def _selector_problems(sel: Any, at: str) -> list[str]:
    if not sel:
        return []
    out = [f"{at}.matchLabels: {p}" for k in (sel.get("matchLabels") or {}) if (p := qualified_key_problem(k))]
    out += [
        f"{at}.matchLabels[{k}]: label value {v!r} is not valid"
        for k, v in (sel.get("matchLabels") or {}).items()
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v)
    ]
    return out + _expression_problems(sel.get("matchExpressions"), LABEL_OPERATORS, f"{at}.matchExpressions")


def affinity_problems(affinity: Any, at: str) -> list[str]:
    """Node affinity terms and pod (anti-)affinity terms, as ``validateAffinity`` checks them."""
    if not affinity:
        return []
    out = []
    node = affinity.get("nodeAffinity") or {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None and not required.get("nodeSelectorTerms"):
        out.append(f"{at}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: "
                   "must have at least one node selector term")
    terms = [(f"required.nodeSelectorTerms[{i}]", t) for i, t in enumerate((required or {}).get("nodeSelectorTerms") or [])]
    terms += [
        (f"preferred[{i}].preference", p.get("preference") or {})
        for i, p in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    ]
    for i, p in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        w = p.get("weight")
        if not isinstance(w, int) or not 1 <= w <= 100:
            out.append(f"{at}.nodeAffinity.preferred[{i}].weight: {w!r} must be in the range 1-100")
    for where, term in terms:
        out += _expression_problems(term.get("matchExpressions"), NODE_OPERATORS, f"{at}.nodeAffinity.{where}.matchExpressions")
    for kind in ("podAffinity", "podAntiAffinity"):
        part = affinity.get(kind) or {}
        pod_terms = list(part.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        for i, w in enumerate(part.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            weight = w.get("weight")
            if not isinstance(weight, int) or not 1 <= weight <= 100:
                out.append(f"{at}.{kind}.preferred[{i}].weight: {weight!r} must be in the range 1-100")
            pod_terms.append(w.get("podAffinityTerm") or {})
        for i, t in enumerate(pod_terms):
            if not t.get("topologyKey"):
                out.append(f"{at}.{kind}[{i}].topologyKey: Required value: can not be empty")
            elif p := qualified_key_problem(t["topologyKey"]):
                out.append(f"{at}.{kind}[{i}].topologyKey: {p}")
            out += _selector_problems(t.get("labelSelector"), f"{at}.{kind}[{i}].labelSelector")
    return out


def toleration_problems(tolerations: Any, at: str) -> list[str]:
    """What ``apirules`` does not check of tolerations: keys, values, tolerationSeconds."""
    out = []
    for i, t in enumerate(tolerations or []):
        where = f"{at}[{i}]"
        if t.get("key") and (p := qualified_key_problem(t["key"])):
            out.append(f"{where}.key: {p}")
        value = t.get("value")
        if value and (not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value)):
            out.append(f"{where}.value: {value!r} is not a valid label value")
        if t.get("tolerationSeconds") is not None and t.get("effect") != "NoExecute":
            out.append(f"{where}.effect: must be 'NoExecute' when `tolerationSeconds` is set")
    return out


def pod_extras_problems(spec: dict[str, Any], where: str) -> list[str]:
    """The PodSpec fields outside containers that ``apirules`` does not check."""
    out: list[str] = []
    for i, vol in enumerate(spec.get("volumes") or []):
        out += volume_problems(vol, f"{where}.volumes[{vol.get('name', i)}]")
    for field in ("schedulerName", "runtimeClassName"):
        if spec.get(field) is not None and (p := subdomain_problem(spec[field])):
            out.append(f"{where}.{field}: {p}")
    out += _enum_problems(spec, ("dnsPolicy", "preemptionPolicy"), where)
    if spec.get("dnsPolicy") == "None" and not spec.get("dnsConfig"):
        out.append(f"{where}.dnsConfig: Required value: must provide dnsConfig when dnsPolicy is None")
    out += _id_problems(spec.get("securityContext") or {}, f"{where}.securityContext")
    out += affinity_problems(spec.get("affinity"), f"{where}.affinity")
    out += toleration_problems(spec.get("tolerations"), f"{where}.tolerations")
    out += spread_problems(spec.get("topologySpreadConstraints"), f"{where}.topologySpreadConstraints")
    for i, h in enumerate(spec.get("hostAliases") or []):
        try:
            ipaddress.ip_address(str(h.get("ip", "")))
        except ValueError:
            out.append(f"{where}.hostAliases[{i}].ip: {h.get('ip')!r} must be a valid IP address")
        out += [f"{where}.hostAliases[{i}].hostnames: {p}" for n in h.get("hostnames") or [] if (p := subdomain_problem(n))]
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and (not isinstance(deadline, int) or deadline < 1):
        out.append(f"{where}.activeDeadlineSeconds: {deadline!r} must be a positive integer")
    for kind in ("containers", "initContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            out += container_problems(c, f"{where}.{kind}[{c.get('name', i)}]")
    return out
