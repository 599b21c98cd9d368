"""`kuberl validate` is never weaker than the API server: every manifest of examples/ and
examples/invalid/ goes through `kubectl apply --dry-run=server` on a real control plane (the CRDs
installed from the chart) and through `kuberl validate`; whatever the server refuses, validate
refuses too, naming a field the server names. `kuberl validate --server` is checked against the
same server.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_fixtures import REPO, Kube, install_crds
from test_api import APISERVER_REJECTS

pytestmark = pytest.mark.k8s

FILES = sorted((REPO / "examples").glob("*.yaml")) + sorted((REPO / "examples" / "invalid").glob("*.yaml"))
# Cases too big to keep as files: 140 Ki characters of 'é' are 280 KiB of UTF-8, over the
# annotations' 256 KiB, which a count of characters misses.
GENERATED = {
    "annotations-over-256KiB-in-bytes": "apiVersion: kuberl.io/v1alpha1\nkind: SandboxPool\nmetadata:\n  name: big\n"
    f"  annotations:\n    note: \"{'é' * 140 * 1024}\"\nspec: {{}}\n",
}
NAMESPACE = "validate-corpus"
# a field path as the API server writes it: spec.rollout.fleet.replicas, metadata.annotations, ...
FIELD = re.compile(r"\b((?:metadata|spec)(?:\.[A-Za-z0-9_-]+|\[\d+\])*)")


@pytest.fixture(scope="module")
def crds(kube: Kube) -> Kube:
    install_crds(kube)
    if kube.run("get", "namespace", NAMESPACE, check=False).returncode != 0:
        kube.run("create", "namespace", NAMESPACE)
    return kube


def kuberl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "kuberl", *args], capture_output=True, text=True,
                          cwd=REPO / "examples", env=env, timeout=120)


def server_fields(message: str) -> list[str]:
    """The most specific field paths a refusal names (``spec`` alone says nothing)."""
    fields = {m.group(1) for m in FIELD.finditer(message)}
    return sorted(f for f in fields if "." in f or "[" in f)


def normalise(text: str) -> str:
    """Field paths without list subscripts: the server writes containers[0] where kuberl writes
    containers[sandbox] (the name a user knows), and some refusals omit the index altogether."""
    return re.sub(r"\[[^\]]*\]", "", text)


def corpus(tmp: Path, case: str) -> Path:
    if case in GENERATED:
        path = tmp / f"{case}.yaml"
        path.write_text(GENERATED[case])
        return path
    return REPO / "examples" / case


CASES = [f"{p.parent.name}/{p.name}".removeprefix("examples/") for p in FILES] + sorted(GENERATED)


def assert_refused_alike(server_said: str, local: subprocess.CompletedProcess, what: str) -> None:
    said = local.stdout + local.stderr
    assert local.returncode != 0, f"the API server refuses {what}:\n{server_said}\nkuberl validate accepts it:\n{said}"
    fields = server_fields(server_said)
    if fields:
        assert any(normalise(f) in normalise(said) for f in fields), (
            f"the server names {fields} for {what}; kuberl validate says:\n{said}")


@pytest.mark.parametrize("case", CASES)
def test_validate_refuses_whatever_the_api_server_refuses(crds, case, tmp_path):
    path = corpus(tmp_path, case)
    server = crds.run("apply", "--dry-run=server", "-n", NAMESPACE, "-f", str(path), check=False)
    local = kuberl("validate", str(path))
    # a file test_api.py lists as refused by kuberl's own rules alone must pass the server, its
    # children included: otherwise the rule belongs to the schema (APISERVER_REJECTS)
    only_kuberl = case.startswith("invalid/") and APISERVER_REJECTS.get(path.name) == set()
    assert not (only_kuberl and server.returncode != 0), f"the API server refuses {path.name}:\n{server.stderr}"
    if server.returncode != 0:
        assert_refused_alike(server.stderr, local, path.name)
        return
    # The server takes the kuberl objects: it must also take the children the operator makes.
    rendered = kuberl("render", "--namespace", NAMESPACE, str(path))
    if rendered.returncode == 0:
        children = crds.run("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", input=rendered.stdout,
                            check=False)
        # (a LeaderWorkerSet child needs the LWS CRD, which this control plane does not install)
        unserved = "no matches for kind" in children.stderr
        assert not (only_kuberl and children.returncode != 0 and not unserved), (
            f"the API server refuses a child of {path.name}:\n{children.stderr}")
        if children.returncode != 0:
            assert_refused_alike(children.stderr, local, f"the children of {path.name}")
            return
    if local.returncode != 0:
        # stricter than the server: only in the invalid corpus, where each file says what kuberl
        # knows that the server does not
        assert "invalid" in case, f"{path.name} is an example kuberl validate refuses:\n{local.stderr}"


def test_validate_server_flag_asks_the_api_server(crds, tmp_path):
    """--server adds the server's own dry-run: a manifest refused only by a rule kuberl does not
    know (here: a namespace that does not exist) is refused with the server's words."""
    manifest = tmp_path / "pool.yaml"
    manifest.write_text("apiVersion: kuberl.io/v1alpha1\nkind: SandboxPool\n"
                        "metadata: {name: tools, namespace: no-such-namespace}\nspec: {replicas: 1}\n")
    env = {**__import__("os").environ, "KUBECONFIG": str(crds.kubeconfig)}
    assert kuberl("validate", str(manifest)).returncode == 0
    out = kuberl("validate", "--server", str(manifest), env=env)
    assert out.returncode != 0
    assert "no-such-namespace" in out.stdout + out.stderr and "server" in (out.stdout + out.stderr).lower()
    good = kuberl("validate", "--server", str(REPO / "examples" / "quickstart.yaml"), env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "server" in good.stdout.lower()


# --- resource requirements, every place a user sets them, in every shape the server judges ---------

RESOURCE_PLACES = {
    "pool": lambda r: {"kind": "SandboxPool", "spec": {"resources": r}},
    "pool-template": lambda r: {
        "kind": "SandboxPool",
        "spec": {"podTemplate": {"spec": {"containers": [{"name": "sandbox", "resources": r}]}}},
    },
    "fleet": lambda r: {
        "kind": "RolloutFleet",
        "spec": {"model": {"uri": "m"}, "resources": r, "weightSync": {"claimName": "w"}},
    },
    "trainer": lambda r: {
        "kind": "AgenticRLJob",
        "spec": {"model": {"base": "m"}, "data": {"train": "d"}, "trainer": {"resources": r}},
    },
}
RESOURCE_SHAPES = {
    "cpu-request-over-limit": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}},
    "memory-request-over-limit": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}},
    "memory-request-alone": {"requests": {"memory": "4Ti"}},
    "cpu-limit-zero": {"limits": {"cpu": "0"}},
    "ephemeral-request-over-limit": {"requests": {"ephemeral-storage": "20Gi"}, "limits": {"ephemeral-storage": "10Gi"}},
    "hugepages-request-not-limit": {
        "requests": {"memory": "4Gi", "hugepages-2Mi": "1Gi"},
        "limits": {"memory": "4Gi", "hugepages-2Mi": "2Gi"},
    },
    "hugepages-request-without-limit": {"requests": {"memory": "4Gi", "hugepages-2Mi": "1Gi"}},
    "hugepages-partial-page": {"limits": {"memory": "4Gi", "hugepages-1Gi": "1536Mi"}},
    "hugepages-alone": {"limits": {"hugepages-2Mi": "1Gi"}},
    "extended-fraction": {"limits": {"example.com/foo": "500m"}},
    "extended-request-not-limit": {"requests": {"example.com/foo": "1"}, "limits": {"example.com/foo": "2"}},
    "extended-request-without-limit": {"requests": {"example.com/foo": "1"}},
    "unqualified-name": {"limits": {"foo": "1"}},
    "memory-fractional-bytes": {"requests": {"memory": "2500m"}, "limits": {"memory": "2500m"}},
}


def _cli(*args: str) -> tuple[int, str, str]:
    """`kuberl ARGS` in this process (a subprocess a case would cost a second of imports)."""
    import contextlib
    import io

    from kuberl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("shape", sorted(RESOURCE_SHAPES))
@pytest.mark.parametrize("place", sorted(RESOURCE_PLACES))
def test_validate_refuses_the_resources_the_api_server_refuses(crds, place, shape, tmp_path):
    """Whatever requests and limits the server refuses, of the object or of a child the operator
    makes of it, offline validate refuses too, naming the field the server names."""
    import yaml

    doc = {"apiVersion": "kuberl.io/v1alpha1", "metadata": {"name": f"{place}-{shape}"[:40].rstrip("-")},
           **RESOURCE_PLACES[place](RESOURCE_SHAPES[shape])}
    path = tmp_path / "case.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, out, err = _cli("validate", str(path))
    local = subprocess.CompletedProcess([], rc, out, err)
    server = crds.run("apply", "--dry-run=server", "-n", NAMESPACE, "-f", str(path), check=False)
    if server.returncode != 0:
        assert_refused_alike(server.stderr, local, f"{place}/{shape}")
        return
    rendered_rc, rendered, render_err = _cli("render", "--namespace", NAMESPACE, str(path))
    assert rendered_rc == 0 or rc != 0, f"render failed on a manifest validate accepts:\n{render_err}"
    if rendered_rc == 0:
        children = crds.run("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", input=rendered, check=False)
        if children.returncode != 0:
            assert_refused_alike(children.stderr, local, f"the children of {place}/{shape}")
