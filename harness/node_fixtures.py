"""A real node for the tests marked ``node`` (tests/test_real_node*.py): ``kuberl cluster up``
with its real node beside one kwok GPU node, what the node may change on the host (to compare
after ``down``), and helpers for pods on it.

Without what the node needs (root, containerd, runc, the CNI plugins, iptables, ipset,
conntrack, Go) the tests skip, except where ``KUBERL_REQUIRE_NODE=1`` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from k8s_fixtures import Kube, running_ready, wait_for

from kuberl.cluster import containerd, host_state
from kuberl.cluster.control_plane import ClusterState, down, up
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.node import node_dir
from kuberl.cluster.node_config import BRIDGE, CGROUP_ROOT, missing_prerequisites
from kuberl.cluster.nodes import default_pools


def require_or_skip(reason: str) -> None:
    if os.environ.get("KUBERL_REQUIRE_NODE") == "1":
        pytest.fail(f"KUBERL_REQUIRE_NODE=1 but {reason}")
    pytest.skip(reason)


def host_view(folder: Path) -> dict:
    """What a real node may change on the host, as comparable values: its chains and rules
    (iptables, both families, counters dropped), the tables, the links it makes, mounts of its
    folders, the sysctls, its cgroup, the host folders it writes to."""
    def chains(saver: str) -> list[str]:
        text = host_state.iptables_save(saver)
        return sorted(re.sub(r" \[\d+:\d+\]$", "", line) for line in text.splitlines()
                      if line.startswith("*") or re.search(r"KUBE-|CNI-|10\.250\.|kuberl", line))

    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout)
    mine = (str(folder), "/run/containerd", "/var/lib/kubelet", "/run/netns", "/var/run/netns")
    return {
        "iptables": chains("iptables-save"),
        "ip6tables": chains("ip6tables-save"),
        "links": sorted(x["ifname"] for x in links if x["ifname"] == BRIDGE or x["ifname"].startswith("veth")),
        "mounts": sorted(line for line in Path("/proc/mounts").read_text().splitlines()
                         if any(p in line for p in mine)),
        "ipsets": host_state.ipsets(),
        "sysctls": host_state.read_sysctls(),
        "cgroups": [str(p) for p in host_state.cgroup_dirs(CGROUP_ROOT)],
        # not a folder other programs share (any containerd's /run/containerd): another one may
        # come and go during the test (down removes it only where no other containerd runs)
        "dirs": {d: host_state.dir_entries(d) for d in host_state.HOST_DIRS if d not in host_state.SHARED_DIRS},
        "shims": containerd.shim_pids(node_dir(folder)),
    }


@dataclass
class RealNode:
    state: ClusterState
    kube: Kube
    folder: Path
    before: dict
    start_s: float


def restricted_namespace(kube: Kube, name: str) -> str:
    kube.run("create", "namespace", name)
    kube.run("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    wait_for(lambda: kube.run("get", "sa", "default", "-n", name, check=False).returncode == 0, 30,
             f"the default ServiceAccount of {name}")
    return name


def start(folder: Path, archives: tuple[Path, ...] = ()) -> Iterator[RealNode]:
    """The cluster with its real node in ``folder``, the image ``archives`` loaded into the node;
    stopped after (``down`` twice is harmless: a test may have stopped it)."""
    if missing := missing_prerequisites():
        require_or_skip("the host lacks " + "; ".join(missing))
    before = host_view(folder)
    t0 = time.monotonic()
    try:
        state = up(folder, pools=default_pools(mi300x=1, h100=0, cpu=0), real_node=True)
    except ClusterError as err:
        require_or_skip(f"no real node: {err}")
    start_s = time.monotonic() - t0
    try:
        for archive in archives:
            containerd.import_archive(node_dir(folder), archive)
        yield RealNode(state, Kube(state), folder, before, start_s)
    finally:
        down(folder)


def wait_ready(kube: Kube, ns: str, name: str, timeout: float = 90) -> dict:
    def ready() -> dict | None:
        pod = kube.json("get", "pod", name, "-n", ns)
        return pod if running_ready(pod) else None

    return wait_for(ready, timeout, lambda: kube.run("describe", "pod", name, "-n", ns, check=False).stdout[-1500:])




def load_images(node: RealNode, names: list[str], repo: Path) -> list[str]:
    """kuberl's images ``names`` (cluster/images.py), built from ``repo`` or reused from the cache by
    their inputs, loaded into the node's containerd; their refs. Skips (fails under
    ``KUBERL_REQUIRE_NODE=1``) where buildah or debootstrap is missing."""
    from kuberl.cluster.image_build import build_images, require_tools

    try:
        require_tools(("buildah", "debootstrap", "runc", "ctr"))
    except ClusterError as err:
        require_or_skip(f"kuberl's images cannot be built here: {err}")
    socket = str(containerd.paths(node_dir(node.folder))["socket"])
    return [built.ref for built, _ in build_images(names, repo, address=socket)]


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def dns_a(name: str, server: str, timeout: float = 2.0) -> list[str]:
    """The A records ``server`` (a DNS server on port 53, e.g. the node's CoreDNS) answers for
    ``name`` over UDP; [] for NXDOMAIN, no answer or no reply within ``timeout``."""
    import secrets
    import socket
    import struct

    qid = secrets.randbits(16)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(query, (server, 53))
            reply = sock.recv(4096)
        except OSError:
            return []
    rid, flags, _, count = struct.unpack(">HHHH", reply[:8])
    if rid != qid or flags & 0xF:  # another query's reply, or an error code (3: NXDOMAIN)
        return []
    at, found = 12 + len(question) + 4, []
    for _ in range(count):
        while reply[at] and reply[at] & 0xC0 != 0xC0:  # the owner name: labels...
            at += reply[at] + 1
        at += 2 if reply[at] & 0xC0 == 0xC0 else 1  # ...ending in a pointer or the root
        rtype, _, _, length = struct.unpack(">HHIH", reply[at:at + 10])
        at += 10
        if rtype == 1 and length == 4:
            found.append(socket.inet_ntoa(reply[at:at + 4]))
        at += length
    return found


def programmed_endpoints(namespace: str, service: str) -> set[str]:
    """The endpoints (ip:port) kube-proxy has programmed into the host's iptables for
    ``namespace/service`` (its KUBE-SVC chain's jumps, each commented ``ns/svc -> ip:port``)."""
    text = host_state.iptables_save("iptables-save")
    pattern = re.compile(rf'^-A KUBE-SVC-\S+ -m comment --comment "{re.escape(namespace)}/{re.escape(service)}'
                         r'(?::\S*)? -> (\S+)"', re.M)
    return set(pattern.findall(text))
