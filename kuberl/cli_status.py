"""`kuberl status [JOB | RUN_DIR]`: a job's figures on one screen, on a cluster or from a run folder.

On a cluster it reads the AgenticRLJob's status (phase, stage, step, reward, pass rate,
tool-error ratio, conditions) and its children's readiness with the kubernetes client (the
operator extra), from the in-cluster service account or the current kubeconfig context.
Locally it reads the run folder ``kuberl run`` writes (metrics.jsonl, events.jsonl, run.json).
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from kuberl.api.group import GROUP, VERSION
from kuberl.status_view import (
    LIST_HEADER,
    child_refs,
    cluster_lines,
    job_row,
    local_lines,
    read_run_folder,
    table,
)

PLURALS = {"RolloutFleet": "rolloutfleets", "SandboxPool": "sandboxpools"}


class StatusError(ValueError):
    """No cluster to ask, or the job is not there (main prints it as one line)."""


def _clients() -> tuple[Any, Any, str]:
    """(CustomObjectsApi, BatchV1Api, default namespace) for this cluster."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise StatusError(
            "kuberl status JOB reads the cluster with the kubernetes client: pip install 'kuberl[operator]' "
            "(or pass a run folder to read a local run)"
        ) from None
    namespace = "default"
    try:
        config.load_incluster_config()
        ns_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        if ns_file.is_file():
            namespace = ns_file.read_text().strip() or namespace
    except config.ConfigException:
        # $KUBECONFIG as it is now: the client reads it once, when it is first imported
        kubeconfig = os.environ.get("KUBECONFIG") or None
        try:
            config.load_kube_config(config_file=kubeconfig)
        except (config.ConfigException, OSError) as err:
            raise StatusError(
                f"no cluster to ask ({err}); set KUBECONFIG or pass a run folder of `kuberl run` "
                "(e.g. kuberl status runs/quickstart)"
            ) from None
        try:
            _, ctx = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (ctx or {}).get("context", {}).get("namespace") or namespace
        except (config.ConfigException, OSError):
            pass
    return client.CustomObjectsApi(), client.BatchV1Api(), namespace


def _get(fn, *args) -> Any:
    """The object, or None when the API answers 404; other answers are a StatusError."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        return fn(*args)
    except ApiException as err:
        if err.status == 404:
            return None
        raise StatusError(f"the API server answered {err.status} {err.reason}: {err.body}") from None
    except urllib3.exceptions.HTTPError as err:
        raise StatusError(f"cannot reach the API server ({err}); check the kubeconfig context") from None


def cluster_status(name: str | None, namespace: str | None) -> list[str]:
    custom, batch, default_ns = _clients()
    ns = namespace or os.environ.get("KUBERL_NAMESPACE") or default_ns
    now = datetime.datetime.now(datetime.UTC)
    if name is None:
        items = (_get(custom.list_namespaced_custom_object, GROUP, VERSION, ns, "agenticrljobs") or {}).get(
            "items", []
        )
        if not items:
            return [f"no AgenticRLJobs in namespace {ns}"]
        return table(
            LIST_HEADER, [job_row(o, now) for o in sorted(items, key=lambda o: o["metadata"]["name"])]
        )
    obj = _get(custom.get_namespaced_custom_object, GROUP, VERSION, ns, "agenticrljobs", name)
    if obj is None:
        raise StatusError(f"AgenticRLJob {name} not found in namespace {ns} (kuberl status lists them)")
    children = []
    for kind, child in child_refs(obj):
        if kind == "Job":  # a typed model: back to the API's JSON form, like the custom objects
            live = batch.api_client.sanitize_for_serialization(_get(batch.read_namespaced_job, child, ns))
        else:
            live = _get(custom.get_namespaced_custom_object, GROUP, VERSION, ns, PLURALS[kind], child)
        children.append((kind, child, live))
    return cluster_lines(obj, children, now)


def cmd_status(args: argparse.Namespace) -> int:
    target = args.target
    if target is not None and (Path(target).is_dir() or os.sep in target or target.startswith(".")):
        records, events, info = read_run_folder(target)
        lines = local_lines(target, records, events, info)
    else:
        lines = cluster_status(target, args.namespace)
    print("\n".join(lines))
    return 0


def add_command(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    s = sub.add_parser(
        "status",
        help="a job's phase, stage, step, reward and accuracy on one screen (cluster or run folder)",
        description="With a run folder of `kuberl run` (a path): the run's state, stage and step out of "
        "the total, reward, tool-error ratio in positives, clip ratios, truncation, held-out accuracy, step "
        "time, tokens/s, ETA and the last checkpoint. With a job name: the AgenticRLJob's status on the "
        "cluster (phase, stage, step, reward, pass rate, tool-error ratio, conditions) and whether its "
        "trainer Job, fleet and sandbox pool are ready; with neither, every job of the namespace, like "
        "`kubectl get agenticrljobs` with the run's figures. The cluster comes from the in-cluster "
        "service account or the current kubeconfig context (needs the operator extra).",
        epilog="Examples: kuberl status runs/quickstart | kuberl status quickstart -n ml | kuberl status",
        formatter_class=fmt,
    )
    s.add_argument(
        "target",
        nargs="?",
        metavar="JOB|RUN_DIR",
        help="an AgenticRLJob name on the cluster, or a run folder (a path: it exists, or has a /)",
    )
    s.add_argument(
        "--namespace",
        "-n",
        default=None,
        help="namespace of the job (default: $KUBERL_NAMESPACE, else the kubeconfig context's, else default)",
    )
    s.set_defaults(func=cmd_status)
