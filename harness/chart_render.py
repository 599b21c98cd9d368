"""charts/kuberl rendered offline, as `helm install` renders it (helm-python-sdk's native call)."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parent.parent / "charts" / "kuberl"

MONITORING_API = "monitoring.coreos.com/v1"


def render(values: dict | None = None, api_versions: tuple[str, ...] = (MONITORING_API,)) -> list[dict]:
    """The chart as `helm install` renders it on a cluster serving ``api_versions`` (besides the
    built-in ones); by default one with prometheus-operator's CRDs installed.

    helm-python's ``Chart.render`` has no ``--api-versions``; its native call takes them."""
    from helm_python import _native

    chart = helm.Chart.load(str(CHART))
    opts = {
        "name": "kuberl",
        "namespace": "kuberl-system",
        "is_install": True,
        "api_versions": list(api_versions),
    }
    out = json.loads(
        _native.call_string(
            "helm_render", chart._raw(), json.dumps(values) if values else None, json.dumps(opts)
        )
    )
    return [d for text in out.values() for d in yaml.safe_load_all(text) if d]
