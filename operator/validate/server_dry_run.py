"""``kuberl validate --server``: the API server's own verdict on a manifest and on the children the
operator would make of it.

Each object goes to the server as a server-side apply with ``dryRun=All`` (nothing is stored) and
``fieldValidation=Strict`` (an unknown field is an error, as ``kubectl apply`` makes it), through
the kubeconfig's current context. The kuberl objects the server accepts come back with the CRD's
defaults filled in, and are read again by the kuberl models: a default the server adds must not
turn a valid manifest into one the operator refuses.
"""

from __future__ import annotations

import json
from typing import Any

from kuberl.api.job import QUEUE_LABEL

FIELD_MANAGER = "kuberl-validate"


class ServerUnavailable(RuntimeError):
    """No kubeconfig, or the server could not be reached; the message says which."""


def dynamic_client() -> Any:
    """A DynamicClient for the current kubeconfig context (``$KUBECONFIG`` or ~/.kube/config)."""
    try:
        from kubernetes import config, dynamic
        from kubernetes.config.config_exception import ConfigException
    except ImportError as err:
        raise ServerUnavailable("--server needs the kubernetes client: pip install 'kuberl[operator]'") from err
    try:
        api = config.new_client_from_config()
    except (ConfigException, OSError) as err:
        raise ServerUnavailable(f"--server needs a kubeconfig ($KUBECONFIG or ~/.kube/config): {err}") from err
    try:
        return dynamic.DynamicClient(api)
    except Exception as err:  # noqa: BLE001 - discovery failing is a connection problem, whatever its type
        raise ServerUnavailable(f"--server: the API server at {api.configuration.host} did not answer: {err}") from err


def _reason(err: Any) -> str:
    body = getattr(err, "body", None)
    try:
        status = json.loads(body) if body else {}
    except (TypeError, ValueError):
        status = {}
    return status.get("message") or getattr(err, "reason", None) or str(err)


def dry_run(client: Any, obj: dict[str, Any], namespace: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the object as the server would store it, None) or (None, the server's refusal)."""
    from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

    what = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
    try:
        resource = client.resources.get(api_version=obj.get("apiVersion"), kind=obj.get("kind"))
    except ResourceNotFoundError:
        hint = " (install the CRDs: kubectl apply --server-side -f crds/)" if "kuberl.io" in str(obj.get("apiVersion")) else ""
        return None, f"{what}: the server does not serve {obj.get('apiVersion')} {obj.get('kind')}{hint}"
    ns = (obj.get("metadata") or {}).get("namespace") or namespace
    try:
        out = client.server_side_apply(
            resource, body=obj, namespace=ns if resource.namespaced else None, field_manager=FIELD_MANAGER,
            force_conflicts=True, dry_run="All", query_params=[("fieldValidation", "Strict")],
        )  # fmt: skip
    except DynamicApiError as err:
        return None, f"{what}: the API server refuses it: {_reason(err)}"
    return out.to_dict(), None


def server_problems(client: Any, docs: list[dict[str, Any]], namespace: str) -> list[str]:
    """The server's refusals of ``docs``, of the kuberl objects it would store (read again by the
    models, with its defaults) and of the children the operator renders from them."""
    from kuberl.api.loader import ManifestError, parse_resource
    from kuberl.operator.render.builders import build_for

    problems: list[str] = []
    todo = [(doc, "") for doc in docs]
    while todo:
        obj, made_by = todo.pop(0)
        stored, refusal = dry_run(client, obj, namespace)
        if refusal:
            problems.append(made_by + refusal)
            continue
        assert stored is not None
        if not str(obj.get("apiVersion", "")).startswith("kuberl.io/"):
            continue
        # A kuberl object, the user's or a job's inline fleet or pool: read again with the
        # defaults the server filled in, then its own children the same way.
        try:
            resource = parse_resource({k: v for k, v in stored.items() if k != "status"}, "as the server stores it")
        except ManifestError as err:
            problems.append(f"{made_by}with the CRD's defaults the server fills in, {err}")
            continue
        ns = (stored.get("metadata") or {}).get("namespace") or namespace
        if queue := (resource.metadata.labels or {}).get(QUEUE_LABEL):
            problems += local_queue_problems(client, ns, queue)
        todo += [(child, "the operator's ") for child in build_for(resource, ns)]
    return problems


def local_queue_problems(client: Any, namespace: str, queue: str) -> list[str]:
    """A job's queue label names a LocalQueue of its namespace that exists ([]), or why not."""
    from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

    from kuberl.operator.validate.admission import missing_queue_message

    try:
        queues = client.resources.get(api_version="kueue.x-k8s.io/v1beta2", kind="LocalQueue")
    except ResourceNotFoundError:
        return [f"metadata.labels[{QUEUE_LABEL}]: the server does not serve Kueue's LocalQueues: install Kueue "
                "(docs/cluster.md, \"shared cluster with Kueue\") or drop the label"]
    try:
        queues.get(name=queue, namespace=namespace)
    except NotFoundError:
        return [missing_queue_message(namespace, queue)]
    return []
