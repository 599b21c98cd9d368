"""What the Kubernetes API server does with a custom resource before it stores it, for the
parts that run without a cluster, so tests can tell which manifests `kubectl apply` rejects
on the generated CRDs alone (no admission webhook).

Emulated, in the API server's order: find the CRD version that serves apiVersion/kind; reject
unknown fields (kubectl's default ``--validate=strict`` asks the server for strict field
validation); apply schema defaults; validate the OpenAPI schema (jsonschema, draft 4: boolean
exclusiveMinimum like Kubernetes); enforce ``x-kubernetes-list-type`` map/set uniqueness;
evaluate ``x-kubernetes-validations`` CEL rules with cel-python, with values typed by the schema
as Kubernetes types them (a ``type: number`` field holding 2 is the double 2.0 in CEL).

Transition rules (``oldSelf``) run when ``admission_errors`` is given the stored object an update
replaces. Not emulated: CEL cost estimation, CRD-creation-time type checking of rules (a rule that
does not type-check still shows up here as an evaluation error the first time it runs), and the
Kubernetes CEL extension libraries (the generated rules use none).
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import celpy
import jsonschema

Errors = list[tuple[str, str]]
"""(layer, message) pairs; layer is one of served, fields, schema, list-type, cel."""


def served_schema(crds: list[dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any] | None:
    """The openAPIV3Schema of the CRD version serving ``doc``'s apiVersion and kind."""
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            if (
                version.get("served")
                and doc.get("apiVersion") == f"{spec['group']}/{version['name']}"
                and doc.get("kind") == spec["names"]["kind"]
            ):
                return version["schema"]["openAPIV3Schema"]
    return None


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") or value is None:
        return []
    out: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is not None:
            for key, sub in value.items():
                where = f"{path}.{key}" if path else key
                if key not in props:
                    out.append(f'{where}: unknown field "{key}"')
                elif where != "metadata":  # ObjectMeta is validated by its own Go type, not this schema
                    out += unknown_fields(props[key], sub, where)
        elif isinstance(schema.get("additionalProperties"), dict):
            for key, sub in value.items():
                out += unknown_fields(schema["additionalProperties"], sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return out


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with every missing property that has a schema default filled in, recursively."""
    value = copy.deepcopy(value)
    _default(schema, value)
    return value


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default(sub, value[key])
        if isinstance(schema.get("additionalProperties"), dict):
            for sub in value.values():
                _default(schema["additionalProperties"], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


def _walk(schema: dict[str, Any], value: Any, path: str):
    """Every (schema, value, path) pair below and including this one."""
    yield schema, value, path
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _walk(sub, value[key], f"{path}.{key}" if path else key)
        if isinstance(schema.get("additionalProperties"), dict):
            for key, sub in value.items():
                yield from _walk(schema["additionalProperties"], sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _walk(schema["items"], item, f"{path}[{i}]")


def list_type_errors(schema: dict[str, Any], value: Any) -> list[str]:
    out = []
    for node, val, path in _walk(schema, value, ""):
        kind = node.get("x-kubernetes-list-type")
        if not isinstance(val, list) or kind not in ("map", "set"):
            continue
        seen: set[Any] = set()
        for i, item in enumerate(val):
            key = (
                tuple(item.get(k) for k in node["x-kubernetes-list-map-keys"])
                if kind == "map"
                else repr(item)
            )
            if key in seen:
                out.append(f"{path}[{i}]: Duplicate value: {key!r}")
            seen.add(key)
    return out


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as a CEL value, typed by its schema the way the API server types it."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return celpy.json_to_cel(value)
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return celpy.celtypes.DoubleType(float(value))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = (
            schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        )
        return celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): to_cel(props.get(k, extra), v) for k, v in value.items()}
        )
    if isinstance(value, list):
        return celpy.celtypes.ListType([to_cel(schema.get("items") or {}, v) for v in value])
    return celpy.json_to_cel(value)


@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def compile_rule(rule: str) -> None:
    """Raise if ``rule`` is not valid CEL."""
    _program(rule)


_MISSING = object()


def _old_at(old: Any, path: str) -> Any:
    """The old object's value at ``path`` (``a.b[2].c``), or _MISSING."""
    if not path:
        return old
    cur = old
    for part in path.replace("]", "").replace("[", ".").split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


def cel_errors(schema: dict[str, Any], value: Any, old: Any = _MISSING) -> list[str]:
    """Every rule over ``value``; transition rules (``oldSelf``) only on an update (``old``) where
    the old object has a value at the same place, as the API server runs them."""
    out = []
    for node, val, path in _walk(schema, value, ""):
        for rule in node.get("x-kubernetes-validations") or []:
            env = {"self": to_cel(node, val)}
            if "oldSelf" in rule["rule"]:
                before = _old_at(old, path) if old is not _MISSING else _MISSING
                if before is _MISSING:
                    continue
                env["oldSelf"] = to_cel(node, before)
            try:
                result = _program(rule["rule"]).evaluate(env)
            except celpy.CELEvalError as err:
                out.append(f"{path or '<root>'}: evaluating {rule['rule']!r}: {err}")
                continue
            if isinstance(result, celpy.CELEvalError):
                out.append(f"{path or '<root>'}: evaluating {rule['rule']!r}: {result}")
            elif result != celpy.celtypes.BoolType(True):
                out.append(f"{path or '<root>'}: {rule['message']}")
    return out


def admission_errors(crds: list[dict[str, Any]], doc: dict[str, Any], old: Any = _MISSING) -> Errors:
    """Why the API server would refuse ``doc`` (empty = it would store it); ``old``: the stored
    object ``doc`` replaces (an update), for transition rules."""
    schema = served_schema(crds, doc)
    if schema is None:
        return [("served", f"no matches for kind {doc.get('kind')!r} in version {doc.get('apiVersion')!r}")]
    errors: Errors = [("fields", m) for m in unknown_fields(schema, doc)]
    defaulted = with_defaults(schema, doc)
    validator = jsonschema.Draft4Validator(schema)
    errors += [
        ("schema", f"{'.'.join(map(str, e.absolute_path))}: {e.message}")
        for e in validator.iter_errors(defaulted)
    ]
    if any(layer == "schema" for layer, _ in errors):
        return errors  # CEL rules only run on values that passed the schema
    errors += [("list-type", m) for m in list_type_errors(schema, defaulted)]
    errors += [("cel", m) for m in cel_errors(schema, defaulted, with_defaults(schema, old) if old is not _MISSING else old)]
    return errors


def strict_admission(crds: list[dict[str, Any]]) -> Any:
    """``ClusterEmulator(admit=...)``: custom resources through the CRDs (unknown fields, defaults,
    OpenAPI, list types, CEL and transition rules), built-in kinds through their OpenAPI schemas
    (``kubernetes_validate``, strict), as a real API server with ``--validate=strict`` clients."""
    from kube_schemas import validate_manifest

    from kuberl.api.group import GROUP

    def admit(doc: dict[str, Any], old: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
        api_version = str(doc.get("apiVersion", ""))
        if api_version.startswith(f"{GROUP}/"):
            schema = served_schema(crds, doc)
            errors = admission_errors(crds, doc, old if old is not None else _MISSING)
            stored = with_defaults(schema, doc) if schema is not None and not errors else doc
            return stored, [m for _, m in errors]
        if doc.get("kind") in ("Event",) or api_version.startswith("keda.sh"):
            return doc, []
        body = {k: v for k, v in doc.items() if k != "status"}
        try:
            validate_manifest(body)
        except ValueError as err:
            return doc, [str(err)]
        return doc, []

    return admit
