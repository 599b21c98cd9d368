"""The sandbox service run the way the benches and the sandbox tests run it: in full isolation
(root) or basic (a fresh non-root uid, as in a pod), plus its /readyz answer.

The benches import it as a sibling module; the tests find it through tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from typing import IO

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.service.local import running_sandbox


def readyz(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


_UNPRIVILEGED = """import os, sys
from kuberl.sandbox.process.worker import _hide_home_keep_python
_hide_home_keep_python()
os.environ["HOME"] = "/tmp"
uid = sys.argv[1]
os.execvp("setpriv", ["setpriv", "--reuid=" + uid, "--regid=" + uid, "--clear-groups", *sys.argv[2:]])
"""


def unprivileged_wrapper(pid_namespace: bool = False) -> list[str] | None:
    """A command prefix running the service as a fresh non-root uid (as a pod would); [] when we
    are not root, None where that cannot be arranged (then the basic service runs as root).
    ``pid_namespace``: in a PID namespace of its own too, with its own /proc, as a pod's
    container is (its /proc lists the pod's processes, not the host's)."""
    if os.geteuid() != 0:
        return []
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if not (unshare and setpriv):
        return None
    uid = 3_000_000 + random.randrange(1_000_000)  # no other test's processes share it
    pid_ns = ["--pid", "--fork", "--kill-child", "--mount-proc"] if pid_namespace else []
    cmd = [unshare, "--mount", "--propagation", "private", *pid_ns, sys.executable, "-c", _UNPRIVILEGED, str(uid)]
    return cmd if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0 else None


def service(
    mode: str,
    limits: SandboxLimits,
    extra: list[str],
    python: str | None = None,
    cwd: str | None = None,
    workers: int = 2,
    pod_pids: bool = False,
    log: IO[str] | None = None,
    pool: str = "front",
    env: dict[str, str] | None = None,
    pod_files: bool = True,
) -> contextlib.AbstractContextManager[str]:
    """The sandbox service in ``mode`` (its URL, as a context); basic runs as a fresh non-root
    uid, with ``pod_files`` under a pod's 1,024 open files, and with ``pod_pids`` in a PID
    namespace of its own as in a pod. ``pool`` gets the mode appended; ``env`` adds variables
    to the service's environment."""
    wrapper: list[str] = []
    if mode == "basic":
        found = unprivileged_wrapper(pid_namespace=pod_pids)
        if found is None:
            raise SystemExit("cannot run the service as a non-root uid here")
        prlimit = shutil.which("prlimit")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        wrapper = ([prlimit, f"--nofile=1024:{hard}"] if prlimit and pod_files else []) + found
    return running_sandbox(
        workers=workers, limits=limits, pool=f"{pool}-{mode}", wrapper=wrapper, extra_args=["--isolation", mode, *extra],
        env=env, python=python, cwd=cwd, log=log,
    )  # fmt: skip

