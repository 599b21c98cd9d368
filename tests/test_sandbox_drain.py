"""A sandbox service told to stop (SIGTERM: its pod is being deleted) answers the calls it is
running before it goes and hands the queued ones back (503, never started), so a client that
retries them elsewhere runs each call once; and the client retries a refused connection (the
call never left) within its deadline without spending its retries."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.service.client import SandboxClient
from kuberl.util.ports import free_port

SLOW = "import time; time.sleep(2); print('done')"


def _post(url: str, code: str, out: dict, key: str) -> None:
    req = urllib.request.Request(url + "/v1/execute", data=json.dumps({"id": key, "code": code}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            out[key] = (resp.status, json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        out[key] = (err.code, err.read().decode())


def _serve(port: int) -> subprocess.Popen:
    env = dict(os.environ, KUBERL_SANDBOX_LIMITS=json.dumps(SandboxLimits(timeout_seconds=5).wire()))
    env.pop("KUBERL_SANDBOX_TOKEN", None)
    cmd = [sys.executable, "-P", "-m", "kuberl", "sandbox", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "2", "--pool", "drain", "--isolation", "basic"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sandbox service exited during startup"
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the sandbox service was not ready within 120 s")


def test_sigterm_answers_the_running_calls_and_hands_the_queued_ones_back():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port)
    try:
        _wait_ready(url, proc)
        out: dict = {}
        threads = [threading.Thread(target=_post, args=(url, SLOW, out, f"c{i}")) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        time.sleep(0.8)  # two run (2 workers), two wait in the queue
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    statuses = sorted(status for status, _ in out.values())
    assert statuses == [200, 200, 503, 503], out
    assert all(body["output"].strip() == "done" for status, body in out.values() if status == 200), out
    assert "kuberl sandbox stopped: 2 calls answered, 0 cut off mid-run" in stdout, stdout[-500:]


def test_the_client_retries_a_refused_connection_without_spending_its_retries():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc: list[subprocess.Popen] = []
    threading.Timer(1.0, lambda: proc.append(_serve(port))).start()  # nothing listens for 1 s

    async def call() -> str:
        async with SandboxClient(url, retries=0, request_timeout=120) as client:
            return (await client.execute("print(6 * 7)")).output

    try:
        assert asyncio.run(call()).strip() == "42"
    finally:
        time.sleep(1.2)
        for p in proc:
            p.kill()
            p.wait()
