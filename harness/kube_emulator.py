"""An in-memory Kubernetes API server for end-to-end tests of the operator (kmock-based).

``kmock.KubernetesEmulator`` stores objects and streams watch events over real HTTP; the real
API server does more that the kopf runtime and the operator rely on, added here:

* ``metadata.uid``, ``resourceVersion`` (a global counter), ``generation`` (bumped by spec
  changes only), ``creationTimestamp``, ``generateName`` (kopf posts Events with it);
* PATCH semantics by Content-Type: JSON merge patch (RFC 7386, ``null`` deletes) and JSON
  patch (RFC 6902, including the ``test`` op kopf uses with resourceVersion for finalizers,
  answered with 422 on mismatch);
* the ``status`` subresource (main-resource writes ignore status and vice versa) and the
  ``scale`` subresource (autoscaling/v1 Scale, as ``kubectl scale`` uses it);
* ``labelSelector`` on lists (equality, inequality, existence);
* deletion with finalizers (deletionTimestamp first) and the garbage collector: deleting an
  owner deletes everything whose ownerReferences point at its uid, and an object created
  with an owner that no longer exists is collected at once;
* immutability of a running Job's pod template (422, as batch/v1 answers);
* the stored form of built-in kinds (``canonical.server_form``): quantities canonicalized
  (``"0.5"`` -> ``"500m"``, ``1024Mi`` -> ``1Gi``) and empty lists dropped, as the Go types
  do; custom resources are stored as sent;
* optionally a stand-in for the controllers (``simulate_controllers``): Deployments,
  StatefulSets and LeaderWorkerSets report all replicas ready; Jobs report active pods
  (none while suspended). Tests that need other states patch ``/status`` themselves.

* the API server's own validation of built-in objects (``apirules``: name rules per kind,
  labels, quantities, requests <= limits, names the controllers derive), answered with 422
  Invalid as a real server does, and kinds that are not installed (``absent_kinds``, e.g. a
  cluster without the LeaderWorkerSet CRD) answered with 404;
* Pod Security admission "restricted" in ``restricted_namespaces`` (a Deployment whose pods
  break it creates none and reports ``ReplicaFailure``), and ResourceQuota for pods: a Deployment whose pods would pass a quota's ``hard`` requests or
  limits (or that omit a request the quota tracks) gets only the pods that fit and the
  ``ReplicaFailure`` condition with the quota's refusal, as the ReplicaSet controller reports it.

It stays permissive about the OpenAPI schema of built-in kinds (``schemas.py`` checks that).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import rbac_emulation
from kmock._internal import enums, rendering

from kuberl.api.group import GROUP, VERSION
from kuberl.operator.validate.apirules import object_problems, restricted_problems
from kuberl.operator.validate.canonical import parse_quantity, server_form

CORE_RESOURCES: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    # "group/version/plural": (kind, namespaced, subresources)
    "v1/pods": ("Pod", True, ("status",)),
    "v1/services": ("Service", True, ("status",)),
    "v1/configmaps": ("ConfigMap", True, ()),
    "v1/secrets": ("Secret", True, ()),
    "v1/events": ("Event", True, ()),
    "v1/serviceaccounts": ("ServiceAccount", True, ()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, ()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, ()),
    "v1/namespaces": ("Namespace", False, ("status",)),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, ("status",)),
    "v1/resourcequotas": ("ResourceQuota", True, ("status",)),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "apps/v1/statefulsets": ("StatefulSet", True, ("status", "scale")),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "batch/v1/jobs": ("Job", True, ("status",)),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, ()),
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": ("LeaderWorkerSet", True, ("status", "scale")),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, ("status",)),
    "coordination.k8s.io/v1/leases": ("Lease", True, ()),
    "admissionregistration.k8s.io/v1/validatingwebhookconfigurations": (
        "ValidatingWebhookConfiguration",
        False,
        (),
    ),
    "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations": (
        "MutatingWebhookConfiguration",
        False,
        (),
    ),
    f"{GROUP}/{VERSION}/agenticrljobs": ("AgenticRLJob", True, ("status",)),
    f"{GROUP}/{VERSION}/rolloutfleets": ("RolloutFleet", True, ("status", "scale")),
    f"{GROUP}/{VERSION}/sandboxpools": ("SandboxPool", True, ("status", "scale")),
}


# Groups served from Go types (their objects are re-encoded on write); everything else here is a CRD.
BUILTIN_GROUPS = frozenset(
    {
        "",
        "apps",
        "batch",
        "policy",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
        "admissionregistration.k8s.io",
        "coordination.k8s.io",
    }
)


def stored_form(obj: dict[str, Any], group: str | None) -> dict[str, Any]:
    """What the API server stores for ``obj``: built-in kinds in canonical form, CRs as sent."""
    return server_form(obj) if (group or "") in BUILTIN_GROUPS else obj


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def matches_fields(obj: dict[str, Any], selector: str) -> bool:
    """Field selectors: ``a.b=c`` and ``a.b!=c`` on dotted paths (``involvedObject.name=x``)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        path, value = term.split("!=" if negate else "=", 1)
        cur: Any = obj
        for part in path.strip().split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if (str(cur) == value.strip()) == negate:
            return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# How long a real engine's HTTP endpoints take to answer a probe: SGLang >= 0.4.10 runs a
# one-token generation for /health (and /health_generate) and polls for it once a second.
SGLANG_HEALTH_SECONDS = 1.2
FAST_ENDPOINT_SECONDS = 0.05


def endpoint_seconds(container: dict[str, Any], path: str) -> float:
    """The default kubelet model: SGLang's health endpoints take over a second, others answer fast."""
    command = " ".join(str(x) for x in [*(container.get("command") or []), *(container.get("args") or [])])
    if "sglang.launch_server" in command and path in ("/health", "/health_generate"):
        return SGLANG_HEALTH_SECONDS
    return FAST_ENDPOINT_SECONDS


def pod_template_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of a workload's pod templates (Deployment, StatefulSet, LeaderWorkerSet)."""
    spec = obj.get("spec") or {}
    templates = [spec.get("template")]
    lws = spec.get("leaderWorkerTemplate") or {}
    templates += [lws.get("leaderTemplate"), lws.get("workerTemplate")]
    out: list[dict[str, Any]] = []
    for t in templates:
        if isinstance(t, dict):
            out += list(((t.get("spec") or {}).get("containers")) or [])
    return out


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API-server semantics the operator depends on."""

    simulate_controllers: bool = True
    namespaces: set[str] = attrs.field(factory=lambda: {"default"})
    absent_kinds: set[str] = attrs.field(factory=set)
    # The API server's schema validation (and CRD defaulting): (object, stored object or None) ->
    # (object to store, problems). tests/apiserver_emulation.py has one built from the generated
    # CRDs (OpenAPI + CEL, transition rules included) and the built-in kinds' OpenAPI schemas.
    admit: Callable[[dict[str, Any], dict[str, Any] | None], tuple[dict[str, Any], list[str]]] | None = None
    restricted_namespaces: set[str] = attrs.field(factory=set)  # Pod Security "restricted" enforced
    # OwnerReferencesPermissionEnforcement: the writer's RBAC rules (None: not enforced). An
    # ownerReference with blockOwnerDeletion needs "update" on the owner's <plural>/finalizers.
    owner_reference_rules: list[dict[str, Any]] | None = None
    # The kubelet's probes: seconds a container's HTTP endpoint takes to answer (container,
    # path) -> s. A workload is Ready only when every HTTP readiness/startup probe of its pod
    # template would pass, i.e. the endpoint answers within the probe's timeoutSeconds
    # (Kubernetes' default: 1 s). Default: endpoint_seconds() below (SGLang's /health >= 1 s).
    endpoint_seconds: Callable[[dict[str, Any], str], float] | None = None
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    _pending_events: list[tuple[dict[str, Any], str, str]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced, subs) in CORE_RESOURCES.items():
            if kind in self.absent_kinds:
                continue
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                singular=kind.lower(),
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                subresources=set(subs),
            )

    # -- helpers ------------------------------------------------------------------------

    def _subresources(self, res: Any) -> set[str]:
        info = self.resources[res]
        return set(info.subresources)

    def _store(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else copy.deepcopy(obj.raw)

    def _live(self) -> list[tuple[tuple[Any, str | None, str], dict[str, Any]]]:
        out = []
        for key, obj in list(self.objects.items()):
            if not obj.deleted:
                out.append((key, obj.raw))
        return out

    async def _emit(self, res: Any, type_: str, obj: dict[str, Any]) -> None:
        await self._buses[res].put({"type": type_, "object": copy.deepcopy(obj)})

    async def _write(
        self, key: tuple[Any, str | None, str], new: dict[str, Any], *, created: bool
    ) -> dict[str, Any]:
        self._last_rv = next(self._rv)
        new.setdefault("metadata", {})["resourceVersion"] = str(self._last_rv)
        if self.simulate_controllers:
            self._controller(new)
        if created:
            if key in self.objects:
                self.objects[key].create(new)
            else:
                self.objects[key] = new
        else:
            self.objects[key].create(new)  # a new version in the object's history
        await self._emit(key[0], "ADDED" if created else "MODIFIED", new)
        while self._pending_events:
            await self._record_event(*self._pending_events.pop(0))
        return new

    async def _record_event(self, obj: dict[str, Any], reason: str, message: str) -> None:
        """A controller's Warning event about ``obj`` (one per object and reason, like the
        API server's event aggregation)."""
        meta = obj.get("metadata") or {}
        name = f"{meta.get('name')}.{reason.lower()}"
        key = (kmock.resource("", "v1", "events"), meta.get("namespace"), name)
        if self._store(key) is not None:
            return
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta.get("namespace"), "uid": str(uuid.uuid4())},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "type": "Warning",
            "reason": reason,
            "message": message,
            "source": {"component": "job-controller"},
            "firstTimestamp": _now(),
            "lastTimestamp": _now(),
            "count": 1,
        }
        await self._write(key, event, created=True)

    def _probes_fail(self, obj: dict[str, Any]) -> str | None:
        """Why the workload's pods would never become Ready (a probe that times out), or None."""
        latency = self.endpoint_seconds or endpoint_seconds
        for container in pod_template_containers(obj):
            for kind in ("startupProbe", "readinessProbe"):
                probe = container.get(kind) or {}
                path = (probe.get("httpGet") or {}).get("path")
                if path is None:
                    continue
                took, limit = latency(container, path), float(probe.get("timeoutSeconds", 1))
                if took >= limit:
                    return (
                        f"{kind} of container {container.get('name')} failed: GET {path} took {took:g} s, "
                        f"timeoutSeconds is {limit:g}"
                    )
        return None

    def _controller(self, obj: dict[str, Any]) -> None:
        """Stand-in for kube-controller-manager/LWS controller status: pods Ready once their
        probes would pass (see ``endpoint_seconds``), within the namespace's quota."""
        kind = obj.get("kind")
        spec = obj.get("spec") or {}
        gen = obj.get("metadata", {}).get("generation")
        if kind not in ("Deployment", "StatefulSet", "LeaderWorkerSet", "Job"):
            return
        st = obj.setdefault("status", {})
        if kind in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            n = int(spec.get("replicas", 1))
            fit, refusal = n, None
            if kind == "Deployment":
                fit, refusal = self._quota_fit(obj, n)
            unready = self._probes_fail(obj)
            ready = 0 if unready else fit
            st.update(
                replicas=fit, readyReplicas=ready, availableReplicas=ready, updatedReplicas=fit, observedGeneration=gen
            )
            conds = [c for c in st.get("conditions") or [] if c.get("type") not in ("ReplicaFailure", "Available")]
            if refusal:
                conds.append(
                    {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": refusal}
                )
            if kind == "Deployment":
                conds.append(
                    {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable", "message": unready}
                    if unready and n
                    else {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
                )
            st["conditions"] = conds
        elif kind == "Job" and not st.get("conditions"):
            active = 0 if spec.get("suspend") else int(spec.get("parallelism", 1))
            if active:
                fit, refusal = self._quota_fit(obj, active)
                if refusal:
                    # The Job controller reports a refused pod only as a FailedCreate event.
                    active = fit
                    self._pending_events.append(
                        (obj, "FailedCreate", f"Error creating: {refusal}")
                    )
            st.update(active=active, ready=active)
            st.setdefault("startTime", _now())

    def _quota_fit(self, obj: dict[str, Any], wanted: int) -> tuple[int, str | None]:
        """How many of a Deployment's pods the namespace's ResourceQuotas admit, and why not more.

        Usage by other pods is not tracked (the emulator runs no pods): each quota's ``hard``
        is compared with this Deployment's pods alone."""
        ns = obj.get("metadata", {}).get("namespace")
        name = obj.get("metadata", {}).get("name")
        pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        per_pod: dict[str, Any] = {}
        for c in pod.get("containers") or []:
            res = c.get("resources") or {}
            # a limit without a request is also the request (the API server's defaulting)
            parts = {"requests": {**(res.get("limits") or {}), **(res.get("requests") or {})}}
            parts["limits"] = res.get("limits") or {}
            for part, values in parts.items():
                for rname, q in values.items():
                    key = f"{part}.{rname}"
                    per_pod[key] = per_pod.get(key, 0) + parse_quantity(q)[0]
        fit, refusal = wanted, None
        if ns in self.restricted_namespaces and (broken := restricted_problems(pod)):
            return 0, f'pods "{name}-" is forbidden: violates PodSecurity "restricted:latest": {"; ".join(broken)}'
        for (r, n, _), raw in self._live():
            if r.plural != "resourcequotas" or n != ns:
                continue
            qname = raw["metadata"]["name"]
            for key, hard in ((raw.get("spec") or {}).get("hard") or {}).items():
                full = f"requests.{key}" if key in ("cpu", "memory", "ephemeral-storage") else key
                if not full.startswith(("requests.", "limits.")):
                    continue  # object counts are not emulated
                if full not in per_pod:
                    fit, refusal = 0, f'pods "{name}-" is forbidden: failed quota: {qname}: must specify {full}'
                    continue
                can = int(parse_quantity(hard)[0] // per_pod[full]) if per_pod[full] > 0 else wanted
                if can < fit:
                    fit = can
                    refusal = (
                        f'pods "{name}-" is forbidden: exceeded quota: {qname}, requested: '
                        f"{full}={float(per_pod[full]):g}, used: {full}={float(per_pod[full] * can):g}, "
                        f"limited: {full}={hard}"
                    )
        return max(0, fit), refusal

    async def _delete(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        current = self._store(key)
        if current is None:
            return None
        meta = current.setdefault("metadata", {})
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = _now()
                await self._write(key, current, created=False)
            return current
        self.objects[key].delete()
        await self._emit(key[0], "DELETED", current)
        await self._collect(meta.get("uid"))
        return current

    async def _collect(self, uid: str | None) -> None:
        """The garbage collector: dependents of a deleted owner go too (background cascade)."""
        if not uid:
            return
        for key, raw in self._live():
            refs = raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                await self._delete(key)

    def _owner_exists(self, refs: list[dict[str, Any]]) -> bool:
        uids = {raw.get("metadata", {}).get("uid") for _, raw in self._live()}
        return all(r.get("uid") in uids for r in refs)

    # -- request handling ---------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's path parser reads "/api/v1/namespaces" as a namespace prefix and fails;
        # kopf lists/watches namespaces on start-up, so answer that collection here.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            if raw_request.query.get("watch") == "true":
                rsp = aiohttp.web.StreamResponse()
                await rsp.prepare(raw_request)
                await asyncio.sleep(float(raw_request.query.get("timeoutSeconds", "5")))
                return rsp
            items = [
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": n, "uid": n},
                    "status": {"phase": "Active"},
                }
                for n in sorted(self.namespaces)
            ]
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "NamespaceList",
                    "metadata": {"resourceVersion": str(self._last_rv)},
                    "items": items,
                }
            )
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        act = request.action
        if res is not None and (getattr(res, "plural", None) in self._absent_plurals()
                                or getattr(res, "group", None) == "kueue.x-k8s.io"):  # no Kueue here
            # What the API server answers for a kind it does not serve (its CRD not installed).
            return aiohttp.web.json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                    "message": "the server could not find the requested resource",
                },
                status=404,
            )
        if res is None or act in (None, enums.action.WATCH) or not self._known(res):
            # Discovery, watches and anything unknown: kmock's own behaviour.
            return await kmock.RawHandler._handle(self, request)
        async with self._lock:
            payload = await self._serve(request)
        return aiohttp.web.json_response(payload)

    @staticmethod
    def _typed(res: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """The API server takes apiVersion and kind from the URL when a body leaves them out (kopf
        posts webhook configurations that way)."""
        path = f"{res.group}/{res.version}/{res.plural}" if res.group else f"{res.version}/{res.plural}"
        known = CORE_RESOURCES.get(path)
        if known is None:
            return obj
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        obj.setdefault("kind", known[0])
        return obj

    def _admitted(self, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        if self.admit is None:
            return obj
        stored, problems = self.admit(obj, old)
        if problems:
            kind = obj.get("kind", "?")
            name = (obj.get("metadata") or {}).get("name", "?")
            raise _error(422, "Invalid", f"{kind} {name!r} is invalid: " + "; ".join(problems))
        return stored

    def _check_owner_references(self, obj: dict[str, Any]) -> None:
        if self.owner_reference_rules is None:
            return
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion"):
                continue
            group = ref.get("apiVersion", "").rpartition("/")[0]
            plural = next(
                (k.rsplit("/", 1)[1] for k, (kind, _, _) in CORE_RESOURCES.items() if kind == ref.get("kind")), "?"
            )
            wanted = f"{plural}/finalizers"
            if not any(
                group in r.get("apiGroups", []) and wanted in r.get("resources", []) and "update" in r.get("verbs", [])
                for r in self.owner_reference_rules
            ):
                name = (obj.get("metadata") or {}).get("name", "?")
                raise _error(
                    403,
                    "Forbidden",
                    f'{obj.get("kind", "?").lower()}s "{name}" is forbidden: cannot set blockOwnerDeletion if an '
                    "ownerReference refers to a resource you can't set finalizers on: cannot update resource "
                    f'"{wanted}" in API group "{group}"',
                )

    def _absent_plurals(self) -> set[str]:
        return {key.rsplit("/", 1)[1] for key, (kind, _, _) in CORE_RESOURCES.items() if kind in self.absent_kinds}

    def _validate(self, res: Any, obj: dict[str, Any]) -> None:
        """422 for what the API server's Go validation refuses (built-in kinds and LWS)."""
        if (res.group or "") not in BUILTIN_GROUPS and res.group != "leaderworkerset.x-k8s.io":
            return
        problems = object_problems(obj)
        if problems:
            kind = obj.get("kind", "?")
            name = (obj.get("metadata") or {}).get("name", "?")
            raise _error(422, "Invalid", f"{kind} {name!r} is invalid: " + "; ".join(problems))

    def _known(self, res: Any) -> bool:
        return any(res == r for r in self.resources)

    async def _serve(self, request: rendering.Request) -> dict[str, Any]:
        res, act, sub = request.resource, request.action, request.subresource
        ns, name = request.namespace, request.name
        if act == enums.action.LIST:
            selector = request.params.get("labelSelector", "")
            fields = request.params.get("fieldSelector", "")
            items = [
                raw
                for (r, n, _), raw in self._live()
                if r == res
                and (ns is None or n == ns)
                and matches_selector(raw.get("metadata", {}).get("labels") or {}, selector)
                and matches_fields(raw, fields)
            ]
            return {"metadata": {"resourceVersion": str(self._last_rv)}, "items": copy.deepcopy(items)}
        if act == enums.action.CREATE:
            obj = copy.deepcopy(request.data or {})
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if not meta.get("name"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            ns = ns or meta.get("namespace")
            if ns and self.resources[res].namespaced:
                meta["namespace"] = ns
            key = (res, ns, meta["name"])
            if self._store(key) is not None:
                raise _error(409, "AlreadyExists", f"{res.plural} {meta['name']!r} already exists")
            self._validate(res, obj)
            self._check_owner_references(obj)
            obj = self._admitted(self._typed(res, obj), None)
            meta = obj["metadata"]
            meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
            meta.pop("resourceVersion", None)
            obj = await self._write(key, stored_form(obj, res.group), created=True)
            if meta.get("ownerReferences") and not self._owner_exists(meta["ownerReferences"]):
                await self._delete(key)  # the GC collects children of owners that are gone
            return obj
        key = (res, ns, name)
        current = self._store(key)
        if current is None:
            raise _error(404, "NotFound", f"{res.plural} {name!r} not found")
        if act == enums.action.FETCH:
            return self._scale_view(current) if sub == "scale" else current
        if act == enums.action.DELETE:
            await self._delete(key)
            return current
        if act == enums.action.UPDATE:
            return await self._patch(key, current, request)
        raise _error(405, "MethodNotAllowed", f"{request.method} is not supported here")

    async def _patch(self, key: Any, current: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        sub = request.subresource
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        body = request.data
        if sub == "scale":
            replicas = (
                (merge_patch({}, body).get("spec") or {}).get("replicas")
                if ctype != "application/json-patch+json"
                else None
            )
            if ctype == "application/json-patch+json":
                view = jsonpatch.apply_patch(self._scale_view(current), body)
                replicas = view["spec"]["replicas"]
            if replicas is None:
                raise _error(422, "Invalid", "spec.replicas is required on the scale subresource")
            body, ctype, sub = {"spec": {"replicas": replicas}}, "application/merge-patch+json", None
        if ctype == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(current, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
                raise _error(422, "Invalid", f"the JSON patch cannot be applied: {err}") from None
        else:
            new = merge_patch(current, body)
        if current.get("kind") == "Job" and sub is None:
            before, after = current.get("spec") or {}, new.get("spec") or {}
            for field in ("template", "completions", "completionMode", "selector"):
                if field in before and before.get(field) != after.get(field) and not before.get("suspend"):
                    raise _error(
                        422, "Invalid", f"Job.batch {key[2]!r} is invalid: spec.{field}: field is immutable"
                    )
        has_status_sub = "status" in self._subresources(key[0])
        if sub == "status":
            new = {**current, "status": new.get("status")}
        elif has_status_sub:
            new["status"] = current.get("status")
            if new["status"] is None:
                new.pop("status")
        if sub is None:
            self._validate(key[0], new)
            new = self._admitted(new, current)
        new = stored_form(new, key[0].group)
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "creationTimestamp", "name", "namespace"):
            if fixed in current.get("metadata", {}):
                meta[fixed] = current["metadata"][fixed]
        strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if strip(new) != strip(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        else:
            meta["generation"] = current["metadata"].get("generation", 1)
        if json.dumps(new, sort_keys=True) == json.dumps(current, sort_keys=True):
            return current  # no-op patches do not bump resourceVersion (as the real server)
        out = await self._write(key, new, created=False)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._delete(key)
        return self._scale_view(out) if request.subresource == "scale" else out

    @staticmethod
    def _scale_view(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata", {})
        st = obj.get("status") or {}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": st.get("replicas", 0), "selector": st.get("selector", "")},
        }


def write_kubeconfig(path: Any, server: str, namespace: str, token: str = "test-token") -> None:
    """A kubeconfig for ``server`` (an emulator's URL) with a bearer token and a default
    namespace: how a test starts ``kuberl operator`` as a subprocess against the emulator."""
    import yaml

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": namespace}}],
    }
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)


@attrs.define(kw_only=True)
class RbacEmulator(ClusterEmulator):
    """The emulator with RBAC for the operator: requests from kopf or the operator's client
    (by User-Agent) are authorized against ``rules`` and answered 403 when denied, writes that
    set a blocking ownerReference need ``update`` on the owner's finalizers (see
    ``rbac_emulation``). ``used`` and ``denied`` record what the operator asked for; requests
    of the test itself (any other User-Agent) are not checked."""

    rules: list[dict[str, Any]] = attrs.field(factory=list)
    used: set[tuple[str, str, str]] = attrs.field(factory=set, init=False)
    denied: list[str] = attrs.field(factory=list, init=False)

    def _plurals(self) -> dict[tuple[str, str], str]:
        out = {}
        for key, (kind, _, _) in CORE_RESOURCES.items():
            parts = key.split("/")
            group = "" if len(parts) == 2 else parts[0]
            out[group, kind] = parts[-1]
        return out

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        agent = raw_request.headers.get("User-Agent", "")
        if agent.startswith(("kopf/", "kuberl-operator")):
            attrs_ = rbac_emulation.request_attributes(
                raw_request.method, raw_request.path, raw_request.query
            )
            needed = [attrs_.permission] if attrs_ is not None else []
            if raw_request.method in ("POST", "PATCH", "PUT") and raw_request.can_read_body:
                try:
                    body = json.loads(await raw_request.read() or b"null")
                except ValueError:
                    body = None
                needed += rbac_emulation.owner_permissions(body, self._plurals())
            for perm in needed:
                self.used.add(perm)
                if not rbac_emulation.allowed(self.rules, perm):
                    verb, group, resource = perm
                    what = f'User "system:serviceaccount:kuberl:operator" cannot {verb} resource "{resource}" in API group "{group}"'
                    self.denied.append(f"{raw_request.method} {raw_request.path}: {what}")
                    return aiohttp.web.json_response(
                        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                         "message": f"{what}", "code": 403},
                        status=403,
                    )  # fmt: skip
        return await super().__call__(raw_request)
