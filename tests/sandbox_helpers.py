"""Helpers shared by the sandbox tests: one call, a liveness check, /readyz, a non-root wrapper."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

from kuberl.sandbox.client import SandboxClient
from kuberl.sandbox.types import ExecResult


async def _exec(url: str, code: str, stdin: str = "") -> ExecResult:
    async with SandboxClient(url) as c:
        return await c.execute(code, stdin)


def exec_code(url: str, code: str, stdin: str = "") -> ExecResult:
    return asyncio.run(_exec(url, code, stdin))


def alive(url: str) -> None:
    r = exec_code(url, "print('alive')")
    assert (r.outcome, r.output) == ("stdout", "alive\n"), r


def readyz(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


_UNPRIVILEGED = """import os, sys
from kuberl.sandbox.worker import _hide_home_keep_python
_hide_home_keep_python()
os.environ["HOME"] = "/tmp"
uid = sys.argv[1]
os.execvp("setpriv", ["setpriv", "--reuid=" + uid, "--regid=" + uid, "--clear-groups", *sys.argv[2:]])
"""


def unprivileged_wrapper() -> list[str] | None:
    """A command prefix running the service as a fresh non-root uid (as a pod would); [] when we
    are not root, None where that cannot be arranged (then the basic service runs as root)."""
    if os.geteuid() != 0:
        return []
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if not (unshare and setpriv):
        return None
    uid = 3_000_000 + random.randrange(1_000_000)  # no other test's processes share it
    cmd = [unshare, "--mount", "--propagation", "private", sys.executable, "-c", _UNPRIVILEGED, str(uid)]
    return cmd if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0 else None
