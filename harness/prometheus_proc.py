"""Debian's Prometheus (installed by .ci/run) as a process of a test's own: its config written to
``folder``, started on a free loopback port, waited for until ready, stopped on leaving."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kuberl.util.ports import free_port


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as resp:  # noqa: S310 - loopback only
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def prometheus_process(folder: Path, config: dict[str, Any], ready_timeout: float) -> Iterator[str]:
    """Prometheus with ``config`` (its prometheus.yml), its TSDB and log in ``folder``; yields its
    base URL once ``/-/ready`` answers, and raises with the log's tail if it ends or times out first."""
    port = free_port()
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    with (folder / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while not _ready(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
