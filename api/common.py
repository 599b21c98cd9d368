"""Shared building blocks of the kuberl custom resources.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python;
``extra="forbid"`` makes a typo in a manifest an error instead of a silently ignored field, and
``strict=True`` refuses what the CRD schema refuses (``replicas: "3"``, ``suspend: "yes"``) instead
of coercing it, so `kuberl validate` never passes a manifest `kubectl apply` would reject. Strict
floats still take integers, as a CRD ``type: number`` does.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kuberl.api.group import API_VERSION

AcceleratorProfile = Literal["mi300x", "h100", "cpu"]
ACCELERATOR_PROFILES: tuple[str, ...] = ("mi300x", "h100", "cpu")

# An RFC 1123 label: what Kubernetes requires of the Service and pod names derived from a
# resource's name, and what stage names must be (they become label values and metric labels).
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = (
    "must be a lowercase RFC 1123 label: at most 63 characters of a-z, 0-9 and '-', "
    "starting and ending with a letter or digit"
)
# A resource's own name also names Services (its own, or its children's), and Service names
# are RFC 1035 labels: the API server refuses a Service "7b-fleet" (a leading digit), so the
# resource name must start with a letter.
RESOURCE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RESOURCE_NAME_RULE = (
    "must be a lowercase RFC 1035 label: at most 63 characters of a-z, 0-9 and '-', starting with a "
    "letter (it names Services, which may not start with a digit) and ending with a letter or digit"
)
# The names of Secrets, PersistentVolumeClaims and StorageClasses: DNS-1123 subdomains.
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SUBDOMAIN_RULE = (
    "must be a DNS subdomain: at most 253 characters of lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit"
)
# Keys of a Secret or ConfigMap (the API server's IsConfigMapKey).
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
CONFIG_KEY_RULE = "must be a Secret key: letters, digits, '-', '_' and '.'"
PATTERN_RULES: dict[str, str] = {
    NAME_PATTERN: NAME_RULE,
    RESOURCE_NAME_PATTERN: RESOURCE_NAME_RULE,
    SUBDOMAIN_PATTERN: SUBDOMAIN_RULE,
    CONFIG_KEY_PATTERN: CONFIG_KEY_RULE,
}
"""Plain-language wording for the regexes above, used by error messages instead of the regex."""

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


ANNOTATIONS_MAX_BYTES = 256 * 1024  # keys and values together (apimachinery TotalAnnotationSizeLimitB)
STANDARD_FINALIZERS = frozenset({"kubernetes", "orphan", "foregroundDeletion"})


def annotations_size(annotations: dict[Any, Any]) -> int:
    """Bytes the API server counts against ANNOTATIONS_MAX_BYTES: keys and values in UTF-8."""
    return sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())


def _qualified_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_QUALIFIED.match(name))


# k8s.io/apimachinery resource.Quantity, as kubebuilder writes it into CRDs.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not _QUANTITY_RE.match(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity: a number with an optional suffix "
            "(m, k, M, G, Ki, Mi, Gi, ...), e.g. 500m, 2, 16Gi"
        )
    if (isinstance(value, int) and value < 0) or (isinstance(value, str) and value.startswith("-")):
        raise ValueError(f"quantity {value!r} must not be negative")
    return value


# Kubernetes resource quantities ("500m", "2Gi", 4) are int-or-string on the wire.
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    Field(json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")


class FieldError(ValueError):
    """A model validator's refusal of one field below its model: ``at`` is that field's path
    relative to the model, in the manifest's spelling (``("stages", 1, "name")``). The loader
    reports it at that path, the way the API server names the field it refuses."""

    def __init__(self, at: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.at = at


class KubeModel(BaseModel):
    """Base for every spec/status fragment: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        strict=True,
        validate_assignment=True,
    )

    def wire(self) -> dict[str, Any]:
        """The camelCase JSON form, as it appears in a manifest."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ObjectMeta(BaseModel):
    """The part of metadata kuberl reads; everything else is carried through unchanged."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)

    name: str = Field(pattern=RESOURCE_NAME_PATTERN, max_length=63)
    namespace: str | None = Field(None, pattern=NAME_PATTERN, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: list[str] | None = None
    owner_references: list[dict[str, Any]] | None = Field(None, alias="ownerReferences")

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        """The API server refuses the whole object for one bad label; say which."""
        for key, value in labels.items():
            if not _qualified_key(key):
                raise ValueError(
                    f"label key {key!r} must be a name of at most 63 characters of letters, digits, '-', '_' "
                    "and '.' (starting and ending with a letter or digit), optionally behind a DNS prefix and '/'"
                )
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                raise ValueError(
                    f"label {key}={value!r}: values are at most 63 characters of letters, digits, '-', '_' and '.', "
                    "starting and ending with a letter or digit"
                )
        return labels

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str]) -> dict[str, str]:
        bad = [k for k in annotations if not _qualified_key(k)]
        if bad:
            raise ValueError(f"annotation keys {bad} are not qualified names (like example.com/some-key)")
        size = annotations_size(annotations)
        if size > ANNOTATIONS_MAX_BYTES:
            raise ValueError(
                f"annotations total {size} bytes (UTF-8), more than the API server's limit of {ANNOTATIONS_MAX_BYTES}"
            )
        return annotations

    @field_validator("finalizers")
    @classmethod
    def _finalizers(cls, finalizers: list[str] | None) -> list[str] | None:
        """apimachinery's ValidateFinalizerName: a qualified name with a DNS prefix, or one of the
        standard ones."""
        for f in finalizers or []:
            if not _qualified_key(f):
                raise ValueError(f"{f!r} is not a qualified name (like example.com/some-finalizer)")
            if "/" not in f and f not in STANDARD_FINALIZERS:
                raise ValueError(f"{f!r} is neither a standard finalizer name nor fully qualified (prefix/name)")
        return finalizers

    @field_validator("owner_references")
    @classmethod
    def _owner_references(cls, refs: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, ref in enumerate(refs or []):
            missing = [k for k in ("apiVersion", "kind", "name", "uid") if not ref.get(k)]
            if missing:
                raise FieldError((i, missing[0]), f"{', '.join(missing)} must not be empty")
        if sum(1 for r in refs or [] if r.get("controller") is True) > 1:
            raise ValueError("only one reference can have controller set to true")
        return refs
    generation: int | None = None
    uid: str | None = None


class ResourceRequirements(KubeModel):
    """core/v1 ResourceRequirements (requests and limits only)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _as_the_api_server(self) -> ResourceRequirements:
        """The pod validation a schema cannot express: resource names, requests <= limits."""
        for part in (self.requests, self.limits):
            for name in part:
                if name not in STANDARD_RESOURCES and not name.startswith("hugepages-") and "/" not in name:
                    raise ValueError(
                        f"unknown resource {name!r}: use cpu, memory, ephemeral-storage, hugepages-<size> "
                        "or a fully qualified extended resource such as amd.com/gpu"
                    )
        for name, req in self.requests.items():
            if name in self.limits and quantity_value(req) > quantity_value(self.limits[name]):
                raise ValueError(
                    f"requests.{name} ({req}) must be less than or equal to limits.{name} ({self.limits[name]})"
                )
        return self


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIX.update({"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1})
_SUFFIX.update({"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18})


def quantity_value(q: int | str) -> Fraction:
    """The exact amount of a quantity that passed ``Quantity`` validation."""
    text = str(q)
    m = re.match(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$", text)
    if m is None:
        raise ValueError(f"{q!r} is not a quantity")
    amount = Fraction(m.group(1))
    if m.group(2) is not None:
        return amount * Fraction(10) ** int(m.group(2))
    return amount * _SUFFIX[m.group(3) or ""]


class AcceleratorSpec(KubeModel):
    """Which accelerator a pod needs. mi300x is the default (the paper's 64 MI300X)."""

    profile: AcceleratorProfile = Field(
        "mi300x",
        description="mi300x (amd.com/gpu, ROCm images), h100 (nvidia.com/gpu, CUDA images) or cpu.",
    )
    count: int = Field(1, ge=1, le=64, description="Accelerators per pod (CPUs for the cpu profile).")


class Condition(KubeModel):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = Field(
        default_factory=lambda: now_rfc3339(), json_schema_extra={"format": "date-time"}
    )
    observed_generation: int | None = None


class ResourceStatus(KubeModel):
    """Status common to all kuberl kinds (phase + conditions + observedGeneration)."""

    model_config = ConfigDict(extra="allow")

    phase: str | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = None


class ScaledResourceStatus(ResourceStatus):
    """Status of kinds with a scale subresource; ``selector`` feeds labelSelectorPath."""

    replicas: int = 0
    ready_replicas: int = 0
    selector: str | None = None
    desired_replicas: int | None = None


class Autoscaling(KubeModel):
    """Replica bounds shared by the autoscaled kinds.

    ``minReplicas`` is at least 1: both autoscalers (the operator's built-in one and the KEDA
    ScaledObject that ``kuberl.io/autoscaler: keda`` renders) read load from metrics the pods
    themselves export (sandbox queue depth, SGLang KV-cache usage), so at zero pods there is
    no metric, no load is ever seen and nothing would scale the resource back up.
    """

    min_replicas: int = Field(
        1,
        json_schema_extra={"minimum": 1},
        description="At least 1: the load metrics come from the pods, so zero pods could never scale up.",
    )
    max_replicas: int = Field(8, ge=1)
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, description="A scale-down waits until the lower target has held this long."
    )

    @field_validator("min_replicas")
    @classmethod
    def _scales_from_a_pod(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"autoscaling.minReplicas must be >= 1 (got {v}): the autoscaler reads load from metrics "
                "the pods export, so at zero pods it would never scale back up; to park the resource, "
                "drop autoscaling and set replicas: 0"
            )
        return v

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must be <= "
                f"autoscaling.maxReplicas ({self.max_replicas})"
            )
        return self


def without_default(schema: dict[str, Any]) -> None:
    """json_schema_extra that keeps a field's default out of the CRD: the API server would fill it
    in, and the model could no longer tell "not set" (whose default depends on other fields)."""
    schema.pop("default", None)


def default_replicas_to_min(spec: Any) -> None:
    """An autoscaled resource without ``replicas`` starts at ``autoscaling.minReplicas`` (a fixed
    default of 1 would be refused by minReplicas > 1)."""
    if "replicas" not in spec.model_fields_set and spec.autoscaling is not None:
        object.__setattr__(spec, "replicas", spec.autoscaling.min_replicas)


def check_replicas_in_bounds(replicas: int, autoscaling: Autoscaling | None) -> None:
    if autoscaling is None:
        return
    lo, hi = autoscaling.min_replicas, autoscaling.max_replicas
    if not lo <= replicas <= hi:
        raise ValueError(
            f"replicas ({replicas}) is outside the autoscaling bounds [minReplicas={lo}, maxReplicas={hi}]"
        )


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Resource(BaseModel):
    """A top-level custom resource: apiVersion, kind, metadata, spec, status."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    api_version: Literal["kuberl.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    metadata: ObjectMeta

    # Set by each kind; ClassVars, so they are neither fields nor part of the CRD schema.
    KIND: ClassVar[str] = ""
    PLURAL: ClassVar[str] = ""
    SHORT_NAMES: ClassVar[tuple[str, ...]] = ()

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
