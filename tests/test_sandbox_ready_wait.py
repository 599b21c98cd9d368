"""A trainer waits for its sandbox service to be Ready before its first call
(sandbox/service/client.wait_ready, trainer/local.py): a pool's pods warm their workers before
their readiness probe passes, and a trainer pod may start first."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from kuberl.sandbox.service.client import SandboxError, wait_ready


@pytest.fixture
def readyz() -> Iterator[tuple[str, list[int]]]:
    """A server whose /readyz answers the codes queued in the list (200 once it runs out)."""
    codes: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            code = codes.pop(0) if codes else 200
            self.send_response(code if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", codes
    server.shutdown()


def test_it_waits_through_not_ready_answers(readyz):
    url, codes = readyz
    codes += [503, 503, 404]
    said: list[str] = []
    assert wait_ready(url, timeout=30, say=said.append, interval=0.05) >= 0
    assert not codes and len(said) == 1 and url in said[0] and "HTTP 503" in said[0]


def test_it_gives_up_naming_the_url(readyz):
    url, codes = readyz
    codes += [503] * 1000
    with pytest.raises(SandboxError, match=r"not ready after 0 s \(/readyz: HTTP 503\)") as err:
        wait_ready(url, timeout=0.2, interval=0.05)
    assert url in str(err.value)
