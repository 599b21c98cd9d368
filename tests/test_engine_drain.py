"""The engine pods' drain hook (operator/render/engines.py DRAIN_SCRIPT), run as the kubelet runs a
preStop exec hook, against a stand-in server's /metrics in both engines' formats."""

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kuberl.api.rollout_fleet import RolloutFleet
from kuberl.operator.render.builders import build_rollout_fleet
from kuberl.operator.render.engines import BUSY_METRICS, DRAIN_GRACE_S, DRAIN_QUIET_S, DRAIN_SCRIPT

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
"""
SGLANG_TEXT = """sglang:num_running_reqs{{model_name="m",tp_rank="0"}} {running}
sglang:num_running_reqs{{model_name="m",tp_rank="1"}} 0.0
sglang:num_queue_reqs{{model_name="m",tp_rank="0"}} {waiting}
sglang:token_usage{{model_name="m",tp_rank="0"}} 0.9
"""


class Metrics:
    """A /metrics server whose requests go from busy to idle at ``idle_at`` (monotonic)."""

    def __init__(self, text: str, idle_at: float):
        self.text, self.idle_at, self.polls = text, idle_at, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.polls += 1
                busy = time.monotonic() < outer.idle_at
                body = outer.text.format(running=2.0 if busy else 0.0, waiting=1.0 if busy else 0.0).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _hook(port: int, quiet: float, limit: float, engine: str) -> float:
    """Run the hook as a kubelet would (the container's POD_IP in its environment); seconds taken."""
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", DRAIN_SCRIPT, str(port), str(quiet), str(limit), *BUSY_METRICS[engine]],
        env={"POD_IP": "127.0.0.1"}, check=True, timeout=60,
    )  # fmt: skip
    return time.monotonic() - start


@pytest.mark.parametrize("engine,text", [("vllm", VLLM_TEXT), ("sglang", SGLANG_TEXT)])
def test_the_hook_holds_the_server_while_requests_run_then_for_the_quiet_window(engine, text):
    server = Metrics(text, idle_at=time.monotonic() + 2.5)
    try:
        took = _hook(server.port, quiet=2.0, limit=30, engine=engine)
    finally:
        server.close()
    assert 4.3 <= took <= 8, f"busy 2.5 s, then 2 s quiet: the hook took {took:.1f} s"
    assert server.polls >= 4


def test_the_hook_ends_when_the_server_is_gone_or_time_is_up():
    server = Metrics(VLLM_TEXT, idle_at=time.monotonic() + 3600)
    try:
        assert _hook(server.port, quiet=1, limit=2.5, engine="vllm") < 5, "busy for good: the limit ends it"
    finally:
        server.close()
    assert _hook(server.port, quiet=30, limit=30, engine="vllm") < 3, "nothing answers: nothing to wait for"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_pods_drain_before_they_stop(engine):
    fleet = RolloutFleet.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": "f"},
        "spec": {"model": {"uri": "/models/m"}, "engine": {"type": engine},
                 "accelerator": {"profile": "mi300x", "count": 8}},
    })  # fmt: skip
    (deploy,) = [m for m in build_rollout_fleet(fleet) if m["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:3] == ["python3", "-c", DRAIN_SCRIPT]
    port, quiet, limit = int(hook[3]), float(hook[4]), float(hook[5])
    assert port == container["ports"][0]["containerPort"]
    assert hook[6:] == list(BUSY_METRICS[engine])
    assert quiet == DRAIN_QUIET_S > 15, "longer than the trainers' fleet resync period"
    assert limit < pod["terminationGracePeriodSeconds"] == DRAIN_GRACE_S, "the server keeps time to shut down"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
