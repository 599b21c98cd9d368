"""The pure parts of `kuberl images`: requirement lists, COPY sources, .dockerignore, input digests,
tag names and build arguments (no buildah needed; tests/test_image_build.py builds for real)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from kuberl.api.job import DEFAULT_TRAINER_IMAGES
from kuberl.api.rollout_fleet import VLLM_IMAGES
from kuberl.api.sandbox_pool import DEFAULT_SANDBOX_IMAGE
from kuberl.cli import main
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.image_build import host_extra_cas, require_tools
from kuberl.cluster.images import (
    IMAGES,
    BaseRecipe,
    build_args,
    context_files,
    copy_sources,
    ignore_patterns,
    ignored,
    image_inputs_digest,
    inputs_digest,
    render_build_args,
    select,
)
from kuberl.operator.render.builders import OPERATOR_IMAGE

ROOT = Path(__file__).resolve().parent.parent


def _requirements_module():
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "images" / "requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_requirements_expand_extras_and_self_references():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = _requirements_module().requirements
    core = reqs(project, [])
    assert core == project["dependencies"]
    op = reqs(project, ["operator"])
    assert op[: len(core)] == core and "kopf>=1.37" in op
    # bench = kuberl[train] + trl: the self-reference brings in train's torch, once
    bench = reqs(project, ["bench", "train"])
    assert "torch>=2.3" in bench and bench.count("torch>=2.3") == 1 and not any(r.startswith("kuberl") for r in bench)
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        reqs(project, ["nope"])


def test_images_are_tagged_with_the_names_pods_use():
    assert IMAGES["sandbox"].ref == DEFAULT_SANDBOX_IMAGE == "ghcr.io/kuberl/sandbox:0.1.0"
    assert IMAGES["operator"].ref == OPERATOR_IMAGE == "ghcr.io/kuberl/kuberl:0.1.0"
    assert IMAGES["trainer-cpu"].ref == DEFAULT_TRAINER_IMAGES["cpu"] == "ghcr.io/kuberl/trainer:0.1.0-cpu"
    # a cpu vLLM fleet's engines default to the rollout-cpu image
    assert IMAGES["rollout-cpu"].ref == VLLM_IMAGES["cpu"] == "ghcr.io/kuberl/rollout:0.1.0-vllm-cpu"
    for spec in IMAGES.values():
        assert (ROOT / spec.dockerfile).is_file(), spec


def test_select_defaults_orders_and_names_the_known_images():
    assert [s.name for s in select([])] == ["sandbox", "operator"]
    assert [s.name for s in select(["operator", "sandbox"])] == ["sandbox", "operator"]
    with pytest.raises(ValueError, match="no image called web: kuberl builds sandbox, operator, trainer-cpu, "
                                         "rollout-cpu"):
        select(["web"])


def test_build_args_render_sorted_with_the_base():
    args = build_args(IMAGES["trainer-cpu"], "localhost/kuberl/base:bookworm")
    assert render_build_args(args) == [
        "--build-arg", "BASE=localhost/kuberl/base:bookworm",
        "--build-arg", "TORCH_INDEX=https://pypi.org/simple",
        "--build-arg", "TORCH_VERSION=2.13.0",
    ]  # fmt: skip
    assert render_build_args(build_args(IMAGES["sandbox"], "b:1")) == ["--build-arg", "BASE=b:1"]


def test_copy_sources_follow_continuations_and_skip_stage_copies():
    text = "FROM x\nCOPY a.toml \\\n  b.py ./\nCOPY --chown=1:1 src/ src/\nCOPY --from=build /out /out\nRUN true\n"
    assert copy_sources(text) == ["a.toml", "b.py", "src/"]
    sandbox = copy_sources((ROOT / "images/sandbox/Dockerfile").read_text())
    assert sandbox[:2] == ["pyproject.toml", "images/requirements.py"] and "sandbox/" in sandbox


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("sandbox/__pycache__/x.cpython-311.pyc", True),
        ("__pycache__/a.py", True),
        ("sandbox/service/app.pyc", True),
        ("kuberl.egg-info/PKG-INFO", True),
        ("sandbox/service/app.py", False),
        ("README.md", False),
    ],
)
def test_dockerignore_leaves_out_caches(path, want):
    patterns = ignore_patterns((ROOT / ".dockerignore").read_text())
    assert ignored(path, patterns) is want


def _context(tmp_path: Path) -> Path:
    (tmp_path / "images/sandbox").mkdir(parents=True)
    (tmp_path / "images/sandbox/Dockerfile").write_text(
        "ARG BASE=python:3.11.11-slim-bookworm\nFROM ${BASE}\nCOPY pyproject.toml ./\nCOPY sandbox/ sandbox/\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname='kuberl'\n")
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "sandbox/a.py").write_text("A = 1\n")
    (tmp_path / ".dockerignore").write_text("**/__pycache__\n")
    return tmp_path


def test_the_inputs_digest_changes_with_every_input_and_nothing_else(tmp_path):
    root = _context(tmp_path)
    spec = IMAGES["sandbox"]
    base = BaseRecipe()
    first = image_inputs_digest(root, spec, base)
    assert image_inputs_digest(root, spec, base) == first
    (root / "sandbox/__pycache__").mkdir()
    (root / "sandbox/__pycache__/a.cpython-311.pyc").write_bytes(b"\0")
    (root / "unrelated.txt").write_text("not copied")
    assert image_inputs_digest(root, spec, base) == first, "ignored and uncopied files must not count"
    seen = {first}
    for change in (
        lambda: (root / "sandbox/a.py").write_text("A = 2\n"),
        lambda: (root / "sandbox/b.py").write_text(""),
        lambda: (root / "pyproject.toml").write_text("[project]\nname='kuberl'\nversion='2'\n"),
        lambda: (root / "images/sandbox/Dockerfile").write_text(
            (root / "images/sandbox/Dockerfile").read_text() + "USER 65532\n"),
        lambda: (root / ".dockerignore").write_text("**/__pycache__\n*.md\n"),
    ):
        change()
        digest = image_inputs_digest(root, spec, base)
        assert digest not in seen
        seen.add(digest)
    assert image_inputs_digest(root, spec, BaseRecipe(packages=("python3",))) not in seen
    assert image_inputs_digest(root, spec, BaseRecipe(extra_cas=(("x.crt", "PEM"),))) not in seen
    # a file's name and content are separated: moving bytes between them changes the digest
    assert inputs_digest("d", "b", {}, [("a", b"bc")]) != inputs_digest("d", "b", {}, [("ab", b"c")])


def test_a_missing_copy_source_is_named(tmp_path):
    root = _context(tmp_path)
    (root / "sandbox/a.py").unlink()
    (root / "sandbox").rmdir()
    with pytest.raises(FileNotFoundError, match="COPY source sandbox/ is not in the build context"):
        list(context_files(root, ["pyproject.toml", "sandbox/"], []))


def test_host_extra_cas_are_read_in_order(tmp_path):
    (tmp_path / "b.crt").write_text("B")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/a.crt").write_text("A")
    (tmp_path / "notes.txt").write_text("not a certificate")
    assert host_extra_cas(tmp_path) == (("b.crt", "B"), ("sub/a.crt", "A"))
    assert host_extra_cas(tmp_path / "none") == ()


def test_missing_tools_name_the_apt_packages(tmp_path):
    (tmp_path / "debootstrap").write_text("#!/bin/sh\n")
    (tmp_path / "debootstrap").chmod(0o755)
    with pytest.raises(ClusterError, match=r"^buildah, ctr, runc not found: `apt-get install -y "
                                           r"buildah containerd runc`"):
        require_tools(("buildah", "debootstrap", "ctr", "runc"), search_path=str(tmp_path))


def test_the_cli_refuses_a_folder_that_is_not_a_checkout(tmp_path, capsys):
    assert main(["images", "build", "--context", str(tmp_path)]) == 2
    assert "is not a kuberl checkout (no images/sandbox/Dockerfile there)" in capsys.readouterr().err
    assert main(["images", "build", "web"]) == 2
    assert "no image called web" in capsys.readouterr().err

