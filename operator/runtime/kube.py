"""A small async Kubernetes REST client for the objects the operator owns.

kopf watches and patches the kuberl resources with its own client; the *children*
(Deployments, Services, Jobs, ...) need create/get/patch/delete/list, which kopf does not
expose. Rather than a second, blocking client library inside the event loop, this speaks the
REST API over aiohttp with the very credentials kopf logged in with (``ConnectionInfo``).

``apply`` is a three-way merge like ``kubectl apply``: it records what kuberl sent in the
annotation ``kuberl.io/last-applied`` and sends a JSON merge patch with the fields that differ
*and* ``null`` for every field kuberl set before but no longer wants (a fleet switched from
h100 to cpu loses its GPU affinity and tolerations). Fields someone else set (server defaults,
other controllers) are left alone. Comparisons use the API server's stored form
(``canonical.server_form``), so a live ``"500m"`` matches a desired ``"0.5"`` and an absent
``egress`` matches ``[]``: an unchanged object gets no patch at all.

(Server-side apply would prune too, but needs per-field ownership that the emulator cannot
reproduce faithfully; the three-way merge needs only RFC 7386, which it implements exactly.)
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import kopf

from kuberl.api.group import API_VERSION
from kuberl.operator.runtime.cache import KUBERL_SELECTOR, ListCache
from kuberl.operator.validate.canonical import server_form

log = logging.getLogger("kuberl.operator")
LAST_APPLIED = "kuberl.io/last-applied"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name)}"
        if sub:
            base += f"/{sub}"
        return base


KNOWN_KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in (
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        Kind("coordination.k8s.io/v1", "Lease", "leases"),
        # Kueue's, read and written for jobs with its queue-name label (runtime/queueing.py)
        Kind(KUEUE_API_VERSION, "Workload", "workloads"),
        Kind(KUEUE_API_VERSION, "ResourceFlavor", "resourceflavors", namespaced=False),
        Kind(KUEUE_API_VERSION, "WorkloadPriorityClass", "workloadpriorityclasses", namespaced=False),
        Kind(KUEUE_API_VERSION, "LocalQueue", "localqueues"),
        Kind(API_VERSION, "AgenticRLJob", "agenticrljobs"),
        Kind(API_VERSION, "RolloutFleet", "rolloutfleets"),
        Kind(API_VERSION, "SandboxPool", "sandboxpools"),
    )
}


def operator_cache() -> ListCache:
    """The read cache the operator uses: its own kinds (all objects) and, by kuberl's
    app.kubernetes.io/name label, every child kind and pods. Events and KEDA objects are never read."""
    selectors: dict[tuple[str, str], dict[str, str]] = {}
    for api_version, kind in KNOWN_KINDS:
        if kind in ("Event", "ScaledObject", "Lease") or api_version == KUEUE_API_VERSION:
            continue
        selectors[api_version, kind] = {} if api_version == API_VERSION else dict(KUBERL_SELECTOR)
    return ListCache(selectors)


def kind_of(api_version: str, kind: str) -> Kind:
    try:
        return KNOWN_KINDS[api_version, kind]
    except KeyError:
        raise ValueError(f"the operator does not manage {api_version}/{kind}") from None


class ApiError(Exception):
    """A non-2xx answer of the API server, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def is_subset(desired: Any, current: Any) -> bool:
    """True when every field of ``desired`` has the same value in ``current``.

    Lists must match element by element (same length); dicts may carry extra keys in
    ``current`` (defaults the API server filled in). This is what decides whether a child
    needs a patch, so a live object is never rewritten just because the server defaulted it.
    """
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(
            k in current and is_subset(v, current[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(current, list)
            and len(desired) == len(current)
            and all(is_subset(d, c) for d, c in zip(desired, current, strict=True))
        )
    if isinstance(desired, bool) or isinstance(current, bool):
        return desired is current
    if isinstance(desired, int | float) and isinstance(current, int | float):
        return float(desired) == float(current)
    return desired == current


def owned_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The part of a built manifest the operator owns (everything but status)."""
    return {k: v for k, v in obj.items() if k != "status"}


_MISSING: Any = object()


def _stored(value: Any, path: tuple[str, ...]) -> Any:
    """``value`` (found at ``path``) in the server's stored form; quantity rules depend on the
    enclosing keys (``resources.requests.cpu``), so the last three keys are kept around it."""
    keys = path[-3:] or ("v",)
    wrapped: Any = value
    for key in reversed(keys):
        wrapped = {key: wrapped}
    out = server_form(wrapped)
    for key in keys:
        if not isinstance(out, dict) or key not in out:
            return _MISSING
        out = out[key]
    return out


def equivalent(desired: Any, live: Any, path: tuple[str, ...] = ()) -> bool:
    """Whether ``live`` already holds ``desired`` once both are in the API server's stored form."""
    want, have = _stored(desired, path), (_MISSING if live is _MISSING else _stored(live, path))
    if want is _MISSING:  # an empty list: the server stores nothing
        return have is _MISSING or have is None
    return have is not _MISSING and is_subset(want, have)


def three_way_patch(
    desired: dict[str, Any], last_applied: dict[str, Any], live: dict[str, Any], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that makes ``live`` hold ``desired`` ({} = nothing to do).

    * a key kuberl applied last time (``last_applied``) but no longer wants is set to ``null``;
    * a value that differs from live (after server canonicalization) is sent;
    * a list is also re-sent when kuberl's own previous list differs from the new one, even if
      the live list looks like a superset: a key dropped inside a list item (a container's GPU
      limits) is otherwise invisible, since the server adds keys to list items too;
    * keys nobody asked kuberl to manage (server defaults, other writers) are never touched.
    """
    patch: dict[str, Any] = {}
    for key in sorted(last_applied.keys() - desired.keys()):
        if key in live:
            patch[key] = None
    for key, want in desired.items():
        have = live.get(key, _MISSING)
        before = last_applied.get(key, _MISSING)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = three_way_patch(want, before if isinstance(before, dict) else {}, have, (*path, key))
            if sub:
                patch[key] = sub
        elif not equivalent(want, have, (*path, key)) or (
            isinstance(want, list) and before is not _MISSING and before != want
        ):
            patch[key] = copy.deepcopy(want)
    return patch


def _shape(value: Any) -> Any:
    """What three_way_patch reads from a last-applied record: its keys and its lists."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return value if isinstance(value, list) else None


def needs_patch(patch: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> bool:
    """False when ``patch`` would only rewrite the last-applied record with the same keys and
    lists (e.g. a replica count the autoscaler owns): such a write changes nothing that pruning
    depends on, and skipping it keeps a parent from rewriting its child at every scale."""
    meta = patch.get("metadata") or {}
    only_record = patch.keys() == {"metadata"} and meta.keys() == {"annotations"}
    if not (only_record and meta["annotations"].keys() == {LAST_APPLIED}):
        return bool(patch)
    return _shape(before) != _shape(after)


def with_last_applied(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` (without status) carrying its own JSON in the ``kuberl.io/last-applied`` annotation."""
    body = copy.deepcopy(owned_fields(obj))
    meta = body.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(LAST_APPLIED, None)
    meta["annotations"] = annotations
    record = json.loads(json.dumps(body))
    if not annotations:
        record["metadata"].pop("annotations")
    annotations[LAST_APPLIED] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return body


def last_applied(live: dict[str, Any]) -> dict[str, Any]:
    """What kuberl applied to ``live`` last time ({} for objects it has not annotated)."""
    raw = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except ValueError:
        log.warning(
            "%s/%s: annotation %s is not JSON; nothing will be pruned this time",
            live.get("kind"),
            (live.get("metadata") or {}).get("name"),
            LAST_APPLIED,
        )
        return {}
    return out if isinstance(out, dict) else {}


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context(cafile=str(info.ca_path) if info.ca_path else None)
    if info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        try:
            data = base64.b64decode(data, validate=True).decode()
        except ValueError:
            pass  # already PEM
        ctx.load_verify_locations(cadata=data)
    cert, key = info.certificate_path, info.private_key_path
    tmp: list[str] = []
    for data in (info.certificate_data, info.private_key_data):
        if data:
            f = tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False)  # noqa: SIM115 - kept for the process
            raw = data if isinstance(data, bytes) else data.encode()
            try:
                raw = base64.b64decode(raw, validate=True)
            except ValueError:
                pass
            f.write(raw)
            f.close()
            tmp.append(f.name)
    if tmp and info.certificate_data:
        cert = tmp[0]
        key = tmp[1] if len(tmp) > 1 else key
    if cert:
        ctx.load_cert_chain(str(cert), str(key) if key else None)
    return ctx


class KubeClient:
    """REST calls for child objects, authenticated like kopf (token, basic, or client cert).

    With a ``cache`` (``operator/runtime/cache.py``), GETs and label-selected LISTs of cached kinds in a
    namespace are served from one LIST of that kind until ``invalidate``; ``fresh=True`` reads
    bypass it. Writes keep the cache current.
    """

    def __init__(
        self, info: kopf.ConnectionInfo, *, timeout: float = 30.0, cache: ListCache | None = None
    ) -> None:
        self.server = info.server.rstrip("/")
        self.cache = cache
        headers = {"User-Agent": "kuberl-operator"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        ctx = _ssl_context(info) if self.server.startswith("https") else None
        connector = aiohttp.TCPConnector(ssl=ctx) if ctx is not None else aiohttp.TCPConnector()
        self._session = aiohttp.ClientSession(
            headers=headers, auth=auth, connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(
            method, self.server + path, data=data, params=params, headers=headers
        ) as rsp:
            text = await rsp.text()
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if rsp.status >= 400:
                raise ApiError(
                    rsp.status, str(payload.get("reason", rsp.reason)), str(payload.get("message", text))
                )
            return payload

    def invalidate(self, kinds: list[Kind] | None = None) -> None:
        """Make the next read of ``kinds`` (default: all) LIST again."""
        if self.cache is not None:
            self.cache.invalidate(None if kinds is None else [(k.api_version, k.kind) for k in kinds])

    def _cache_key(self, kind: Kind, namespace: str | None) -> tuple[str, str, str] | None:
        if self.cache is None or not namespace or not self.cache.cacheable(kind.api_version, kind.kind):
            return None
        return (kind.api_version, kind.kind, namespace)

    async def _loaded(self, kind: Kind, namespace: str) -> tuple[str, str, str] | None:
        """The cache key of (kind, namespace), LISTing it first if needed (None: not cached)."""
        key = self._cache_key(kind, namespace)
        if key is None or self.cache is None:
            return None
        if key[:2] in self.cache.missing_kinds:  # a 404 this pass already: not served
            raise ApiError(404, "NotFound", f"the server does not serve {kind.plural}.{kind.api_version}")
        if not self.cache.loaded(key):
            try:
                items = await self._list(kind, namespace, self.cache.selectors[key[:2]])
            except ApiError as err:
                if err.status == 404:
                    self.cache.missing_kinds.add(key[:2])
                raise
            for item in items:  # list items may omit them; a live object compared with a
                item.setdefault("apiVersion", kind.api_version)  # desired one must not
                item.setdefault("kind", kind.kind)
            self.cache.load(key, items)
        return key

    async def get(
        self, kind: Kind, namespace: str, name: str, sub: str | None = None, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        if not fresh and sub is None and self._cache_key(kind, namespace) is not None:
            try:
                key = await self._loaded(kind, namespace)
            except ApiError as err:
                if err.status == 404:  # the kind is not served (no such CRD)
                    return None
                raise
            if key is not None and self.cache is not None:
                return self.cache.get(key, name)
        try:
            return await self._call("GET", kind.path(namespace, name, sub))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def _list(
        self,
        kind: Kind,
        namespace: str | None,
        labels: dict[str, str] | None,
        fields: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        params: dict[str, str] = {}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        if fields:
            params["fieldSelector"] = ",".join(f"{k}={v}" for k, v in sorted(fields.items()))
        rsp = await self._call("GET", kind.path(namespace), params=params or None)
        return list(rsp.get("items") or [])

    async def list(
        self,
        kind: Kind,
        namespace: str | None,
        labels: dict[str, str] | None = None,
        fields: dict[str, str] | None = None,
        *,
        fresh: bool = False,
    ) -> list[dict[str, Any]]:
        # the cache holds whole lists by label; a field selector (e.g. a Job's events) reads fresh
        if not fresh and not fields:
            key = await self._loaded(kind, namespace) if namespace else None
            if key is not None and self.cache is not None:
                return self.cache.list(key, labels)
        return await self._list(kind, namespace, labels, fields)

    def _remember(self, kind: Kind, namespace: str, obj: dict[str, Any]) -> None:
        key = self._cache_key(kind, namespace)
        if key is not None and self.cache is not None and obj.get("metadata", {}).get("name"):
            self.cache.put(key, {"apiVersion": kind.api_version, "kind": kind.kind, **obj})

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj["apiVersion"], obj["kind"])
        created = await self._call("POST", kind.path(obj["metadata"]["namespace"]), body=obj)
        self._remember(kind, obj["metadata"]["namespace"], created)
        return created

    async def patch(
        self, kind: Kind, namespace: str, name: str, patch: Any, *, sub: str | None = None
    ) -> dict[str, Any]:
        out = await self._call(
            "PATCH", kind.path(namespace, name, sub), body=patch, content_type="application/merge-patch+json"
        )
        key = self._cache_key(kind, namespace)
        if key is not None and self.cache is not None:
            if sub == "scale":  # the answer is a Scale, not the object: read it again next time
                self.cache.drop(key, name)
            else:
                self._remember(kind, namespace, out)
        return out

    async def json_patch(
        self, kind: Kind, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """An RFC 6902 JSON patch (its ``test`` ops make it conditional); not cached."""
        return await self._call(
            "PATCH", kind.path(namespace, name), body=ops, content_type="application/json-patch+json"
        )

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete (children go with it: background propagation). False if it was already gone."""
        key = self._cache_key(kind, namespace)
        if key is not None and self.cache is not None:
            self.cache.drop(key, name)
        try:
            await self._call(
                "DELETE",
                kind.path(namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    async def apply(
        self,
        obj: dict[str, Any],
        *,
        adjust: Callable[[dict[str, Any], dict[str, Any] | None], dict[str, Any]] | None = None,
    ) -> tuple[Literal["created", "updated", "unchanged"], dict[str, Any]]:
        """Make the live object hold ``obj``: create it, three-way-patch it, or leave it alone.

        ``adjust(obj, live)`` may rewrite the desired object once the live one is known (live is
        None when it does not exist), e.g. to leave a field to another controller.
        """
        kind = kind_of(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        live = await self.get(kind, meta["namespace"], meta["name"])
        if live is None:
            desired = with_last_applied(adjust(obj, None) if adjust else obj)
            try:
                return "created", await self.create(desired)
            except ApiError as err:
                if err.status != 409:  # lost a race with another writer: fall through to patch
                    raise
                live = await self.get(kind, meta["namespace"], meta["name"]) or {}
        desired = with_last_applied(adjust(obj, live) if adjust else obj)
        before = last_applied(live)
        patch = three_way_patch(desired, before, live)
        if not needs_patch(patch, before, json.loads(desired["metadata"]["annotations"][LAST_APPLIED])):
            return "unchanged", live
        return "updated", await self.patch(kind, meta["namespace"], meta["name"], patch)
