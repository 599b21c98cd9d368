"""The kuberl resources the tests build, as manifests (what kubectl sends) and as models.

Each starts from a minimal valid spec, or from another manifest (``of``), and replaces the
spec's top-level keys given as keywords; a key given None is left out."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import find_one, load_manifests
from kuberl.api.rollout_fleet import RolloutFleet

API_VERSION = "kuberl.io/v1alpha1"


def manifest(
    kind: str,
    of: Mapping[str, Any],
    name: str | None,
    namespace: str | None,
    spec: Mapping[str, Any],
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``of`` (a deep copy) as a ``kind``, renamed, moved, labelled and annotated where given,
    its spec's keys replaced by ``spec``'s."""
    doc = copy.deepcopy(dict(of))
    doc["apiVersion"], doc["kind"] = API_VERSION, kind
    meta = doc.setdefault("metadata", {})
    if name is not None:
        meta["name"] = name
    if namespace is not None:
        meta["namespace"] = namespace
    if labels:
        meta["labels"] = {**meta.get("labels", {}), **labels}
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    merged = {**doc.get("spec", {}), **copy.deepcopy(dict(spec))}
    doc["spec"] = {k: v for k, v in merged.items() if v is not None}
    return doc


MINIMAL_JOB: dict[str, Any] = {"metadata": {"name": "j"}, "spec": {"model": {"base": "m"}, "data": {"train": "d"}}}
MINIMAL_FLEET: dict[str, Any] = {"metadata": {"name": "f"}, "spec": {"model": {"uri": "m"}}}


def job_manifest(
    name: str | None = None,
    namespace: str | None = None,
    *,
    of: Mapping[str, Any] = MINIMAL_JOB,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """An AgenticRLJob manifest: ``of`` (default: "j", a model and training data) with ``spec``."""
    return manifest("AgenticRLJob", of, name, namespace, spec, labels, annotations)


def job(
    name: str | None = None,
    namespace: str | None = None,
    *,
    of: Mapping[str, Any] = MINIMAL_JOB,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    **spec: Any,
) -> AgenticRLJob:
    """The AgenticRLJob of ``job_manifest``'s manifest."""
    return AgenticRLJob.model_validate(
        job_manifest(name, namespace, of=of, labels=labels, annotations=annotations, **spec)
    )


def fleet_manifest(
    name: str | None = None, namespace: str | None = None, *, of: Mapping[str, Any] = MINIMAL_FLEET, **spec: Any
) -> dict[str, Any]:
    """A RolloutFleet manifest: ``of`` (default: "f" and a model) with ``spec``."""
    return manifest("RolloutFleet", of, name, namespace, spec)


def fleet(
    name: str | None = None, namespace: str | None = None, *, of: Mapping[str, Any] = MINIMAL_FLEET, **spec: Any
) -> RolloutFleet:
    """The RolloutFleet of ``fleet_manifest``'s manifest."""
    return RolloutFleet.model_validate(fleet_manifest(name, namespace, of=of, **spec))


def load_job(folder: Path, of: Mapping[str, Any] | str = MINIMAL_JOB, **spec: Any) -> AgenticRLJob:
    """The job (``job_manifest``'s, or a YAML text as it is) written to ``folder``/job.yaml and
    read back as ``kuberl run`` reads a file."""
    if isinstance(of, str):
        if spec:
            raise TypeError("a job given as YAML text takes no spec keys")
        text = of
    else:
        text = yaml.safe_dump(job_manifest(of=of, **spec))
    path = folder / "job.yaml"
    path.write_text(text)
    return find_one(load_manifests(str(path)), AgenticRLJob)
