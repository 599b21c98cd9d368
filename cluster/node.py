"""One real node beside kwok's simulated ones: containerd + runc + CNI, a kubelet and kube-proxy.

``up`` records the host (cluster/host_state.py), creates the bridge and the node's cgroup,
starts containerd on its own socket, loads the pause image, then starts the kubelet (as
``system:node:kuberl-node``), kube-proxy (iptables mode), kube-router's NetworkPolicy
controller (cluster/netpol.py) and CoreDNS (cluster/dns.py), and waits until each is ready.
``down`` stops them, kills what the runtime left (containers, shims), unmounts, deletes the
bridge and the cgroups, and undoes the host changes the record shows. Everything else lives in
``<cluster>/node/``; one real node runs on a host at a time (the bridge's alias names its cluster).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from kuberl.cluster import containerd, dns, host_state, netpol
from kuberl.cluster.build import KUBERNETES_VERSION, NODE_COMPONENTS, cache_root, ensure_binaries, find_go
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.node_config import (
    BRIDGE,
    CGROUP_ROOT,
    NODE_CIDR,
    NODE_IP,
    check_cidrs,
    cni_bin_dir,
    cni_conflist,
    host_port,
    kube_proxy_config,
    kubelet_args,
    kubelet_config,
    missing_prerequisites,
    node_volumes,
)
from kuberl.cluster.pause_image import ensure_pause_archive
from kuberl.cluster.pki import DNS, KUBE_PROXY, KUBELET, NETWORK_POLICY, NODE_NAME, ClientIdentity, Pki

STATE_FILE = "node.json"
HOST_RECORD = "host-before.json"
PROGRAMS = ("containerd", "kubelet", "kube-proxy", "kube-router", "coredns")  # start order; down stops in reverse


@dataclass
class NodeState:
    """What ``<cluster>/node/node.json`` records of a running node."""

    dir: str
    binaries: dict[str, str]
    kubelet_port: int
    kubelet_healthz_port: int
    proxy_healthz_port: int
    proxy_metrics_port: int
    netpol_health_port: int = 0
    dns_health_port: int = 0
    dns_ready_port: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    started_s: dict[str, float] = field(default_factory=dict)

    def save(self) -> None:
        (Path(self.dir) / STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, node_dir: Path) -> NodeState | None:
        path = node_dir / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.is_file() else None


def node_dir(cluster_dir: Path) -> Path:
    return Path(cluster_dir).absolute() / "node"


def check_prerequisites() -> None:
    """ClusterError in one line naming what to install, where the host lacks anything."""
    missing = missing_prerequisites()
    if missing:
        raise ClusterError("a real node needs " + "; ".join(missing) + " (or run `kuberl cluster up --no-real-node`)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def bridge_owner() -> str | None:
    """The cluster folder of the real node running on this host (the bridge's alias), or None."""
    proc = _ip("-d", "-j", "link", "show", BRIDGE, check=False)
    if proc.returncode != 0:
        return None
    links = json.loads(proc.stdout or "[]")
    return (links[0].get("ifalias") if links else None) or "an unknown cluster"


def check_free(cluster_dir: Path) -> None:
    """ClusterError where another cluster's real node runs on this host (one at a time: they
    would share the bridge, the iptables chains and the host folders)."""
    owner = bridge_owner()
    if owner is not None and owner != str(Path(cluster_dir).absolute()):
        raise ClusterError(f"a real node already runs on this host (bridge {BRIDGE}, cluster {owner}): "
                           f"`kuberl cluster down --dir {owner}` first, or --no-real-node")


def _make_bridge(cluster_dir: Path) -> None:
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "alias", str(cluster_dir))
    _ip("addr", "add", f"{NODE_IP}/{NODE_CIDR.split('/')[1]}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")


def _api_server_for_pods(service_cidr: str, api_port: int) -> None:
    """Pods call the API server as the `kubernetes` Service (its ClusterIP, port 443), as
    in-cluster clients do. It listens on 127.0.0.1 only, and the Service has no endpoints
    (kube-proxy routes nothing for it), so connections from the bridge to that address are
    redirected to the loopback port; the bridge may route to 127.0.0.1 (route_localnet, a
    setting of the bridge that goes with it), and the kubelet's KUBE-FIREWALL lets DNATed
    connections to loopback through."""
    ip = str(next(ipaddress.ip_network(service_cidr).hosts()))
    (host_state.PROC_SYS / f"net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1")
    proc = subprocess.run(["iptables", "-t", "nat", "-A", "PREROUTING", "-i", BRIDGE, "-d", f"{ip}/32", "-p", "tcp",
                           "--dport", "443", "-m", "comment", "--comment", "kuberl: the API server for pods",
                           "-j", "DNAT", "--to-destination", f"127.0.0.1:{api_port}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"iptables could not redirect the kubernetes Service to the API server: {proc.stderr.strip()}")


def _make_cgroups() -> None:
    """/CGROUP_ROOT in every v1 hierarchy (the kubelet's cgroupRoot must exist); a new cpuset
    starts with no CPUs or memory nodes, so it gets its parent's."""
    for hierarchy in sorted(host_state.CGROUP_FS.iterdir()):
        if not os.path.ismount(hierarchy) or hierarchy.name == "unified":
            continue
        mine = hierarchy / CGROUP_ROOT
        mine.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / knob).is_file():
                (mine / knob).write_text((hierarchy / knob).read_text())


def _set_sysctl(name: str, value: str) -> None:
    path = host_state.PROC_SYS / name
    if path.read_text().strip() != value:
        path.write_text(value)


_STARTED: dict[int, subprocess.Popen] = {}


def _spawn(state: NodeState, logs: Path, name: str, args: list[str]) -> None:
    logs.mkdir(exist_ok=True)
    with (logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                cwd=state.dir)
    _STARTED[proc.pid] = proc
    state.pids[name] = proc.pid
    state.save()


def _wait(state: NodeState, logs: Path, name: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = _STARTED.get(state.pids.get(name, -1))
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{name} exited while starting (log: {logs / (name + '.log')}):\n" + _tail(logs, name))
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.25)
    raise ClusterError(f"{name} was not ready after {timeout:.0f} s (log: {logs / (name + '.log')}):\n"
                       + _tail(logs, name))


def _tail(logs: Path, name: str, lines: int = 12) -> str:
    with contextlib.suppress(OSError):
        return "\n".join((logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
    return ""


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return resp.status == 200


def _healthz(port: int) -> bool:
    return _http_ok(f"http://127.0.0.1:{port}/healthz")


def ensure_node_binaries() -> dict[str, Path]:
    """kubelet and kube-proxy (built the first time, minutes) and the pause image's archive."""
    paths = ensure_binaries(components=NODE_COMPONENTS)
    gomodcache = subprocess.run([find_go(), "env", "GOMODCACHE"], capture_output=True, text=True).stdout.strip()
    paths["pause.tar"] = ensure_pause_archive(cache_root() / "pause-3.10", Path(gomodcache), KUBERNETES_VERSION)
    return paths


def up(cluster_dir: Path, pki: Pki, kubeconfig: Callable[[ClientIdentity], Path], kubectl: Callable[..., str],
       *, api_port: int, pod_cidr: str, service_cidr: str, storage_class: str = "standard",
       timeout: float = 120.0) -> NodeState:
    """Start the real node of the cluster in ``cluster_dir`` and wait until it is Ready.
    ``kubeconfig(who)`` writes a kubeconfig for a client identity of ``pki``;
    ``kubectl(*args, check=...)`` runs the cluster's kubectl as its admin; ``api_port`` is the
    API server's on 127.0.0.1, which pods reach as the ``kubernetes`` Service; ``storage_class``
    the default StorageClass, whose claims the node's local volumes take (node_config.node_volumes)."""
    check_prerequisites()
    check_cidrs(pod_cidr, service_cidr)
    cluster_dir = Path(cluster_dir).absolute()
    if bridge_owner() == str(cluster_dir):  # this cluster's node, left running by a crash
        down(cluster_dir)
    check_free(cluster_dir)
    d = node_dir(cluster_dir)
    d.mkdir(parents=True, exist_ok=True)
    binaries = ensure_node_binaries()
    t0 = time.monotonic()
    host_state.record(d / HOST_RECORD)
    state = NodeState(dir=str(d), binaries={k: str(v) for k, v in binaries.items()}, kubelet_port=host_port(),
                      kubelet_healthz_port=host_port(), proxy_healthz_port=host_port(),
                      proxy_metrics_port=host_port(), netpol_health_port=host_port(),
                      dns_health_port=host_port(), dns_ready_port=host_port())
    state.save()
    logs = cluster_dir / "logs"
    # Pods reach the host and the outside through it; Service replies on one bridge pass iptables.
    _set_sysctl("net/ipv4/ip_forward", "1")
    _set_sysctl("net/bridge/bridge-nf-call-iptables", "1")
    _make_bridge(cluster_dir)
    _api_server_for_pods(service_cidr, api_port)
    _make_cgroups()
    ipam = d / "cni" / "ipam"
    if ipam.is_dir():  # addresses of the last run's pods, whose namespaces are gone
        for lease in ipam.rglob("*"):
            if lease.is_file():
                lease.unlink()
    conf_dir = d / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-kuberl.conflist").write_text(json.dumps(cni_conflist(ipam), indent=1))
    cfg = containerd.paths(d)
    cfg["config"].parent.mkdir(parents=True, exist_ok=True)
    cfg["config"].write_text(containerd.config_toml(d, cni_bin_dir() or "", conf_dir))
    _spawn(state, logs, "containerd", ["containerd", "--config", str(cfg["config"])])
    _wait(state, logs, "containerd", lambda: bool(containerd.ctr(d, "version", timeout=5)), timeout)
    containerd.import_archive(d, binaries["pause.tar"])
    state.started_s["containerd"] = round(time.monotonic() - t0, 2)
    kubelet_yaml = d / "kubelet.yaml"
    kubelet_yaml.write_text(yaml.safe_dump(kubelet_config(
        d, ca=pki.ca_cert, socket=cfg["socket"], port=state.kubelet_port, healthz_port=state.kubelet_healthz_port,
        cluster_dns=NODE_IP)))
    _spawn(state, logs, "kubelet", kubelet_args(state.binaries["kubelet"], d, kubelet_yaml,
                                                 kubeconfig(KUBELET)))
    proxy_yaml = d / "kube-proxy.yaml"
    proxy_yaml.write_text(yaml.safe_dump(kube_proxy_config(kubeconfig(KUBE_PROXY),
                                                           state.proxy_healthz_port, state.proxy_metrics_port)))
    _spawn(state, logs, "kube-proxy", [state.binaries["kube-proxy"], f"--config={proxy_yaml}", "--v=1"])
    _wait(state, logs, "kubelet", lambda: _healthz(state.kubelet_healthz_port) and _node_ready(kubectl), timeout)
    _wait(state, logs, "kube-proxy", lambda: _healthz(state.proxy_healthz_port), timeout)
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": netpol.rbac()}))
    _spawn(state, logs, "kube-router", netpol.kube_router_args(state.binaries["kube-router"],
                                                                kubeconfig(NETWORK_POLICY), service_cidr,
                                                                state.netpol_health_port))
    _wait(state, logs, "kube-router", lambda: _healthz(state.netpol_health_port), timeout)
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": dns.rbac()}))
    corefile = d / "Corefile"
    corefile.write_text(dns.corefile(NODE_IP, kubeconfig(DNS), state.dns_health_port, state.dns_ready_port))
    _spawn(state, logs, "coredns", dns.coredns_args(state.binaries["coredns"], corefile))
    _wait(state, logs, "coredns", lambda: _http_ok(f"http://127.0.0.1:{state.dns_ready_port}/ready"), timeout)
    volumes = node_volumes(d / "volumes", storage_class)
    for pv in volumes:
        Path(pv["spec"]["local"]["path"]).mkdir(parents=True, exist_ok=True)
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": volumes}))
    state.started_s["ready"] = round(time.monotonic() - t0, 2)
    state.save()
    return state


def _node_ready(kubectl: Callable[..., str]) -> bool:
    out = kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
    conds = {c["type"]: c["status"] for c in json.loads(out or "{}").get("status", {}).get("conditions", [])}
    return conds.get("Ready") == "True"


def _alive(pid: int, binary: str) -> bool:
    proc = _STARTED.get(pid)
    if proc is not None:
        return proc.poll() is None
    try:
        exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return Path(exe).name == Path(binary).name


def _stop(pid: int, binary: str, grace: float) -> bool:
    if not _alive(pid, binary):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid, binary) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid, binary):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if (proc := _STARTED.pop(pid, None)) is not None:
        proc.wait()
    return True


def down(cluster_dir: Path, *, grace: float = 10.0) -> list[str]:
    """Stop the real node of the cluster in ``cluster_dir`` and undo its host changes; a line per
    thing stopped or undone (empty where no node ran)."""
    d = node_dir(cluster_dir)
    state = NodeState.load(d)
    record = d / HOST_RECORD
    if state is None and not record.is_file():
        return []
    done = []
    binaries = {"containerd": "containerd", **(state.binaries if state else {})}
    pids = state.pids if state else {}
    for name in ("coredns", "kube-router", "kube-proxy", "kubelet"):
        if name in pids and _stop(pids[name], binaries[name], grace):
            done.append(name)
    if n := host_state.kill_cgroup(CGROUP_ROOT):
        done.append(f"{n} container processes")
    if "containerd" in pids and _alive(pids["containerd"], "containerd") and (n := containerd.forget_containers(d)):
        done.append(f"{n} containers deleted from {containerd.image_root()}")
    if n := containerd.kill_shims(d):
        done.append(f"{n} containerd shims")
    if "containerd" in pids and _stop(pids["containerd"], "containerd", grace):
        done.append("containerd")
    if points := host_state.unmount_under([str(d), str(containerd.image_root())]):
        done.append(f"{len(points)} mounts under {d}")
    for link in json.loads(_ip("-j", "link", "show", "master", BRIDGE, check=False).stdout or "[]"):
        _ip("link", "del", link["ifname"], check=False)
    if bridge_owner() is not None:
        _ip("link", "del", BRIDGE, check=False)
        done.append(f"bridge {BRIDGE}")
    if left := host_state.remove_cgroup(CGROUP_ROOT):
        done.append(f"cgroups left: {left}")
    if record.is_file():
        done += host_state.restore(json.loads(record.read_text()))
        record.unlink()
    if state is not None:
        state.pids = {}
        state.save()
    return done
