"""Generate apiextensions.k8s.io/v1 CRDs from the pydantic models.

Pydantic emits JSON Schema 2020-12 with $refs and anyOf; Kubernetes wants a *structural*
OpenAPI v3 schema (every node typed, no $ref, boolean exclusiveMinimum, int-or-string and
preserve-unknown-fields as x-kubernetes-* extensions). ``structural`` does that translation,
so the CRDs are never edited by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuberl.api.common import RESOURCE_NAME_PATTERN, Resource
from kuberl.api.group import GROUP, VERSION
from kuberl.api.job import RolloutSpec
from kuberl.api.loader import KINDS, dump_yaml

_DROP = {"title", "discriminator"}

# CEL rules for what the per-field schema cannot say; the pydantic validators say the same
# thing for `kuberl validate`, these make the API server say it for `kubectl apply` without the
# (optional) admission webhook. Rules run after defaulting, so a field with a schema default
# is always present; fields without one need has(). Paths name properties; "[]" steps into a
# list's items. tests/test_api.py evaluates every rule against the invalid corpus.
_REPLICAS_RULE = {
    "rule": "!has(self.autoscaling) || !has(self.replicas) || (self.replicas >= self.autoscaling.minReplicas && "
    "self.replicas <= self.autoscaling.maxReplicas)",
    "message": "replicas must lie within [autoscaling.minReplicas, autoscaling.maxReplicas]",
}
_BOUNDS_RULE = {
    "rule": "self.minReplicas <= self.maxReplicas",
    "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
}
_TP_SPAN_RULE = {
    "rule": "!has(self.engine) || !has(self.accelerator) || self.accelerator.profile == 'cpu' || "
    "self.engine.tensorParallel <= self.accelerator.count || "
    "self.engine.tensorParallel % self.accelerator.count == 0",
    "message": "engine.tensorParallel spans nodes, so it must be a multiple of accelerator.count",
}
_WHOLE_NODES_RULE = {
    # accelerator has no schema default (a per-kind default_factory): absent means mi300x x 1.
    "rule": "!has(self.engine) || self.engine.tensorParallel <= (has(self.accelerator) ? "
    "self.accelerator.count : 1) || (has(self.accelerator) && (self.accelerator.profile == 'cpu' || "
    "self.accelerator.count == 8))",
    "message": "engine.tensorParallel spans pods, which must be whole nodes: set accelerator.count: 8",
}
_FLEET_RULES = [_REPLICAS_RULE, _TP_SPAN_RULE, _WHOLE_NODES_RULE]
_HAS_CONTEXT = "has(self.fleet) && has(self.fleet.engine) && has(self.fleet.engine.contextLength)"
_CONTEXT = "self.rollout.fleet.engine.contextLength"
_ROLLOUT_BUDGET = (
    "has(self.rollout) && has(self.rollout.maxResponseTokens) ? self.rollout.maxResponseTokens : "
    f"{RolloutSpec.model_fields['max_response_tokens'].default}"
)

CEL_RULES: dict[str, dict[tuple[str, ...], list[dict[str, str]]]] = {
    "AgenticRLJob": {
        (): [
            {
                "rule": f"!has(self.rollout) || !({_HAS_CONTEXT.replace('self.', 'self.rollout.')}) || "
                f"!has(self.stages) || self.stages.all(s, s.type != 'rl' || !has(s.maxResponseTokens) || "
                f"s.maxResponseTokens < {_CONTEXT})",
                "message": "every rl stage's maxResponseTokens must be < rollout.fleet.engine.contextLength "
                "(SGLang rejects requests whose prompt + response reach it)",
            },
            {
                "rule": "!has(self.algorithm) || !has(self.algorithm.lengthReward) || !has(self.stages) || "
                "self.stages.all(s, s.type != 'rl' || self.algorithm.lengthReward.targets.all(t, t < "
                f"(has(s.maxResponseTokens) ? s.maxResponseTokens : {_ROLLOUT_BUDGET})))",
                "message": "every algorithm.lengthReward target must be below each rl stage's response "
                "budget (maxResponseTokens)",
            },
        ],
        ("algorithm",): [
            {
                "rule": "self.name != 'grpo' || !has(self.oversample) || self.oversample == 1.0",
                "message": "algorithm.oversample needs name: grpo-roc; "
                "plain grpo keeps every rollout it samples",
            },
            {
                "rule": "self.miniBatches <= self.batchPrompts",
                "message": "algorithm.miniBatches must be <= algorithm.batchPrompts",
            },
        ],
        ("algorithm", "lengthReward"): [
            {
                "rule": "!has(self.instruction) || self.instruction.contains('{target}')",
                "message": "algorithm.lengthReward.instruction must contain {target}",
            }
        ],
        ("algorithm", "clip"): [
            {"rule": "self.high >= self.low", "message": "clip.high must be >= clip.low"},
            {
                "rule": "!has(self.negativeRatioCap) || self.negativeRatioCap > 1.0 + self.high",
                "message": "clip.negativeRatioCap must exceed 1 + clip.high",
            },
        ],
        ("rollout",): [
            {
                "rule": "!(has(self.fleetRef) && has(self.fleet))",
                "message": "set rollout.fleetRef or rollout.fleet, not both",
            },
            {
                "rule": f"!({_HAS_CONTEXT}) || self.maxResponseTokens < self.fleet.engine.contextLength",
                "message": "rollout.maxResponseTokens must be < rollout.fleet.engine.contextLength "
                "(SGLang rejects requests whose prompt + response reach it)",
            },
        ],
        ("rollout", "fleet"): _FLEET_RULES,
        ("rollout", "fleet", "autoscaling"): [_BOUNDS_RULE],
        ("sandbox",): [
            {
                "rule": "!(has(self.poolRef) && has(self.pool))",
                "message": "set sandbox.poolRef or sandbox.pool, not both",
            }
        ],
        ("sandbox", "pool"): [_REPLICAS_RULE],
        ("sandbox", "pool", "autoscaling"): [_BOUNDS_RULE],
        ("stages", "[]"): [
            {
                "rule": "self.type == 'rl' || !has(self.difficultyFilter)",
                "message": "difficultyFilter applies to rl stages only",
            }
        ],
    },
    "SandboxPool": {(): [_REPLICAS_RULE], ("autoscaling",): [_BOUNDS_RULE]},
    "RolloutFleet": {(): _FLEET_RULES, ("autoscaling",): [_BOUNDS_RULE]},
}

_CKPT_URI = "(has({0}.spec.checkpoint) ? {0}.spec.checkpoint.uri : 'runs/checkpoints')"

# Rules on the whole object: only these may read metadata.name and status.
ROOT_RULES: dict[str, list[dict[str, str]]] = {
    "AgenticRLJob": [
        {
            # A transition rule (oldSelf): it runs on updates only. A started run's checkpoints are of
            # its model; a restarted trainer would refuse them (another model) or, with another
            # checkpoint.uri, silently start over.
            "rule": "!has(oldSelf.status) || !has(oldSelf.status.phase) || "
            "!(oldSelf.status.phase in ['Running', 'Suspended']) || "
            f"(self.spec.model == oldSelf.spec.model && {_CKPT_URI.format('self')} == "
            f"{_CKPT_URI.format('oldSelf')})",
            "message": "spec.model and spec.checkpoint.uri cannot change while the job is Running or "
            "Suspended (its checkpoints are of this model); create a new job to train another",
        },
        {
            "rule": "size(self.metadata.name) + size(string((has(self.spec.trainer) ? "
            "self.spec.trainer.replicas : 1) - 1)) <= 54",
            "message": "metadata.name is too long: the trainer pods' hostnames <name>-trainer-<index> "
            "must fit 63 characters",
        }
    ]
}

PRINTER_COLUMNS: dict[str, list[dict[str, Any]]] = {
    "AgenticRLJob": [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        # Kueue's queue (label) and why the job is held (Queued, Preempted, ...; Resumed: running)
        {"name": "Queue", "type": "string", "jsonPath": ".metadata.labels.kueue\\.x-k8s\\.io/queue-name"},
        {"name": "Suspended", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Suspended")].reason'},
        {"name": "Stage", "type": "string", "jsonPath": ".status.stage"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
        {"name": "Reward", "type": "number", "jsonPath": ".status.summary.rewardMean"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    "RolloutFleet": [
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Policy", "type": "string", "jsonPath": ".spec.scheduler.policy"},
        {"name": "KV-Cache", "type": "number", "jsonPath": ".status.kvCacheUtilization"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    "SandboxPool": [
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Queue", "type": "number", "jsonPath": ".status.queueDepth"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)]


def structural(node: Any, defs: dict[str, Any], in_status: bool = False) -> Any:
    """Translate one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs, in_status)
    node = dict(node)
    if node.get("x-kubernetes-int-or-string"):
        out = {"x-kubernetes-int-or-string": True}
        for key in ("description", "pattern"):
            if key in node:
                out[key] = node[key]
        if "pattern" in out:  # a quantity: kubebuilder's form (the pattern checks strings only)
            out = {"anyOf": [{"type": "integer"}, {"type": "string"}], **out}
        return out
    for key in ("anyOf", "oneOf"):
        if key in node:
            options = [o for o in node.pop(key) if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express {key} with {len(options)} non-null options structurally")
            if node.get("default") is None:
                node.pop("default", None)
            # Optional[X]: X's schema, with this node's own description/default on top.
            return {**structural(options[0], defs, in_status), **structural(node, defs, in_status)}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "const":
            out["enum"] = [value]
            out.setdefault("type", _json_type(value))
        elif key == "properties":
            out["properties"] = {k: structural(v, defs, in_status) for k, v in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs, in_status)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out["additionalProperties"] = structural(value, defs, in_status)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "default":
            if value is not None and not in_status:
                out["default"] = value
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = _json_type(out["enum"][0])
    if "properties" in out or out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("type", "object")
    return out


def _at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for part in path:
        schema = schema["items"] if part == "[]" else schema["properties"][part]
    return schema


def schema_for(kind: type[Resource]) -> dict[str, Any]:
    full = kind.model_json_schema(by_alias=True, mode="validation")
    defs = full.get("$defs", {})
    props = full["properties"]
    spec = structural(props["spec"], defs)
    for path, rules in CEL_RULES.get(kind.KIND, {}).items():
        _at(spec, path)["x-kubernetes-validations"] = rules
    status = structural(props["status"], defs, in_status=True)
    # kopf and kubectl write fields of their own under status; a schema that prunes them
    # makes status patches silently vanish.
    status["x-kubernetes-preserve-unknown-fields"] = True
    spec.pop("default", None)
    root: dict[str, Any] = {"x-kubernetes-validations": ROOT_RULES[kind.KIND]} if kind.KIND in ROOT_RULES else {}
    return {
        **root,
        "type": "object",
        "description": (kind.__doc__ or kind.KIND).strip().splitlines()[0],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # The only metadata restriction a CRD may declare: the name rule kuberl needs for
            # the Services and pods it derives from the name.
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 63, "pattern": RESOURCE_NAME_PATTERN}},
            },
            "spec": spec,
            "status": status,
        },
    }


def crd_for(kind: type[Resource]) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if "replicas" in kind.model_fields["spec"].annotation.model_fields:  # type: ignore[union-attr]
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kind.PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/managed-by": "kuberl"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.KIND,
                "listKind": f"{kind.KIND}List",
                "plural": kind.PLURAL,
                "singular": kind.KIND.lower(),
                "shortNames": list(kind.SHORT_NAMES),
                "categories": ["kuberl", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema_for(kind)},
                    "subresources": subresources,
                    "additionalPrinterColumns": PRINTER_COLUMNS[kind.KIND],
                }
            ],
        },
    }


def all_crds() -> dict[str, dict[str, Any]]:
    """File name -> CRD object, for every kind."""
    return {f"{cls.PLURAL}.{GROUP}.yaml": crd_for(cls) for cls in KINDS.values()}


HEADER = "# Generated by `kuberl crds` from kuberl.api; do not edit.\n"


def render(crd: dict[str, Any]) -> str:
    return HEADER + dump_yaml(crd)


def _orphans(out: Path, want: dict[str, Any]) -> list[Path]:
    """Files an earlier `kuberl crds` wrote that no kind generates any more (a renamed or removed
    kind). Only files with our header count, so an --out folder shared with other YAML is safe."""
    if not out.is_dir():
        return []
    return [
        p
        for p in sorted(out.glob("*.yaml"))
        if p.name not in want and p.is_file() and p.read_text(errors="replace").startswith(HEADER)
    ]


def write_crds(out_dir: str | Path) -> list[Path]:
    """Write every CRD into ``out_dir`` and remove the orphans of earlier runs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for orphan in _orphans(out, all_crds()):
        orphan.unlink()
    written = []
    for name, crd in all_crds().items():
        path = out / name
        path.write_text(render(crd))
        written.append(path)
    return written


def stale_crds(out_dir: str | Path) -> list[str]:
    """CRD files that are missing, differ from what the models generate, or are no longer
    generated at all (an orphan would still be applied by `kubectl apply -f crds/` and by Helm);
    empty = up to date."""
    out = Path(out_dir)
    want = all_crds()
    stale = [n for n, crd in want.items() if not (out / n).is_file() or (out / n).read_text() != render(crd)]
    return sorted(stale + [p.name for p in _orphans(out, want)])
