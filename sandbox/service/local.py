"""Start the sandbox service as a local subprocess (the embedded default and tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import IO

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.util.lifetime import tied_to_this_process


@contextlib.contextmanager
def running_sandbox(
    workers: int = 2,
    limits: SandboxLimits | None = None,
    pool: str = "local",
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 120.0,
    extra_args: Sequence[str] = (),
    wrapper: Sequence[str] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
    cwd: str | None = None,
    log: IO[str] | None = None,
) -> Iterator[str]:
    """Run ``kuberl sandbox serve`` on a loopback port; yield its base URL once /readyz is 200.

    ``extra_args`` are further ``sandbox serve`` flags (e.g. ``--queue-limit 8``); ``wrapper``
    is a command prefix it runs under (e.g. one that drops to a non-root uid, like a pod);
    ``env`` adds variables to the service's environment (calls never see them); ``python`` is
    the interpreter to run it with (default: this one); ``log`` a file its stderr (the service's
    log) goes to (default: this process's stderr).
    The limits travel as ``KUBERL_SANDBOX_LIMITS``, the way a SandboxPool pod gets them.
    """
    lim = limits or SandboxLimits()
    cmd = [
        *wrapper, python or sys.executable, "-m", "kuberl", "sandbox", "serve", "--host", host, "--port", str(port),
        "--workers", str(workers), "--pool", pool, *extra_args,
    ]  # fmt: skip
    service_env = dict(os.environ, **(env or {}), KUBERL_SANDBOX_LIMITS=json.dumps(lim.wire()))
    proc = subprocess.Popen(
        tied_to_this_process(cmd), stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, env=service_env, cwd=cwd
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on " not in line:
            raise RuntimeError(f"sandbox service failed to start (exit {proc.poll()}): {line.strip()}")
        base_url = line.split("listening on ", 1)[1].strip()
        # keep draining stdout so the server never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sandbox service exited with code {proc.returncode} during startup")
            try:
                with urllib.request.urlopen(base_url + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox service not ready after {startup_timeout:.0f} s")
            time.sleep(0.1)
        yield base_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
