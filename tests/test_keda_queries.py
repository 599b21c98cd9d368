"""The KEDA ScaledObjects' new triggers, evaluated by a real Prometheus against trainers' /metrics:
the replicas the HPA would compute from each query are the operator's own decision.

Two trainers of fleet ``gen`` (and one of another fleet, which must not count) export their
pipeline ratios; a trainer announces its rollout phase to pool ``tools``. For each case the
served pages change, Prometheus scrapes them, and the trigger's query is evaluated as KEDA
would; the HPA's rule then gives ``ceil(current * value / 1)`` engines (Value, inside its 10 %
tolerance band: no change) or ``ceil(value / workersPerPod)`` pods (AverageValue).
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kuberl.api import RolloutFleet, SandboxPool
from kuberl.operator.decide.autoscale import phase_floor, recommend_by_pipeline
from kuberl.operator.render.keda import build_keda_scaled_object
from tests.prometheus_server import query, running_prometheus

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="Debian package `prometheus` (installed by .ci/run) is required"
)
NS = "team"
HPA_TOLERANCE = 0.1


class Pages:
    """/metrics pages served on one port: /a, /b, /other, /pool, /engine (replaced by each case)."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = pages.text.get(self.path, "").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _ratios(job: str, fleet: str, wait: float | None, idle: float | None, served: int | None = None) -> str:
    lines = []
    if served is not None:
        lines.append(f'kuberl_train_engines_in_service{{job="{job}",fleet="{fleet}"}} {served}')
    if wait is not None:
        lines.append(f'kuberl_train_rollout_wait_ratio{{job="{job}",fleet="{fleet}"}} {wait}')
    if idle is not None:
        lines.append(f'kuberl_train_engine_idle_ratio{{job="{job}",fleet="{fleet}"}} {idle}')
    return "\n".join(lines) + "\n"


def _value(prom: str, expr: str) -> float:
    (sample,) = query(prom, expr)
    return float(sample["value"][1])


def _hpa_value(current: int, value: float) -> int:
    return current if abs(value - 1.0) <= HPA_TOLERANCE else math.ceil(current * value - 1e-9)


def _scraped(prom: str, expr: str, want: float, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = query(prom, expr)
        if got and abs(float(got[0]["value"][1]) - want) < 1e-9:
            return
        time.sleep(0.3)
    raise AssertionError(f"Prometheus never saw {expr} = {want}: {query(prom, expr)}")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    pages = Pages()
    targets = {name: f"127.0.0.1:{pages.port}" for name in ("a", "b", "other", "pool", "engine")}
    tmp = tmp_path_factory.mktemp("prom")
    # one scrape job per page: the Prometheus config's metrics_path differs per job
    with running_prometheus(tmp, targets, labels={"namespace": NS}, paths={n: f"/{n}" for n in targets}) as prom:
        yield prom, pages
    pages.server.shutdown()


FLEET = RolloutFleet.model_validate(
    {
        "metadata": {"name": "gen"},
        "spec": {"model": {"uri": "Qwen/Qwen3-14B-Base"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 64}},
    }
)


@pytest.mark.parametrize(
    ("wait_a", "wait_b", "idle_a", "idle_b", "served"),
    [
        (0.4, 0.1, 0.0, 0.2, None),  # trainer a starved: grow by 1 / (1 - 0.4)
        (0.4, 0.1, 0.0, 0.2, 3),  # ... counted from the 3 engines that served the step
        (0.7, 0.0, 0.0, 0.0, None),  # starved past half its step: at most doubled
        (0.05, 0.1, 0.6, 0.5, None),  # nobody waits, the fleet idles half of every step: shrink
        (0.05, 0.1, 0.6, 0.5, 3),  # ... to what keeps the 3 serving engines' work 70 % busy
        (0.05, 0.2, 0.6, 0.5, None),  # b waits past the target: grow, however idle a's engines are
        (0.1, 0.1, 0.2, 0.25, 3),  # inside both targets: no opinion
        (None, None, None, None, None),  # no asynchronous trainer: no opinion
    ],
)
def test_the_fleet_pipeline_trigger_asks_what_the_operator_decides(prometheus, wait_a, wait_b, idle_a, idle_b, served):
    prom, pages = prometheus
    pages.text["/a"] = _ratios("a", "gen", wait_a, idle_a, served)
    pages.text["/b"] = _ratios("b", "gen", wait_b, idle_b, None if served is None else served - 1)
    pages.text["/other"] = _ratios("c", "elsewhere", 0.9, 0.0, 50)  # another fleet's trainer: not counted
    for job, wait in (("a", wait_a), ("b", wait_b)):
        if wait is not None:
            _scraped(prom, f'kuberl_train_rollout_wait_ratio{{job="{job}"}}', wait)
        else:
            _scraped_absent(prom, f'kuberl_train_rollout_wait_ratio{{job="{job}"}}')
    if served is not None:
        _scraped(prom, 'kuberl_train_engines_in_service{job="a"}', served)
    else:
        _scraped_absent(prom, 'kuberl_train_engines_in_service{job="a"}')
    (trigger,) = [t for t in build_keda_scaled_object(FLEET, NS)["spec"]["triggers"] if t["name"] == "trainer-pipeline"]
    waits = [w for w in (wait_a, wait_b) if w is not None]
    idles = [i for i in (idle_a, idle_b) if i is not None]
    for engines in (4, 10):
        # today's engines, one KV series each (another fleet's engine must not count)
        pages.text["/engine"] = "".join(
            f'sglang:token_usage{{app_kubernetes_io_instance="gen",engine="{i}"}} 0.9\n' for i in range(engines)
        ) + 'sglang:token_usage{app_kubernetes_io_instance="other",engine="0"} 0.9\n'
        _scraped(prom, 'count(sglang:token_usage{app_kubernetes_io_instance="gen"})', engines)
        value = _value(prom, trigger["metadata"]["query"])
        wanted = recommend_by_pipeline(engines, max(waits) if waits else None, min(idles) if idles else None, served)
        hpa = _hpa_value(engines, value / float(trigger["metadata"]["threshold"]))
        if wanted is None:
            assert value == 1.0 and hpa == engines
        elif abs(value - 1.0) > HPA_TOLERANCE:
            assert hpa == wanted, (engines, value, wanted)
        else:  # the HPA's tolerance band holds a change under 10 % (keda.py says so)
            assert hpa == engines and abs(wanted - engines) <= math.ceil(0.1 * engines), (engines, wanted)


def _scraped_absent(prom: str, expr: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while query(prom, expr) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not query(prom, expr), f"{expr} still present"


def test_the_pool_trigger_holds_the_announced_phase(prometheus):
    prom, pages = prometheus
    pool = SandboxPool.model_validate(
        {
            "metadata": {"name": "tools"},
            "spec": {"workersPerPod": 8, "autoscaling": {"minReplicas": 1, "maxReplicas": 64}},
        }
    )
    (trigger,) = [t for t in build_keda_scaled_object(pool, NS)["spec"]["triggers"] if t["name"] == "announced-workers"]
    pages.text["/pool"] = (
        'kuberl_rollout_phase_workers{job="a",pool="tools"} 135\n'
        'kuberl_rollout_phase_workers{job="b",pool="tools"} 17\n'
        'kuberl_rollout_phase_workers{job="c",pool="other-pool"} 500\n'
    )
    _scraped(prom, 'kuberl_rollout_phase_workers{job="b"}', 17)
    value = _value(prom, trigger["metadata"]["query"])
    pods = math.ceil(value / float(trigger["metadata"]["threshold"]) - 1e-9)  # AverageValue
    assert value == 152 and pods == phase_floor(135 + 17, 8) == 19


def test_engine_gauges_count_only_while_no_asynchronous_trainer_reports(prometheus):
    """KV usage and queues are demand for synchronous runs; asynchronous trainers fill every
    engine's KV cache by design, so while one reports, those triggers ask for nothing (0) and
    the pipeline decides, as in autoscale.recommend_fleet."""
    prom, pages = prometheus
    pages.text["/engine"] = (
        'sglang:token_usage{app_kubernetes_io_instance="gen",engine="0"} 0.9\n'
        'sglang:token_usage{app_kubernetes_io_instance="gen",engine="1"} 1.0\n'
        'sglang:num_queue_reqs{app_kubernetes_io_instance="gen",engine="0"} 6\n'
    )
    kv, queued, _ = build_keda_scaled_object(FLEET, NS)["spec"]["triggers"]
    pages.text["/a"] = pages.text["/b"] = ""
    pages.text["/other"] = _ratios("c", "elsewhere", 0.9, 0.0)  # another fleet's async trainer
    _scraped(prom, 'sglang:token_usage{engine="1"}', 1.0)
    _scraped_absent(prom, 'kuberl_train_rollout_wait_ratio{fleet="gen"}')
    assert _value(prom, kv["metadata"]["query"]) == pytest.approx(0.95)
    assert _value(prom, queued["metadata"]["query"]) == 6
    pages.text["/a"] = _ratios("a", "gen", 0.05, 0.65)
    _scraped(prom, 'kuberl_train_rollout_wait_ratio{job="a"}', 0.05)
    assert _value(prom, kv["metadata"]["query"]) == 0 and _value(prom, queued["metadata"]["query"]) == 0
