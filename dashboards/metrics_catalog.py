"""The canonical list of kuberl's Prometheus metrics: the contract between components and dashboards.

DESIGN.md names the metrics; this module adds what a dashboard needs to know about each one
(type and labels). Tests check that the catalog matches DESIGN.md, that every PromQL
expression of every dashboard only references catalogued metrics and labels, and that the
components' real /metrics output agrees with the catalog. Components may import
:data:`CATALOG` to look up a metric's labels instead of re-typing them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric as exported by a component (``name`` is the exposition name without suffixes)."""

    name: str
    type: MetricType
    labels: tuple[str, ...]
    component: Literal["sandbox", "rollout", "trainer", "operator"]
    help: str

    def series_names(self) -> tuple[str, ...]:
        """Every sample name this metric produces in the text exposition format."""
        if self.type == "histogram":
            return tuple(f"{self.name}{s}" for s in ("_bucket", "_sum", "_count", "_created"))
        if self.type == "counter":
            base = self.name.removesuffix("_total")
            return (self.name, f"{base}_created")
        return (self.name,)


CATALOG: dict[str, MetricSpec] = {
    m.name: m
    for m in (
        MetricSpec(
            "kuberl_tool_call_latency_seconds",
            "histogram",
            ("pool", "outcome"),
            "sandbox",
            "Wall time of one tool call from submission to result, by outcome",
        ),
        MetricSpec(
            "kuberl_tool_calls_total", "counter", ("pool", "outcome"), "sandbox", "Tool calls answered"
        ),
        MetricSpec("kuberl_sandbox_queue_depth", "gauge", ("pool",), "sandbox", "Calls waiting for a worker"),
        MetricSpec("kuberl_sandbox_workers_busy", "gauge", ("pool",), "sandbox", "Workers executing a call"),
        MetricSpec(
            "kuberl_sandbox_verify_calls_total",
            "counter",
            ("pool", "outcome"),
            "sandbox",
            "Answer verifications by result (correct, wrong, timeout, error)",
        ),
        MetricSpec(
            "kuberl_rollout_kv_cache_utilization",
            "gauge",
            ("engine",),
            "rollout",
            "Reserved KV-cache tokens / engine capacity",
        ),
        MetricSpec(
            "kuberl_rollout_requests_inflight",
            "gauge",
            ("engine",),
            "rollout",
            "Rollouts assigned to the engine",
        ),
        MetricSpec(
            "kuberl_train_reward_mean", "gauge", ("job",), "trainer", "Mean binary reward of the step"
        ),
        MetricSpec(
            "kuberl_train_clip_ratio", "gauge", ("job", "side"), "trainer", "Token-level pg clip fraction"
        ),
        MetricSpec(
            "kuberl_train_response_clip_ratio",
            "gauge",
            ("job",),
            "trainer",
            "Fraction of rollouts truncated at max length",
        ),
        MetricSpec(
            "kuberl_train_tool_error_ratio_positive",
            "gauge",
            ("job",),
            "trainer",
            "Tool errors / tool calls inside correct rollouts",
        ),
        MetricSpec(
            "kuberl_train_response_length_tokens",
            "gauge",
            ("job",),
            "trainer",
            "Mean response length (tokens)",
        ),
        MetricSpec("kuberl_train_step", "gauge", ("job", "stage"), "trainer", "Current training step"),
        MetricSpec("kuberl_train_step_seconds", "gauge", ("job",), "trainer", "Wall time of the last step"),
        MetricSpec(
            "kuberl_autoscaler_desired_replicas",
            "gauge",
            ("namespace", "kind", "name"),
            "operator",
            "Replicas the operator wants for a SandboxPool/RolloutFleet (autoscaler decision, else spec.replicas)",
        ),
        MetricSpec(
            "kuberl_autoscaler_ready_replicas",
            "gauge",
            ("namespace", "kind", "name"),
            "operator",
            "Replicas the SandboxPool/RolloutFleet workload reports ready",
        ),
    )
}

# Labels Prometheus itself attaches to every scraped series; dashboards may group by them.
TARGET_LABELS = frozenset({"instance", "job_name", "__name__"})

_SERIES_TO_METRIC = {s: m for m in CATALOG.values() for s in m.series_names()}
_METRIC_RE = re.compile(r"\b(kuberl_[a-z0-9_]+)")
_MATCHER_BLOCK_RE = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def metric_for_series(series: str) -> MetricSpec | None:
    """The catalogued metric a sample name (e.g. ``..._bucket``) belongs to, or None."""
    return _SERIES_TO_METRIC.get(series)


def referenced_series(expr: str) -> set[str]:
    """Sample names (``kuberl_*``) an expression selects."""
    return set(_METRIC_RE.findall(expr))


def check_expression(expr: str) -> list[str]:
    """Problems with one PromQL expression against the catalog (empty list: fine).

    Every ``kuberl_*`` name must be a catalogued series, and every label used in a matcher or
    a grouping clause must be a label of one of the referenced metrics (``le`` for histograms).
    """
    problems: list[str] = []
    series = referenced_series(expr)
    if not series:
        problems.append(f"references no kuberl metric: {expr}")
    allowed: set[str] = set()
    for s in sorted(series):
        spec = metric_for_series(s)
        if spec is None:
            problems.append(f"unknown metric {s!r} in: {expr}")
            continue
        allowed.update(spec.labels)
        if spec.type == "histogram" and s.endswith("_bucket"):
            allowed.add("le")
    used: set[str] = set()
    for block in _MATCHER_BLOCK_RE.findall(expr):
        used.update(_MATCHER_LABEL_RE.findall(block))
    for group in _GROUPING_RE.findall(expr):
        used.update(x.strip() for x in group.split(",") if x.strip())
    for label in sorted(used - allowed - TARGET_LABELS):
        problems.append(f"label {label!r} is not a label of {sorted(series)} in: {expr}")
    return problems
