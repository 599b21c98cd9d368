"""Read manifests (multi-document YAML) into typed resources, with errors a person can act on."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kuberl import API_VERSION

from .common import Resource
from .job import AgenticRLJob
from .rollout_fleet import RolloutFleet
from .sandbox_pool import SandboxPool

KINDS: dict[str, type[Resource]] = {cls.KIND: cls for cls in (AgenticRLJob, RolloutFleet, SandboxPool)}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file, object and field."""


def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def format_validation_error(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        # Pydantic puts validator-raised messages behind "Value error, ".
        msg = e["msg"].removeprefix("Value error, ")
        loc = _loc(p for p in e["loc"] if not str(p).startswith("function-"))
        lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def parse_resource(doc: Any, source: str = "<input>") -> Resource:
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: expected a mapping with apiVersion/kind, got {type(doc).__name__}")
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
    where = f"{source}: {kind or '?'}/{name}"
    if api_version != API_VERSION:
        raise ManifestError(f"{where}: apiVersion must be {API_VERSION!r} (got {api_version!r})")
    if kind not in KINDS:
        raise ManifestError(f"{where}: unknown kind {kind!r}; expected one of {', '.join(sorted(KINDS))}")
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as err:
        details = "\n  ".join(format_validation_error(err))
        raise ManifestError(f"{where} is invalid:\n  {details}") from None


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ManifestError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise ManifestError(f"{path}: not valid YAML: {err}") from None
    if not docs:
        raise ManifestError(f"{path}: no documents")
    return docs


def load_manifests(path: str | Path) -> list[Resource]:
    """Every kuberl resource in the file; the first invalid one raises ManifestError."""
    return [parse_resource(d, str(path)) for d in load_documents(path)]


def find_one(resources: list[Resource], kind: type[Resource]) -> Any:
    found = [r for r in resources if isinstance(r, kind)]
    if not found:
        raise ManifestError(f"no {kind.KIND} in the manifest")
    return found[0]
