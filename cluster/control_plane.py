"""``kuberl cluster up|down``: a single-node control plane on loopback, from the real programs.

etcd, kube-apiserver (client certificates, service-account tokens, RBAC authorization),
kube-controller-manager (every default controller: garbage collector, Deployment, ReplicaSet,
StatefulSet, Job, HPA, service-account tokens, ...), kube-scheduler, kwok, which keeps the
simulated nodes Ready and plays their kubelets (pods bound to a node become Running and Ready),
and Kueue (queues, quota, priority preemption; ``kueue.py``).
Nothing runs in a container and nothing listens beyond 127.0.0.1.

Everything a cluster has lives in its folder: certificates under ``pki/``, etcd's data, one log
per program under ``logs/``, ``kubeconfig`` (the admin's) and ``cluster.json`` (ports, process
ids), which ``down`` reads. The processes run in sessions of their own, so ``up`` returns and
the cluster stays until ``down``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from kuberl.cluster import kueue, nodes
from kuberl.cluster import node as real_node_mod
from kuberl.cluster.build import ensure_binaries, kwok_stages
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.node_config import host_port
from kuberl.cluster.nodes import KWOK_NODE_ANNOTATION, NodePool, default_pools, node_manifests
from kuberl.cluster.pki import (
    ADMIN,
    APISERVER_KUBELET_CLIENT,
    CONTROLLER_MANAGER,
    KWOK,
    SCHEDULER,
    ClientIdentity,
    Pki,
    make_pki,
)

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
STATE_FILE = "cluster.json"
# The order processes start in; ``down`` stops them in reverse.
PROGRAMS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kueue")


@dataclass
class ClusterState:
    """What ``cluster.json`` records of a running control plane."""

    dir: str
    api_port: int
    etcd_port: int
    etcd_peer_port: int
    controller_manager_port: int
    scheduler_port: int
    binaries: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)
    audit: bool = False
    pod_cidr: str = POD_CIDR

    @property
    def audit_log(self) -> Path:
        """One JSON line per request the API server answered (``up(audit=True)`` only)."""
        return Path(self.dir) / "logs" / "audit.jsonl"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return Path(self.dir) / "kubeconfig"

    def save(self) -> None:
        (Path(self.dir) / STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: Path) -> ClusterState | None:
        path = folder / STATE_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


def kubeconfig_text(server: str, ca: Path, user: str, *, cert: Path | None = None, key: Path | None = None,
                    token: str | None = None, namespace: str | None = None) -> str:
    """A kubeconfig with one cluster, one user (client certificate or bearer token) and one context."""
    creds: dict[str, str] = {}
    if cert and key:
        creds = {"client-certificate": str(cert), "client-key": str(key)}
    elif token:
        creds = {"token": token}
    else:
        raise ValueError("a kubeconfig user needs a certificate and key, or a token")
    context: dict[str, str] = {"cluster": "kuberl", "user": user}
    if namespace:
        context["namespace"] = namespace
    return yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kuberl", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "kuberl", "context": context}],
        "current-context": "kuberl",
    }, sort_keys=False)


def _component_kubeconfig(state: ClusterState, pki: Pki, who: ClientIdentity) -> Path:
    path = Path(state.dir) / "kubeconfigs" / f"{who.name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(kubeconfig_text(state.server, pki.ca_cert, who.cn, cert=pki.client_cert(who),
                                    key=pki.client_key(who)))
    return path


def etcd_args(state: ClusterState) -> list[str]:
    d = Path(state.dir)
    peer = f"http://127.0.0.1:{state.etcd_peer_port}"
    client = f"http://127.0.0.1:{state.etcd_port}"
    return [
        state.binaries["etcd"], "--name", "kuberl", "--data-dir", str(d / "etcd"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"kuberl={peer}", "--listen-metrics-urls", "",
        # A throwaway development store: fsync per write would make every API write wait on disk.
        "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30), "--log-level", "warn",
    ]  # fmt: skip


def apiserver_args(state: ClusterState, pki: Pki) -> list[str]:
    return [
        state.binaries["kube-apiserver"],
        f"--etcd-servers=http://127.0.0.1:{state.etcd_port}",
        "--bind-address=127.0.0.1", f"--secure-port={state.api_port}", "--advertise-address=127.0.0.1",
        # The `kubernetes` Service's endpoints would be the loopback address, which the API refuses.
        "--endpoint-reconciler-type=none",
        f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
        f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
        # Node,RBAC and NodeRestriction: a kubelet (cluster/node.py) reads and writes only its own
        # node and its pods; the API server reaches kubelets at their InternalIP for logs and exec.
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction", "--anonymous-auth=false",
        f"--kubelet-client-certificate={pki.client_cert(APISERVER_KUBELET_CLIENT)}",
        f"--kubelet-client-key={pki.client_key(APISERVER_KUBELET_CLIENT)}",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
        f"--cert-dir={Path(state.dir) / 'apiserver'}", "--profiling=false", "--v=1",
    ] + (_audit_args(state) if state.audit else [])  # fmt: skip


AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}


def _audit_args(state: ClusterState) -> list[str]:
    """Who sent which request: the audit policy by which an operator's API calls are counted."""
    policy = Path(state.dir) / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    return [f"--audit-policy-file={policy}", f"--audit-log-path={state.audit_log}", "--audit-log-format=json",
            "--audit-log-mode=blocking", "--audit-log-maxsize=0"]


def controller_manager_args(state: ClusterState, pki: Pki, kubeconfig: Path) -> list[str]:
    return [
        state.binaries["kube-controller-manager"],
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={state.controller_manager_port}",
        f"--cert-dir={Path(state.dir) / 'controller-manager'}",
        "--controllers=*", "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--leader-elect=false", "--profiling=false", "--v=1",
        # Kubernetes' own development provisioner: a claim on the default StorageClass gets a
        # hostPath volume under /tmp/hostpath_pv, so pods with claims are scheduled as on a cloud.
        "--enable-hostpath-provisioner=true",
    ]  # fmt: skip


STORAGE_CLASS = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "standard", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
    "provisioner": "kubernetes.io/host-path",
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}


def storage_class(real_node: bool) -> dict:
    """The default StorageClass. With the real node, whose local volumes are in this class too
    (node_config.node_volumes), a claim binds once its pod is scheduled: a pod on the real node
    takes a local volume there, a pod on a simulated GPU node a hostPath one (bound at once, the
    claim could take a local volume its GPU pod can never reach)."""
    return {**STORAGE_CLASS, "volumeBindingMode": "WaitForFirstConsumer" if real_node else "Immediate"}


def scheduler_args(state: ClusterState, kubeconfig: Path) -> list[str]:
    return [
        state.binaries["kube-scheduler"],
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={state.scheduler_port}",
        f"--cert-dir={Path(state.dir) / 'scheduler'}", "--leader-elect=false", "--profiling=false", "--v=1",
    ]  # fmt: skip


def check_pod_cidr(cidr: str) -> None:
    """Refuse a pod range the API server would refuse pod endpoints from (EndpointSlice
    addresses may not be loopback, link-local, multicast or unspecified) or that overlaps the
    Service range."""
    try:
        net = ipaddress.ip_network(cidr)
    except ValueError as err:
        raise ClusterError(f"pod CIDR {cidr!r} is not a network: {err}") from None
    if net.version != 4 or net.is_loopback or net.is_link_local or net.is_multicast or net.is_unspecified:
        raise ClusterError(f"pod CIDR {cidr} must be an IPv4 range outside loopback, link-local and multicast: "
                           "EndpointSlices refuse such pod addresses (e.g. 198.18.0.0/16)")
    if net.overlaps(ipaddress.ip_network(SERVICE_CIDR)):
        raise ClusterError(f"pod CIDR {cidr} overlaps the Service range {SERVICE_CIDR}")


def kwok_args(state: ClusterState, kubeconfig: Path, config: Path) -> list[str]:
    return [
        state.binaries["kwok"], f"--kubeconfig={kubeconfig}", f"--config={config}",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
        f"--cidr={state.pod_cidr}", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
    ]  # fmt: skip


def _alive(pid: int, binary: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return cmdline == binary


# The processes this one started: until exec, a child's /proc/PID/cmdline is still this
# interpreter's, so a fresh child's liveness is its Popen's, not its command line's.
_STARTED: dict[int, subprocess.Popen] = {}


def _running(pid: int, binary: str) -> bool:
    proc = _STARTED.get(pid)
    return proc.poll() is None if proc is not None else _alive(pid, binary)


def _start(state: ClusterState, name: str, args: list[str]) -> None:
    logs = Path(state.dir) / "logs"
    logs.mkdir(exist_ok=True)
    with (logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, cwd=state.dir)
    _STARTED[proc.pid] = proc
    state.pids[name] = proc.pid
    state.save()


def _wait(state: ClusterState, name: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = _STARTED.get(state.pids.get(name, -1))
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{name} exited while starting: see {Path(state.dir) / 'logs' / (name + '.log')}\n"
                               + _log_tail(state, name))
        with contextlib.suppress(OSError, ValueError, urllib.error.URLError, ssl.SSLError):
            if ready():
                return
        time.sleep(0.2)
    raise ClusterError(f"{name} was not ready after {timeout:.0f} s: see "
                       f"{Path(state.dir) / 'logs' / (name + '.log')}\n" + _log_tail(state, name))


def _log_tail(state: ClusterState, name: str, lines: int = 12) -> str:
    path = Path(state.dir) / "logs" / f"{name}.log"
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _https_ok(url: str, pki: Pki | None, who: ClientIdentity | None = None) -> bool:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert)) if pki and who else ssl._create_unverified_context()
    if pki and who:
        ctx.load_cert_chain(str(pki.client_cert(who)), str(pki.client_key(who)))
    with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
        return resp.status == 200 and resp.read().strip() == b"ok"


def _http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def kubectl(state: ClusterState, *args: str, input: str | None = None, check: bool = True) -> str:
    """Run the cluster's own kubectl as the admin; ClusterError with its message on failure."""
    proc = subprocess.run([state.binaries["kubectl"], f"--kubeconfig={state.kubeconfig}", *args],
                          input=input, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def running(folder: Path) -> ClusterState | None:
    """The cluster in ``folder`` if all its programs are running."""
    state = ClusterState.load(folder)
    if state is None or set(state.pids) != set(PROGRAMS):
        return None
    if all(_running(pid, state.binaries[name]) for name, pid in state.pids.items()):
        return state
    return None


def up(folder: Path, *, pools: list[NodePool] | None = None, timeout: float = 120.0,
       binaries: dict[str, Path] | None = None, audit: bool = False, pod_cidr: str = POD_CIDR,
       real_node: bool = False) -> ClusterState:
    """Start a control plane in ``folder`` (building the programs first if the cache lacks them)
    and wait until its nodes are Ready; a cluster already running there is returned as it is.
    ``audit``: the API server logs every request it answers (``ClusterState.audit_log``).
    ``pod_cidr``: where kwok takes the simulated pods' IPs from. Routed to this host (``ip route
    add local CIDR dev lo``, in a network namespace of one's own), a pod's IP reaches a local
    process that serves in the pod's place. ``real_node``: also one real node (cluster/node.py)
    whose kubelet runs pods in containers."""
    check_pod_cidr(pod_cidr)
    if real_node:
        real_node_mod.check_prerequisites()
        real_node_mod.check_free(folder)
    folder = folder.absolute()
    if (state := running(folder)) is not None:
        return state
    previous = ClusterState.load(folder)
    if previous is not None:
        down(folder)  # a half-dead cluster from an earlier run: its survivors go first
    folder.mkdir(parents=True, exist_ok=True)
    paths = binaries or ensure_binaries()
    pki = make_pki(folder / "pki")
    # A restart keeps its ports: etcd's data records its peer address, and kubeconfigs handed out
    # (the admin's, the operator's) name the API server's.
    ports = _ports(previous)
    state = ClusterState(dir=str(folder), **ports, binaries={k: str(v) for k, v in paths.items()}, audit=audit,
                         pod_cidr=pod_cidr)
    state.save()
    try:
        _start_all(state, pki, pools if pools is not None else default_pools(), timeout, real_node=real_node)
        if real_node:
            real_node_mod.up(folder, pki, lambda who: _component_kubeconfig(state, pki, who),
                    lambda *args, check=True, input=None: kubectl(state, *args, check=check, input=input),
                    api_port=state.api_port, pod_cidr=pod_cidr, service_cidr=SERVICE_CIDR,
                    storage_class=STORAGE_CLASS["metadata"]["name"], timeout=timeout)
    except BaseException:
        down(folder)
        raise
    return state


PORT_FIELDS = ("api_port", "etcd_port", "etcd_peer_port", "controller_manager_port", "scheduler_port")


def _ports(previous: ClusterState | None) -> dict[str, int]:
    if previous is None:
        return {f: host_port() for f in PORT_FIELDS}
    ports = {f: getattr(previous, f) for f in PORT_FIELDS}
    for name, port in ports.items():
        with socket.socket() as s:
            # as the servers bind: a connection of the last run in TIME_WAIT does not block it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as err:
                raise ClusterError(f"port {port} ({name}) of the cluster in {previous.dir} is taken now ({err}): "
                                   "stop what holds it, or use a new --dir") from err
    return ports


def _start_all(state: ClusterState, pki: Pki, pools: list[NodePool], timeout: float, *,
               real_node: bool = False) -> None:
    _start(state, "etcd", etcd_args(state))
    _wait(state, "etcd", lambda: _http_json(f"http://127.0.0.1:{state.etcd_port}/health").get("health") == "true",
          timeout)
    _start(state, "kube-apiserver", apiserver_args(state, pki))
    state.kubeconfig.write_text(kubeconfig_text(state.server, pki.ca_cert, ADMIN.cn,
                                                cert=pki.client_cert(ADMIN), key=pki.client_key(ADMIN)))
    _wait(state, "kube-apiserver", lambda: _https_ok(f"{state.server}/readyz", pki, ADMIN), timeout)
    kcm = _component_kubeconfig(state, pki, CONTROLLER_MANAGER)
    _start(state, "kube-controller-manager", controller_manager_args(state, pki, kcm))
    _start(state, "kube-scheduler", scheduler_args(state, _component_kubeconfig(state, pki, SCHEDULER)))
    kwok_config = Path(state.dir) / "kwok.yaml"
    kwok_config.write_text(nodes.kwok_config(kwok_stages(Path(state.binaries["kwok"]).parent)))
    _start(state, "kwok", kwok_args(state, _component_kubeconfig(state, pki, KWOK), kwok_config))
    _wait(state, "kube-controller-manager",
          lambda: _https_ok(f"https://127.0.0.1:{state.controller_manager_port}/healthz", None), timeout)
    _wait(state, "kube-scheduler",
          lambda: _https_ok(f"https://127.0.0.1:{state.scheduler_port}/healthz", None), timeout)
    kubectl(state, "apply", "-f", "-", input=json.dumps(storage_class(real_node)))
    add_nodes(state, pools)
    _wait(state, "kwok", lambda: _nodes_ready(state), timeout)
    # Pods of a namespace are admitted once its `default` ServiceAccount exists (the controller
    # manager makes it): wait for it so that the first apply does not race it.
    _wait(state, "kube-controller-manager",
          lambda: bool(kubectl(state, "get", "serviceaccount", "default", "-n", "default",
                               "-o", "name", check=False).strip()), timeout)
    kueue.start(state, pki, timeout, launch=_start, wait=_wait, kubectl=kubectl)


def add_nodes(state: ClusterState, pools: list[NodePool]) -> None:
    """Create the pools' nodes; their capacity is written through the status subresource (a
    Node's status on create is the kubelet's to fill, so the API server drops it)."""
    manifests = node_manifests(pools)
    if not manifests:
        return
    kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(
        [{k: v for k, v in n.items() if k != "status"} for n in manifests]))
    for n in manifests:
        kubectl(state, "patch", "node", n["metadata"]["name"], "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": n["status"]}))


def _nodes_ready(state: ClusterState) -> bool:
    out = json.loads(kubectl(state, "get", "nodes", "-o", "json", check=False) or "{}")
    if not out.get("items"):
        return False
    for node in out["items"]:
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        if conds.get("Ready") != "True":
            return False
    return True


def down(folder: Path, *, grace: float = 10.0) -> list[str]:
    """Stop the cluster in ``folder`` (SIGTERM, then SIGKILL after ``grace`` seconds); the names of
    the programs that were running. Its folder stays (logs, certificates)."""
    state = ClusterState.load(folder.absolute())
    if state is None:
        return []
    stopped = ["real node: " + ", ".join(undone)] if (undone := real_node_mod.down(folder, grace=grace)) else []
    for name in reversed(PROGRAMS):
        pid = state.pids.get(name)
        if pid is None or not _running(pid, state.binaries[name]):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _running(pid, state.binaries[name]) and time.monotonic() < deadline:
            time.sleep(0.05)  # a child of this process is reaped by its Popen's poll in _running
        if _running(pid, state.binaries[name]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if (proc := _STARTED.pop(pid, None)) is not None:
            proc.wait()
        stopped.append(name)
    state.pids = {}
    state.save()
    return stopped
