"""A real Prometheus (Debian's ``prometheus``, installed by .ci/run) for tests: scrape some
/metrics endpoints, answer PromQL through its HTTP API."""

from __future__ import annotations

import contextlib
import json
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_proc import prometheus_process


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read()


@contextlib.contextmanager
def running_prometheus(
    tmp: Path, targets: dict[str, str], labels: dict[str, str] | None = None, paths: dict[str, str] | None = None
):
    """A real Prometheus scraping ``targets`` ({scrape job: host:port}) every second, at
    ``paths[job]`` (default /metrics), with ``labels`` on every target's series (what a
    cluster's service discovery adds, e.g. ``namespace``); yields its base URL."""
    cfg = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # honor_labels keeps the trainer's own `job` label (the AgenticRLJob name).
            {
                "job_name": name,
                "honor_labels": True,
                "metrics_path": (paths or {}).get(name, "/metrics"),
                "static_configs": [{"targets": [hostport], "labels": labels or {}}],
            }
            for name, hostport in targets.items()
        ],
    }
    with prometheus_process(tmp, cfg, ready_timeout=30) as base:
        yield base


def query(base: str, expr: str, at: float | None = None) -> list[dict]:
    """An instant query, at ``at`` (unix seconds) when given, as Grafana evaluates a time range."""
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode(params)
    body = json.loads(http_get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]
