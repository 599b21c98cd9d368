"""The real node's configuration files, as pure builders: the CNI network, the kubelet's and
kube-proxy's configuration, and what the host needs for them (:func:`missing_prerequisites`).

Pods of the real node take their IPs from :data:`NODE_CIDR` on the bridge :data:`BRIDGE`, apart
from kwok's simulated pod range; the bridge's gateway address is the node's InternalIP, where the
kubelet serves the API server (logs, exec) and where pods reach the host.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any

from kuberl.cluster.errors import ClusterError
from kuberl.cluster.pki import NODE_NAME
from kuberl.util.ports import free_port

NODE_CIDR = "10.250.0.0/24"
NODE_IP = "10.250.0.1"
BRIDGE = "kuberl0"
CGROUP_ROOT = "kuberl-node"
NETWORK = "kuberl"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# The labels of the CPU nodes the operator's CPU pods (sandbox pools, cpu trainers) land on
# (cluster/nodes.py's "cpu" pool), and one saying this node is real.
NODE_LABELS = {"kuberl.io/node-kind": "cpu", "kuberl.io/real-node": "true"}
# command -> the Debian package that has it
COMMANDS = {"containerd": "containerd", "containerd-shim-runc-v2": "containerd", "ctr": "containerd",
            "runc": "runc", "iptables": "iptables", "iptables-save": "iptables", "ip6tables": "iptables",
            "conntrack": "conntrack", "ipset": "ipset", "ip": "iproute2", "umount": "mount", "gcc": "gcc"}


NODE_PORT_RANGE = range(30000, 32768)  # the API server's default --service-node-port-range


def host_port() -> int:
    """A free port outside the NodePort range: kube-router lets every pod reach the node's
    NodePorts whatever its policy, so a port of the cluster's own (the API server's, which pods
    reach through the `kubernetes` Service's redirect; the kubelet's) must not fall in it."""
    while (port := free_port()) in NODE_PORT_RANGE:
        pass
    return port


def cni_bin_dir() -> str | None:
    for d in CNI_BIN_DIRS:
        if all((Path(d) / p).is_file() for p in CNI_PLUGINS):
            return d
    return None


def missing_prerequisites() -> list[str]:
    """What the host lacks for a real node, one item each: Debian packages (apt-get install
    names), root, the bridge netfilter module."""
    packages = sorted({pkg for cmd, pkg in COMMANDS.items() if shutil.which(cmd) is None})
    if cni_bin_dir() is None:
        packages.append("containernetworking-plugins")
    missing = [f"apt-get install {' '.join(sorted(packages))}"] if packages else []
    if os.geteuid() != 0:
        missing.append("root (the kubelet, containerd and the CNI plugins change the host's network and mounts)")
    if not Path("/proc/sys/net/bridge").is_dir():
        missing.append("the br_netfilter kernel module (modprobe br_netfilter)")
    return missing


def check_cidrs(simulated_pod_cidr: str, service_cidr: str) -> None:
    node = ipaddress.ip_network(NODE_CIDR)
    for name, cidr in (("the simulated pods' range", simulated_pod_cidr), ("the Service range", service_cidr)):
        if node.overlaps(ipaddress.ip_network(cidr)):
            raise ClusterError(f"the real node's pod range {NODE_CIDR} overlaps {name} {cidr}: pick another --pod-cidr")


def cni_conflist(ipam_dir: Path) -> dict[str, Any]:
    """bridge (gateway, masquerade, hairpin for a pod calling its own Service) with host-local
    addresses, then portmap for hostPorts; containerd adds loopback itself."""
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                      "ranges": [[{"subnet": NODE_CIDR, "gateway": NODE_IP}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }  # fmt: skip


def kubelet_config(node_dir: Path, *, ca: Path, socket: Path, port: int, healthz_port: int,
                   cluster_dns: str) -> dict[str, Any]:
    """cgroup v1 without systemd (cgroupfs, ``failCgroupV1: false``); pods' cgroups under
    /CGROUP_ROOT; x509 clients of the cluster CA and service-account tokens authenticated,
    authorized by the API server; disk-pressure eviction thresholds low (a build machine's disk is
    often fuller than a node's)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{CGROUP_ROOT}", "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"], "failCgroupV1": False, "failSwapOn": False,
        "protectKernelDefaults": False,
        "podLogsDir": str(node_dir / "pod-logs"), "volumePluginDir": str(node_dir / "volume-plugins"),
        "clusterDomain": "cluster.local", "clusterDNS": [cluster_dns], "resolvConf": "/etc/resolv.conf",
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "maxPods": 110,
        "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s",
    }  # fmt: skip


def kubelet_args(binary: str, node_dir: Path, config: Path, kubeconfig: Path) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
    return [binary, f"--config={config}", f"--kubeconfig={kubeconfig}", f"--root-dir={node_dir / 'kubelet'}",
            f"--cert-dir={node_dir / 'kubelet' / 'pki'}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", f"--node-labels={labels}", "--v=1"]


def kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict[str, Any]:
    """iptables mode; conntrack sysctls and localhost NodePorts (route_localnet) left alone."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables", "clusterCIDR": NODE_CIDR, "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}", "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "1s"},
        "nodePortAddresses": [f"{NODE_IP}/32"],
    }  # fmt: skip


NODE_VOLUMES = 4
NODE_VOLUME_CAPACITY = "1Ti"


def node_volumes(volumes_dir: Path, storage_class: str, count: int = NODE_VOLUMES) -> list[dict[str, Any]]:
    """Local PersistentVolumes on the real node, folders ``volumes_dir/vol-N``, in the default
    StorageClass (which binds when the pod is scheduled): a claim of a pod on the real node binds
    to one of them, not to a folder the controller manager's hostPath provisioner makes under
    /tmp/hostpath_pv (root's, mode 0750, which the kubelet leaves alone); the kubelet gives a
    local volume to the pod's ``fsGroup`` as CSI drivers do, so a non-root pod (the trainer's
    checkpoints) writes to its claim. Pods on simulated nodes still get hostPath volumes.
    Retained after their claim goes; the folders go with the cluster's."""
    return [
        {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"{NODE_NAME}-vol-{i}", "labels": dict(NODE_LABELS)},
            "spec": {
                "capacity": {"storage": NODE_VOLUME_CAPACITY},
                "accessModes": ["ReadWriteOnce", "ReadWriteMany"], "volumeMode": "Filesystem",
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": storage_class,
                "local": {"path": str(volumes_dir / f"vol-{i}")},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}]}]}},
            },
        }
        for i in range(count)
    ]  # fmt: skip
