"""Read manifests (multi-document YAML) into typed resources, with errors a person can act on."""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kuberl.api.common import PATTERN_RULES, FieldError, Resource
from kuberl.api.group import API_VERSION
from kuberl.api.job import AgenticRLJob
from kuberl.api.rollout_fleet import RolloutFleet
from kuberl.api.sandbox_pool import SandboxPool

KINDS: dict[str, type[Resource]] = {cls.KIND: cls for cls in (AgenticRLJob, RolloutFleet, SandboxPool)}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file, object and field."""


class KubeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers the way kubectl does.

    PyYAML follows YAML 1.1, where ``1e-6`` (no dot) is a string; kubectl's YAML reader makes
    it a number. With strict models that difference would make `kuberl validate` reject a
    ``learningRate: 1e-6`` that `kubectl apply` accepts.
    """


KubeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class PlainDumper(yaml.SafeDumper):
    """PyYAML's safe dumper without anchors and aliases (``&id001`` / ``*id001``): an object used
    twice is written out twice. Anchors are valid YAML, but kubectl diffs, Helm, GitOps tools
    and people reading a CRD or `kuberl render` output should not have to resolve them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(doc: Any) -> str:
    return yaml.dump(doc, Dumper=PlainDumper, sort_keys=False, width=120)


def dump_yaml_all(docs: Iterable[Any]) -> str:
    return yaml.dump_all(list(docs), Dumper=PlainDumper, sort_keys=False, width=120)


def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _words(name: str) -> str:
    """``lossAggregation`` -> ``loss aggregation``."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r" \1", name).lower()


def _singular(name: str) -> str:
    return name[:-1] if name.endswith("s") and not name.endswith("ss") else name


def _noun(loc: Sequence[Any]) -> str:
    """What a field holds, in words: ``spec.accelerator.profile`` -> ``accelerator profile``,
    ``spec.stages[0].type`` -> ``stage type``, ``spec.rollout.tools[0]`` -> ``rollout tool``."""
    named = [(i, p) for i, p in enumerate(loc) if isinstance(p, str)]
    if not named:
        return "value"
    i, last = named[-1]
    if i < len(loc) - 1:  # a list element of `last`
        words = [_singular(last)]
        parent = named[-2] if len(named) > 1 else None
    else:
        words = [last]
        parent = named[-2] if len(named) > 1 else None
    if parent is not None and parent[1] not in ("spec", "metadata", "status"):
        j, pname = parent
        listed = j + 1 < len(loc) and isinstance(loc[j + 1], int)
        words.insert(0, _singular(pname) if listed else pname)
    return " ".join(_words(w) for w in words)


def _unwrap(ann: Any) -> Any:
    """``X | None`` and ``Annotated[X, ...]`` -> ``X``."""
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) != 1:
                return ann
            ann = args[0]
        else:
            return ann


def _model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model class that validated the object at ``loc`` (walking fields, lists and maps)."""
    ann: Any = root
    for part in loc:
        ann = _unwrap(ann)
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(part, str):
            field = next(
                (f for n, f in ann.model_fields.items() if part in (n, f.alias)),
                None,
            )
            if field is None:
                return None
            ann = field.annotation
        elif origin is list and isinstance(part, int):
            ann = typing.get_args(ann)[0]
        elif origin is dict and isinstance(part, str):
            ann = typing.get_args(ann)[1]
        else:
            return None
    ann = _unwrap(ann)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _unknown_field(key: str, model: type[BaseModel] | None) -> str:
    msg = f"unknown field {key!r}"
    if model is None:
        return msg
    known = [f.alias or n for n, f in model.model_fields.items()]
    same = [k for k in known if k.lower() == key.lower()]
    close = same or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"{msg}; did you mean {close[0]!r}?"
    return f"{msg}; known fields: {', '.join(sorted(known))}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message(e: dict[str, Any], loc: Sequence[Any], model: type[BaseModel] | None) -> str:
    kind, ctx = e["type"], e.get("ctx") or {}
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        expected = f"one of {', '.join(options)}" if len(options) > 1 else ", ".join(options)
        return f"unknown {_noun(loc)} {_short(e['input'])}; expected {expected}"
    if kind == "extra_forbidden" and loc and isinstance(loc[-1], str):
        return _unknown_field(loc[-1], _model_at(model, loc[:-1]) if model else None)
    if kind == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_RULES:
        return f"{PATTERN_RULES[ctx['pattern']]} (got {_short(e['input'])})"
    # Pydantic puts validator-raised messages behind "Value error, ".
    msg = e["msg"].removeprefix("Value error, ")
    if kind.endswith("_type") and "input" in e:
        msg += f" (got {type(e['input']).__name__} {_short(e['input'])})"
    return msg


# Pydantic names the member of a union (int | str) an error came from inside the location.
_UNION_TAGS = {"int", "str", "float", "bool"}


def format_validation_error(err: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One line per error: ``field.path: message``. With ``model`` (the class that was
    validated), an unknown field gets a "did you mean" from the fields that exist there."""
    lines: list[str] = []
    last: tuple[str, str] | None = None
    for e in err.errors(include_url=False):
        loc = [p for p in e["loc"] if not str(p).startswith("function-") and p not in _UNION_TAGS]
        error = (e.get("ctx") or {}).get("error")
        if isinstance(error, FieldError):
            loc += list(error.at)
        where = _loc(loc)
        if (
            last is not None
            and last[0] == where
            and e["type"].endswith("_type")
            and last[1].endswith("_type")
        ):
            # int | str given a float: one line, "a valid integer or a valid string (got ...)".
            other = e["msg"].removeprefix("Input should be ")
            lines[-1] = lines[-1].replace(" (got ", f" or {other} (got ", 1)
            continue
        msg = _message(e, loc, model)
        lines.append(f"{where}: {msg}" if loc else msg)
        last = (where, e["type"])
    return lines


def non_json_numbers(node: Any, at: str = "") -> list[tuple[str, float]]:
    """(field path, value) of every NaN or infinity in a parsed manifest: YAML has them, JSON
    (what the API server stores) does not."""
    if isinstance(node, float) and (math.isnan(node) or math.isinf(node)):
        return [(at or "<root>", node)]
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in non_json_numbers(v, f"{at}.{k}" if at else str(k))]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in non_json_numbers(v, f"{at}[{i}]")]
    return []


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
    not_json = non_json_numbers(doc)
    if not_json:
        raise ManifestError(f"{where} is invalid:\n  " + "\n  ".join(
            f"{at}: {value} is not a JSON number (.nan/.inf in YAML): the API server cannot store it, "
            "kubectl refuses to send it" for at, value in not_json))
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as err:
        details = "\n  ".join(format_validation_error(err, KINDS[kind]))
        raise ManifestError(f"{where} is invalid:\n  {details}") from None


def _yaml_error(path: Path, err: yaml.YAMLError) -> ManifestError:
    """``file:line:column: problem`` instead of PyYAML's ``in "<unicode string>"``."""
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem_mark is None:
        return ManifestError(f"{path}: not valid YAML: {err}")
    mark = err.problem_mark
    msg = f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {err.problem}"
    if err.context:
        cm = err.context_mark
        msg += f" ({err.context}" + (f" at line {cm.line + 1}, column {cm.column + 1})" if cm else ")")
    return ManifestError(msg)


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ManifestError(f"{path}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ManifestError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None
    try:
        docs = [d for d in yaml.load_all(text, Loader=KubeYamlLoader) if d is not None]
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
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
