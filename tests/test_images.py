"""Static lint of images/*/Dockerfile* (no docker here): pinned bases, non-root, exec-form entrypoints.

hadolint is not installable from PyPI in this environment, so the rules that matter for these
images are checked by a small Dockerfile parser instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kuberl.api.job import DEFAULT_TRAINER_IMAGES
from kuberl.api.sandbox_pool import DEFAULT_SANDBOX_IMAGE
from kuberl.operator.builders import OPERATOR_IMAGE

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
DOCKERFILES = sorted(p for p in IMAGES.rglob("Dockerfile*") if p.is_file())


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


def lint(path: Path) -> list[str]:
    """Problems found in one Dockerfile (empty list: clean)."""
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
    froms = [a for w, a in ins if w == "FROM"]
    if not froms or ins[0][0] not in ("FROM", "ARG"):
        problems.append("must start with FROM")
    for base in froms:
        image = base.split()[0]
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        if not tag or tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"base image {image} is not pinned to a versioned tag")
    users = [a for w, a in ins if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the final USER must be non-root")
    for w, a in ins:
        if w in ("ENTRYPOINT", "CMD"):
            try:
                form = json.loads(a)
            except json.JSONDecodeError:
                form = None
            if not (isinstance(form, list) and all(isinstance(x, str) for x in form)):
                problems.append(f"{w} must use the exec (JSON array) form: {a}")
        if w == "HEALTHCHECK" and "CMD [" not in a:
            problems.append("HEALTHCHECK must use CMD in exec form")
        if w == "RUN" and re.search(r"\bpip install\b", a) and "--no-cache-dir" not in a:
            problems.append(f"pip install without --no-cache-dir: {a}")
        if w == "RUN" and "apt-get install" in a and "--no-install-recommends" not in a:
            problems.append("apt-get install without --no-install-recommends")
        if w == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--") and not (ROOT / src).exists():
                    problems.append(f"COPY source {src} does not exist in the build context (repo root)")
    if not any(w == "ENTRYPOINT" for w, _ in ins):
        problems.append("no ENTRYPOINT")
    return problems


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(IMAGES)))
def test_dockerfile_is_clean(path):
    assert lint(path) == []


def test_the_lint_catches_bad_dockerfiles(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nADD x /x\nRUN pip install numpy\nUSER root\nENTRYPOINT kuberl serve\n"
        "HEALTHCHECK CMD curl localhost\nCOPY no_such_dir/ /x\n"
    )
    problems = " | ".join(lint(bad))
    for want in (
        "not pinned",
        "ADD",
        "--no-cache-dir",
        "non-root",
        "exec (JSON array)",
        "HEALTHCHECK",
        "no_such_dir",
    ):
        assert want in problems, want


def test_the_expected_images_exist():
    by = {str(p.relative_to(IMAGES)): instructions(p) for p in DOCKERFILES}
    assert set(by) == {
        "operator/Dockerfile",
        "sandbox/Dockerfile",
        "trainer/Dockerfile.rocm",
        "trainer/Dockerfile.cuda",
        "trainer/Dockerfile.cpu",
        "rollout/Dockerfile.rocm",
    }

    def base(name: str) -> str:
        return next(a for w, a in by[name] if w == "FROM")

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


def test_readme_documents_every_default_image():
    readme = (IMAGES / "README.md").read_text()
    for image in (DEFAULT_SANDBOX_IMAGE, OPERATOR_IMAGE, *DEFAULT_TRAINER_IMAGES.values()):
        repo = image.rsplit(":", 1)[0]
        assert repo in readme, image
    for p in DOCKERFILES:
        assert str(p.relative_to(ROOT)) in readme, p
