"""The control plane's programs, built from their Go modules at pinned versions and cached.

Each component is built once into ``<cache>/<name>-<version>/bin`` (the cache is
``$KUBERL_K8S_CACHE``, else ~/.cache/kuberl/k8s) and reused while that folder holds every binary
it should; Go's own build and module caches make a rebuild after a cleared cache quick.

``k8s.io/kubernetes`` is not meant to be used as a module: its go.mod points each staging module
(``k8s.io/api``, ``k8s.io/client-go``, ...) at ``./staging/src/...``, which a dependent module
cannot follow. The build module therefore replaces each of them with its published release,
``v0.<minor>.<patch>`` for Kubernetes ``v1.<minor>.<patch>``, read off that go.mod.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kuberl.cluster.errors import ClusterError

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"  # the etcd minor Kubernetes 1.34 is released and tested with
KWOK_VERSION = "v0.7.0"  # supports Kubernetes 1.34's APIs
KUEUE_VERSION = "v0.17.0"  # admits external frameworks' workloads; its CRDs ship inside the module
GO_MINIMUM = (1, 26)  # etcd 3.6.16's go.mod asks for go 1.26

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
NODE_COMMANDS = ("kubelet", "kube-proxy")  # the real node's (cluster/node.py); built only where it runs


@dataclass(frozen=True)
class Component:
    """One build module ``kuberl.local/<name>``: ``main_go`` is its own main package (empty where
    the commands are packages of the required module; a main package of its own builds a binary
    called ``name``), ``packages`` what ``go build`` builds."""

    name: str
    version: str
    binaries: tuple[str, ...]
    requires: tuple[str, ...]
    packages: tuple[str, ...]
    ldflags: str = "-s -w"
    main_go: str = ""
    extras: tuple[str, ...] = ()  # files besides the binaries that a whole build leaves in bin/


def cache_root() -> Path:
    return Path(os.environ.get("KUBERL_K8S_CACHE") or Path.home() / ".cache" / "kuberl" / "k8s")


def staging_replacements(kubernetes_go_mod: str, version: str) -> list[tuple[str, str]]:
    """(module, release) for each ``=> ./staging/src/...`` line of k8s.io/kubernetes's go.mod."""
    m = re.fullmatch(r"v1\.(\d+)\.(\d+)", version)
    if not m:
        raise ClusterError(f"Kubernetes version {version!r} is not of the form v1.MINOR.PATCH")
    release = f"v0.{m[1]}.{m[2]}"
    found = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/src/", kubernetes_go_mod, re.M)
    if not found:
        raise ClusterError("k8s.io/kubernetes's go.mod lists no staging modules: the build module "
                           "cannot be written for this version")
    return [(module, release) for module in found]


def go_mod(module: str, go_version: str, requires: list[tuple[str, str]],
           replaces: list[tuple[str, str]] = ()) -> str:  # type: ignore[assignment]
    """A go.mod's text: ``requires`` and ``replaces`` as (module, version) pairs."""
    lines = [f"module {module}", "", f"go {go_version}", ""]
    lines += ["require ("] + [f"\t{m} {v}" for m, v in requires] + [")"]
    if replaces:
        lines += ["", "replace ("] + [f"\t{m} => {m} {v}" for m, v in replaces] + [")"]
    return "\n".join(lines) + "\n"


def kubernetes_ldflags(version: str) -> str:
    """The version stamps `make` would set: `kubectl version` and /version report the release."""
    minor = version.split(".")[1]
    stamps = {
        "k8s.io/component-base/version.gitVersion": version,
        "k8s.io/component-base/version.gitMajor": "1",
        "k8s.io/component-base/version.gitMinor": minor,
        "k8s.io/component-base/version.gitTreeState": "clean",
        "k8s.io/client-go/pkg/version.gitVersion": version,
        "k8s.io/client-go/pkg/version.gitMajor": "1",
        "k8s.io/client-go/pkg/version.gitMinor": minor,
    }
    return "-s -w " + " ".join(f"-X {k}={v}" for k, v in stamps.items())


ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""

COMPONENTS = (
    Component(
        name="kubernetes",
        version=KUBERNETES_VERSION,
        binaries=KUBERNETES_COMMANDS,
        requires=(f"k8s.io/kubernetes@{KUBERNETES_VERSION}",),
        packages=tuple(f"k8s.io/kubernetes/cmd/{c}" for c in KUBERNETES_COMMANDS),
        ldflags=kubernetes_ldflags(KUBERNETES_VERSION),
    ),
    Component(
        name="etcd",
        version=ETCD_VERSION,
        binaries=("etcd",),
        requires=(f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}",),
        packages=(".",),
        main_go=ETCD_MAIN,
    ),
    Component(
        name="kwok",
        version=KWOK_VERSION,
        binaries=("kwok",),
        requires=(f"sigs.k8s.io/kwok@{KWOK_VERSION}",),
        packages=("sigs.k8s.io/kwok/cmd/kwok",),
    ),
    Component(
        name="kueue",
        version=KUEUE_VERSION,
        binaries=("kueue",),
        requires=(f"sigs.k8s.io/kueue@{KUEUE_VERSION}",),
        packages=("sigs.k8s.io/kueue/cmd/kueue",),
        extras=("webhook-manifests.yaml", "crds/kueue.x-k8s.io_workloads.yaml"),
        ldflags=f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",
    ),
)


NODE_COMPONENT = Component(
    name="kubernetes-node",
    version=KUBERNETES_VERSION,
    binaries=NODE_COMMANDS,
    requires=(f"k8s.io/kubernetes@{KUBERNETES_VERSION}",),
    packages=tuple(f"k8s.io/kubernetes/cmd/{c}" for c in NODE_COMMANDS),
    ldflags=kubernetes_ldflags(KUBERNETES_VERSION),
)


KUBE_ROUTER_VERSION = "v2.1.0"
# The real node's NetworkPolicy enforcement (iptables + ipset; its router and service proxy off).
KUBE_ROUTER_COMPONENT = Component(
    name="kube-router",
    version=KUBE_ROUTER_VERSION,
    binaries=("kube-router",),
    requires=(f"github.com/cloudnativelabs/kube-router/v2@{KUBE_ROUTER_VERSION}",),
    packages=("github.com/cloudnativelabs/kube-router/v2/cmd/kube-router",),
)
COREDNS_VERSION = "v1.14.3"
# CoreDNS with only the plugins the real node's cluster DNS uses (cluster/dns.py): built from a
# main package of its own that sets the directive order, so none of the cloud providers'
# plugins (and their SDKs) is downloaded or compiled.
COREDNS_MAIN = """package main

import (
\t"github.com/coredns/coredns/core/dnsserver"
\t"github.com/coredns/coredns/coremain"
\t_ "github.com/coredns/coredns/plugin/bind"
\t_ "github.com/coredns/coredns/plugin/cache"
\t_ "github.com/coredns/coredns/plugin/errors"
\t_ "github.com/coredns/coredns/plugin/forward"
\t_ "github.com/coredns/coredns/plugin/health"
\t_ "github.com/coredns/coredns/plugin/kubernetes"
\t_ "github.com/coredns/coredns/plugin/loadbalance"
\t_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
\tdnsserver.Directives = []string{"bind", "errors", "health", "ready", "cache", "loadbalance", "kubernetes", "forward"}
}

func main() { coremain.Run() }
"""
COREDNS_COMPONENT = Component(
    name="coredns",
    version=COREDNS_VERSION,
    binaries=("coredns",),
    requires=(f"github.com/coredns/coredns@{COREDNS_VERSION}",),
    packages=(".",),
    main_go=COREDNS_MAIN,
)
NODE_COMPONENTS = (NODE_COMPONENT, KUBE_ROUTER_COMPONENT, COREDNS_COMPONENT)


def go_version(go: str) -> tuple[int, int]:
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
    m = re.match(r"go(\d+)\.(\d+)", out)
    if not m:
        raise ClusterError(f"`{go} env GOVERSION` printed {out!r}, not a Go version")
    return int(m[1]), int(m[2])


def find_go() -> str:
    """The ``go`` command, at least GO_MINIMUM; ClusterError naming what to install otherwise."""
    need = ".".join(map(str, GO_MINIMUM))
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None)
    if go is None:
        raise ClusterError(f"building the control plane needs Go {need} or newer, and no `go` command "
                           "was found: install Go (https://go.dev/dl/) and put it on PATH")
    have = go_version(go)
    if have < GO_MINIMUM:
        raise ClusterError(f"building the control plane needs Go {need} or newer; {go} is "
                           f"{have[0]}.{have[1]}: install a newer Go")
    return go


class _Builder:
    def __init__(self, go: str, log: Path):
        self.go = go
        self.log = log

    def run(self, *args: str, cwd: Path, capture: bool = False) -> str:
        env = {**os.environ, "GOFLAGS": "-mod=mod -buildvcs=false", "CGO_ENABLED": "0"}
        with self.log.open("a") as log:
            log.write(f"$ go {' '.join(args)}\n")
            log.flush()
            proc = subprocess.run([self.go, *args], cwd=cwd, env=env, text=True,
                                  stdout=subprocess.PIPE if capture else log, stderr=log)
        if proc.returncode != 0:
            tail = self.log.read_text().splitlines()[-15:]
            raise ClusterError(f"`go {args[0]}` failed in {cwd} (full log: {self.log}):\n" + "\n".join(tail))
        return proc.stdout or ""


def _kubernetes_replaces(builder: _Builder, version: str, cwd: Path) -> list[tuple[str, str]]:
    info = json.loads(builder.run("mod", "download", "-json", f"k8s.io/kubernetes@{version}",
                                  cwd=cwd, capture=True))
    return staging_replacements(Path(info["GoMod"]).read_text(), version)


def _complete(bin_dir: Path, component: Component) -> bool:
    # bin/ appears by one rename once everything is in it, so its presence means a whole build.
    return all((bin_dir / b).is_file() for b in component.binaries + component.extras)


def build(component: Component, go: str, root: Path) -> Path:
    """Build ``component`` into ``root/<name>-<version>/bin`` unless every binary is there."""
    home = root / f"{component.name}-{component.version}"
    bin_dir = home / "bin"
    if _complete(bin_dir, component):
        return bin_dir
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    builder = _Builder(go, home / "build.log")
    requires = [tuple(r.split("@")) for r in component.requires]
    kube = component.requires[0].startswith("k8s.io/kubernetes@")
    replaces = _kubernetes_replaces(builder, component.version, src) if kube else []
    (src / "go.mod").write_text(go_mod(f"kuberl.local/{component.name}", "1.24.0", requires, replaces))
    if component.main_go:
        (src / "main.go").write_text(component.main_go)
    builder.run("get", *component.requires, cwd=src)
    if component.main_go:
        builder.run("mod", "tidy", cwd=src)
    else:
        builder.run("get", *(f"{p}@{component.version}" for p in component.packages), cwd=src)
    tmp = home / "bin.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    builder.run("build", "-trimpath", "-ldflags", component.ldflags, "-o", str(tmp) + "/",
                *component.packages, cwd=src)
    missing = [b for b in component.binaries if not (tmp / b).is_file()]
    if missing:
        raise ClusterError(f"`go build` for {component.name} {component.version} made no {missing} "
                           f"(log: {builder.log})")
    if component.name == "kwok":
        _copy_stages(builder, src, tmp)
    if component.name == "kueue":
        _copy_kueue_manifests(builder, src, tmp)
    shutil.rmtree(bin_dir, ignore_errors=True)
    tmp.rename(bin_dir)
    return bin_dir


KWOK_STAGES = ("stage/pod/fast/pod-ready.yaml", "stage/pod/fast/pod-complete.yaml",
               "stage/pod/fast/pod-delete.yaml", "stage/pod/chaos/pod-container-running-failed.yaml")
"""kwok's own pod stages, as released: a pod becomes Running and Ready, completes, is deleted, and
fails on demand. kwok uses its built-in pod stages only where it is given none, so the whole
set is handed over together."""


def _copy_stages(builder: _Builder, src: Path, out: Path) -> None:
    module = json.loads(builder.run("list", "-m", "-json", "sigs.k8s.io/kwok", cwd=src, capture=True))
    stages = out / "stages"
    stages.mkdir()
    for rel in KWOK_STAGES:
        shutil.copyfile(Path(module["Dir"]) / "kustomize" / rel, stages / Path(rel).name)


def _copy_kueue_manifests(builder: _Builder, src: Path, out: Path) -> None:
    """Kueue's CRDs and webhook manifests as the module ships them, beside its binary
    (``kuberl.cluster.kueue`` installs them)."""
    module = json.loads(builder.run("list", "-m", "-json", "sigs.k8s.io/kueue", cwd=src, capture=True))
    config = Path(module["Dir"]) / "config" / "components"
    crds = out / "crds"
    crds.mkdir()
    for path in sorted((config / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(path, crds / path.name)
    shutil.copyfile(config / "webhook" / "manifests.yaml", out / "webhook-manifests.yaml")


def kwok_stages(bin_dir: Path) -> list[Path]:
    """The stage files :func:`build` put beside the kwok binary."""
    return [bin_dir / "stages" / Path(rel).name for rel in KWOK_STAGES]


def ensure_binaries(root: Path | None = None, components: tuple[Component, ...] = COMPONENTS) -> dict[str, Path]:
    """Every control-plane program by name (or those of ``components``), building what the cache
    lacks (minutes the first time)."""
    root = root or cache_root()
    missing = [c for c in components if not _complete(root / f"{c.name}-{c.version}" / "bin", c)]
    go = find_go() if missing else ""
    paths: dict[str, Path] = {}
    for component in components:
        bin_dir = build(component, go, root)
        paths.update({b: bin_dir / b for b in component.binaries})
    return paths
