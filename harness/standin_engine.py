"""A stand-in engine for a RolloutFleet's pods on the real node, where the CPU vLLM image (6+ GB)
is too heavy to load per test: a few lines of standard-library Python run by ``python3 -c`` in
any image that has Python (the sandbox image), in the container the operator renders, with the
renderer's probes and preStop drain hook left as they are.

It answers what the kubelet and the drain hook ask of a vLLM engine: ``GET /health`` (200) and
``GET /metrics`` with vLLM's busy gauges (``vllm:num_requests_running`` set by ``POST
/busy?n=N``, ``vllm:num_requests_waiting`` 0). Every ``/metrics`` read (only the drain hook reads
it, from the pod's own IP), with the caller's address, every ``/busy`` and the SIGTERM are appended as JSON lines ``{"t", "event", ...}`` to the
file named by its second argument, which the test reads through a hostPath volume.
"""

from __future__ import annotations

import json
from pathlib import Path

# argv: port, events file
SCRIPT = """\
import http.server, json, os, signal, sys, time
port, events = int(sys.argv[1]), open(sys.argv[2], "a", buffering=1)
state = {"busy": 0}
def note(event, **fields):
    events.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\\n")
class Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            note("metrics", busy=state["busy"], peer=self.client_address[0])
            body = ("vllm:num_requests_running %d\\nvllm:num_requests_waiting 0\\n" % state["busy"]).encode()
        elif self.path == "/health":
            body = b"ok"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        state["busy"] = int(self.path.rpartition("=")[2])
        note("busy", busy=state["busy"])
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
def stop(*_):
    note("sigterm")
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
note("start")
http.server.ThreadingHTTPServer(("0.0.0.0", port), Engine).serve_forever()
"""


def events(path: Path) -> list[dict]:
    """The stand-in's events, oldest first ([] before it wrote any)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
