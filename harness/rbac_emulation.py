"""RBAC as the API server enforces it, for the emulator (test infrastructure, no I/O here).

``ClusterEmulator`` answers every request; a real API server first authorizes it against the
caller's roles and, on writes that set ``ownerReferences`` with ``blockOwnerDeletion: true``,
runs the OwnerReferencesPermissionEnforcement admission plugin (on by default in OpenShift and
hardened clusters): the caller must be allowed to ``update`` the owner's ``finalizers``
subresource. ``RbacEmulator`` (in ``testing.py``'s terms a ClusterEmulator subclass) applies
both to the operator's own requests and records what it used, so a test can hold the chart's
rules to "everything needed, nothing unused".

Only what the operator's rules use is modelled: resource rules with explicit verbs, groups and
resources (no ``*``, no resourceNames, no non-resource URLs: discovery is always allowed, as
the ``system:discovery`` role does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Permission = tuple[str, str, str]  # (verb, apiGroup, resource[/subresource])


@dataclass(frozen=True)
class Attributes:
    """What the authorizer sees of one request."""

    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None

    @property
    def permission(self) -> Permission:
        return (self.verb, self.group, self.resource)


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes | None:
    """The resource attributes of a REST request (None: a non-resource URL such as discovery)."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return None
    if parts[0] == "api" and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    if query.get("watch") in ("true", "1"):
        verb = "watch"
    else:
        verb = {
            "GET": "get" if name else "list",
            "POST": "create",
            "PATCH": "patch",
            "PUT": "update",
            "DELETE": "delete" if name else "deletecollection",
        }.get(method.upper(), method.lower())
    return Attributes(verb, group, f"{resource}/{sub}" if sub else resource, namespace, name)


def allowed(rules: Iterable[Mapping[str, Any]], permission: Permission) -> bool:
    verb, group, resource = permission
    return any(
        verb in rule.get("verbs", ())
        and group in rule.get("apiGroups", ())
        and resource in rule.get("resources", ())
        for rule in rules
    )


def owner_permissions(body: Any, plurals: Mapping[tuple[str, str], str]) -> list[Permission]:
    """``update`` on ``<owner plural>/finalizers`` for every ownerReference with
    ``blockOwnerDeletion: true`` in ``body`` (plurals: (group, kind) -> plural)."""
    if not isinstance(body, dict):
        return []
    refs = ((body.get("metadata") or {}).get("ownerReferences")) or []
    out = []
    for ref in refs:
        if not isinstance(ref, dict) or not ref.get("blockOwnerDeletion"):
            continue
        group = ref.get("apiVersion", "").rpartition("/")[0] if "/" in ref.get("apiVersion", "") else ""
        plural = plurals.get((group, ref.get("kind", "")), ref.get("kind", "").lower() + "s")
        out.append(("update", group, f"{plural}/finalizers"))
    return out
