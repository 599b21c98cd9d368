"""Fast check that the components' prometheus-client declarations match the metrics catalog.

Imports each component's metrics (no servers, no runs) and compares every ``kuberl_*``
collector in the default registry with dashboards/metrics_catalog.py: type and label names.
The end-to-end version (real scrape, promtool) is tests/test_prometheus_integration.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kuberl.dashboards.metrics_catalog import CATALOG

COMPONENT_MODULES = {
    "rollout": ["kuberl.rollout.scheduler", "kuberl.rollout.phases"],
    "trainer": ["kuberl.trainer.metrics"],
    "sandbox": ["kuberl.sandbox.service.server"],
    "operator": ["kuberl.operator.runtime.metrics"],
}
KINDS = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}


def _declared() -> dict[str, tuple[str, tuple[str, ...]]]:
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - label names are not public API
        kind = next((k for cls, k in KINDS.items() if isinstance(collector, cls)), None)
        name = getattr(collector, "_name", "")
        if kind and name.startswith("kuberl_"):
            full = f"{name}_total" if kind == "counter" else name
            found[full] = (kind, tuple(collector._labelnames))  # noqa: SLF001
    return found


@pytest.mark.parametrize("component", sorted(COMPONENT_MODULES))
def test_component_metrics_match_the_catalog(component):
    for mod in COMPONENT_MODULES[component]:
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not in this checkout yet")
        m = importlib.import_module(mod)
        if component == "trainer":
            m._gauges()  # noqa: SLF001 - the trainer creates its gauges lazily
    declared = _declared()
    for spec in (s for s in CATALOG.values() if s.component == component):
        assert spec.name in declared, f"{component} does not declare {spec.name}"
        kind, labels = declared[spec.name]
        assert kind == spec.type, spec.name
        assert set(labels) == set(spec.labels), (spec.name, labels, spec.labels)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) missing")
def test_promtool_accepts_catalog_shaped_exposition_and_rejects_bad_names():
    reg = CollectorRegistry()
    for spec in CATALOG.values():
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[spec.type]
        metric = cls(spec.name, spec.help, spec.labels, registry=reg)
        child = metric.labels(*["x"] * len(spec.labels)) if spec.labels else metric  # unlabelled: itself
        child.observe(0.1) if spec.type == "histogram" else child.inc()
    res = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(reg), capture_output=True)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr
    bad = CollectorRegistry()
    Gauge("kuberl_bad_total", "a gauge with _total", registry=bad).set(1)
    res = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(bad), capture_output=True)
    assert res.returncode != 0 and b'should not have "_total" suffix' in res.stderr
