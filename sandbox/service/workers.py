"""The service's handles on its worker processes: start one (in its own namespaces where it
may), send it a batch and read each call's answer, stop it and remove what it left behind."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from typing import Any

from kuberl.sandbox.config import ServiceConfig
from kuberl.sandbox.containment.cgroups import remove_cgroup_dirs
from kuberl.sandbox.containment.fsview import clear_dir, worker_env
from kuberl.sandbox.process.worker import encode_frames

# Every call forks the ~100 MB preloaded worker; fork and exit cost scales with the number of
# anonymous pages mapped. glibc malloc on transparent huge pages (instead of pymalloc's 4 KiB
# pages) maps far fewer of them where THP is "madvise" or "always".
FORK_FRIENDLY_MALLOC = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def worker_cpus(workers: int, allowed: set[int]) -> list[int | None]:
    """The CPU each worker (and its zygotes and calls) keeps to, by slot (pure).

    A call passes between its worker, the zygote and its own process several times; on one
    CPU each hand-over is a local wake-up, across CPUs an inter-processor interrupt (a VM
    exit on a virtual machine), and the pages of the chain stay in that CPU's caches. Only where this
    process may run on no more CPUs than there are workers (the service owns them: one worker
    per core by default, or a pod's exclusive cpuset); on a shared node's many CPUs (a pod
    with a CPU quota only) no worker is pinned to CPUs others use: None."""
    cpus = sorted(allowed)
    if not cpus or len(cpus) > workers:
        return [None] * workers
    return [cpus[i % len(cpus)] for i in range(workers)]


class WorkerLost(RuntimeError):
    """A worker died or stopped answering; ``blame``: it was running the first pending call."""

    def __init__(self, message: str, blame: bool) -> None:
        super().__init__(message)
        self.blame = blame


class WorkerProc:
    """One fork-server subprocess (in its own net+PID namespace when possible)."""

    def __init__(self, slot: int, cfg: ServiceConfig) -> None:
        self.slot = slot
        self.cfg = cfg
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # the worker itself (proc is `unshare` in a namespace)
        self.zygote_pids: tuple[int, ...] = ()  # the worker's zygotes (fork its calls' children)
        self.up = False
        self.protections: dict[str, bool] = {}
        self.leftovers: dict[str, Any] = {}

    async def start(self, spawn_lock: asyncio.Lock | None = None) -> None:
        lim = self.cfg.lim
        wcfg = {
            "slot": self.slot,
            "pool": re.sub(r"[^A-Za-z0-9_.-]", "_", self.cfg.pool),
            "timeout_seconds": lim.timeout_seconds,
            "memory_mb": lim.memory_mb,
            "max_output_bytes": lim.max_output_bytes,
            "max_processes": lim.max_processes,
            "disk_mb": lim.disk_mb,
        }
        ns = _namespace_prefix() if self.cfg.isolation == "full" else []
        wcfg["in_namespace"] = bool(ns)
        wcfg["isolation"] = self.cfg.isolation
        wcfg["uid_base"] = self.cfg.uid_base
        if self.cfg.pin_workers:
            wcfg["cpu"] = worker_cpus(self.cfg.workers, os.sched_getaffinity(0))[self.slot % self.cfg.workers]
        # -P: the current directory (a checkout, say) is not on the worker's path
        cmd = [sys.executable, "-P", "-m", "kuberl.sandbox.process.worker", json.dumps(wcfg)]
        # an allowlist, never the service's own environment: every call is forked from the
        # worker, and /proc/self/environ shows the environment the worker started with
        threads = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env = worker_env(dict(os.environ), {**FORK_FRIENDLY_MALLOC, **threads})
        async with spawn_lock or contextlib.nullcontext():  # the orphan sweep must see our pid
            self.proc = await asyncio.create_subprocess_exec(
                *(ns + cmd),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                limit=2**26,  # one answer line carries a call's stdout, stderr and traceback
            )
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sandbox worker {self.slot} failed to start")
        hello = json.loads(line)
        self.protections = dict(hello.get("protections", {}), namespaces=bool(ns))
        self.leftovers = hello.get("leftovers", {})
        self.pid = self.proc.pid if ns else int(hello.get("pid", self.proc.pid))
        # inside a PID namespace its pid means nothing here (and no call of another slot sees it)
        self.zygote_pids = () if ns else tuple(int(p) for p in hello.get("zygote_pids") or [] if p)
        self.up = True

    async def run(self, calls: list[dict[str, Any]], protect: list[int]) -> AsyncIterator[dict[str, Any]]:
        """Send a batch; yield each call's raw report as the worker finishes it.

        Raises WorkerLost when the worker is gone or silent for a call's deadline plus
        ``run_margin_s`` (``blame``: the call then being run is the one that was running)."""
        proc = self.proc
        if proc is None or proc.returncode is not None or proc.stdin is None or proc.stdout is None:
            raise WorkerLost("sandbox worker is not running", blame=False)
        try:
            proc.stdin.write(encode_frames(calls, protect))
            await proc.stdin.drain()
        except (ConnectionError, RuntimeError) as err:
            raise WorkerLost(f"sandbox worker is gone ({err})", blame=False) from err
        for call in calls:
            limit = float(call["timeout"]) + self.cfg.run_margin_s
            try:
                async with asyncio.timeout(limit):  # (wait_for would start a task per call)
                    line = await proc.stdout.readline()
            except TimeoutError as err:
                raise WorkerLost(f"sandbox worker gave no answer within {limit:g} s", blame=True) from err
            if not line:
                raise WorkerLost("sandbox worker died", blame=True)
            yield json.loads(line)["result"]

    async def stop(self, grace: float = 3.0) -> None:
        """Let the worker clean up (EOF on its protocol pipe), kill it after ``grace`` seconds,
        then remove what a killed worker could not: its slot cgroups and scratch directory."""
        self.up = False
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(Exception):
                    proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
        if self.leftovers:
            # not in a thread: a call may signal none of the server's threads, so it has one
            remove_leftovers(self.leftovers)
            self.leftovers = {}


def remove_leftovers(leftovers: dict[str, Any]) -> None:
    remove_cgroup_dirs(list(leftovers.get("cgroups", [])))
    path = leftovers.get("dir")
    if isinstance(path, str) and os.path.basename(path).startswith("kuberl-sbx-"):
        # what a call left may be locked or deeper than PATH_MAX: rmtree alone gives up on it
        with contextlib.suppress(OSError):
            clear_dir(path, budget_s=10.0)
        shutil.rmtree(path, ignore_errors=True)
        for aside in glob.glob(glob.escape(path) + ".*"):  # replacements and trees moved aside
            with contextlib.suppress(OSError):
                clear_dir(aside, budget_s=10.0)
            shutil.rmtree(aside, ignore_errors=True)


_NS_CACHE: list[list[str]] = []


def _namespace_prefix() -> list[str]:
    """``unshare`` net+PID(+mount for /proc) prefix if it works here, else [] (reported)."""
    if _NS_CACHE:
        return _NS_CACHE[0]
    prefix: list[str] = []
    exe = shutil.which("unshare")
    if exe and os.geteuid() == 0:
        cand = [exe, "--net", "--pid", "--ipc", "--uts", "--fork", "--mount-proc", "--kill-child"]
        import subprocess

        try:
            ok = subprocess.run([*cand, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            prefix = cand
    _NS_CACHE.append(prefix)
    return prefix
