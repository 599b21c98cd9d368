"""A real control plane (``kuberl cluster up``) and ``kuberl operator`` running on it under the Helm
chart's ServiceAccount and RBAC, for the tests marked ``k8s``.

The control plane is built from its Go modules on first use (cached under ~/.cache/kuberl/k8s).
Without Go the tests skip with the reason, except where ``KUBERL_REQUIRE_K8S=1`` (CI), where they
fail. ``KUBERL_K8S_DIR=DIR`` reuses a cluster already started with ``kuberl cluster up --dir DIR``
(and leaves it running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from chart_render import render

from kuberl.cluster.control_plane import ClusterState, kubeconfig_text, running
from kuberl.util.ports import free_port

REPO = Path(__file__).resolve().parent.parent
OPERATOR_NAMESPACE = "kuberl-system"
T = TypeVar("T")


def require_or_skip(reason: str) -> None:
    if os.environ.get("KUBERL_REQUIRE_K8S") == "1":
        pytest.fail(f"KUBERL_REQUIRE_K8S=1 but {reason}")
    pytest.skip(reason)


class Kube:
    """The cluster's own kubectl (same release as the API server) with one kubeconfig."""

    def __init__(self, state: ClusterState, kubeconfig: Path | None = None):
        self.state = state
        self.kubeconfig = kubeconfig or state.kubeconfig
        self.binary = state.binaries["kubectl"]

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def items(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        args = ["get", kind, "-n", namespace] + (["-l", selector] if selector else [])
        return self.json(*args)["items"]

    def apply(self, docs: list[dict] | str, *extra: str) -> subprocess.CompletedProcess:
        text = docs if isinstance(docs, str) else yaml.safe_dump_all(docs)
        return self.run("apply", "-f", "-", *extra, input=text)


def wait_for(probe: Callable[[], T | None], timeout: float, what: str | Callable[[], str],
             interval: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; AssertionError naming ``what`` (or what it
    returns when called then: the state worth seeing) after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"after {timeout:.0f} s: {what() if callable(what) else what} (last seen: {last!r})")


def start_control_plane(tmp: Path) -> tuple[ClusterState, bool]:
    """(the cluster, whether this session started it and must stop it)."""
    reuse = os.environ.get("KUBERL_K8S_DIR")
    if reuse:
        state = running(Path(reuse))
        if state is None:
            require_or_skip(f"KUBERL_K8S_DIR={reuse} but no cluster runs there: `kuberl cluster up --dir {reuse}`")
        return state, False
    from kuberl.cluster.control_plane import up
    from kuberl.cluster.errors import ClusterError

    try:
        return up(tmp), True
    except ClusterError as err:
        require_or_skip(f"no control plane: {err}")
        raise


def running_ready(pod: dict) -> bool:
    st = pod.get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    return st.get("phase") == "Running" and conds.get("Ready") == "True"


def new_namespace(kube: Kube, prefix: str) -> str:
    """A fresh namespace ``prefix-xxxxxx``, once its pods can be admitted (its default
    ServiceAccount exists)."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kube.run("create", "namespace", ns)
    wait_for(lambda: kube.run("get", "sa", "default", "-n", ns, check=False).returncode == 0, 30,
             f"the default ServiceAccount of {ns}")
    return ns


def install_crds(kube: Kube) -> None:
    """The chart's CRDs, server-side applied, and established."""
    kube.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "charts" / "kuberl" / "crds"))
    for crd in ("agenticrljobs", "rolloutfleets", "sandboxpools"):
        # `kubectl wait` fails at once on a CRD whose status has no conditions yet (seen right
        # after the apply on a loaded machine): ask again until it has them
        wait_for(lambda crd=crd: kube.run("wait", "--for=condition=Established", f"crd/{crd}.kuberl.io",
                                          "--timeout=60s", check=False).returncode == 0, 120,
                 f"crd/{crd}.kuberl.io Established", interval=0.5)


def install_chart_rbac(kube: Kube) -> str:
    """The chart's CRDs, ServiceAccount and RBAC as `helm install --set kueue.enabled=true` makes
    them (the control plane runs Kueue); the SA's name."""
    install_crds(kube)
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}}])
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    objs = [o for o in render({"kueue": {"enabled": True}}) if o["kind"] in rbac_kinds]
    kube.apply(objs)
    return next(o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount")


class Operator:
    """``kuberl operator -A`` as a process, authenticated as the chart's ServiceAccount by a token
    from the TokenRequest API, with leader election on as the chart deploys it."""

    def __init__(self, kube: Kube, service_account: str, workdir: Path):
        self.kube = kube
        self.service_account = service_account
        self.workdir = workdir
        token = kube.run("create", "token", service_account, "-n", OPERATOR_NAMESPACE, "--duration=6h").stdout.strip()
        self.kubeconfig = workdir / "operator.kubeconfig"
        state = kube.state
        self.kubeconfig.write_text(kubeconfig_text(state.server, Path(state.dir) / "pki" / "ca.crt",
                                                   f"system:serviceaccount:{OPERATOR_NAMESPACE}:{service_account}",
                                                   token=token))
        self.log = workdir / "operator.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBERL_RECONCILE_INTERVAL": "5",
            "KUBERL_AUTOSCALE_INTERVAL": "2",
            "KUBERL_HEALTH_PORT": str(free_port()),
            "KUBERL_LIVENESS_PORT": str(free_port()),
            "KUBERL_LEASE_NAME": "kuberl",
            "KUBERL_LEASE_NAMESPACE": OPERATOR_NAMESPACE,
            "KUBERL_POD_NAME": f"operator-{self.starts}",
            "KUBERL_KUEUE": "1",  # the chart's RBAC is installed with kueue.enabled (install_chart_rbac)
        }
        with self.log.open("a") as log:
            log.write(f"--- start {self.starts}\n")
            log.flush()
            # -P and a neutral cwd: the checkout's operator/ folder is not the stdlib's operator
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kuberl", "operator", "-A", "--metrics-port", "0"],
                                         cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")
