"""NetworkPolicy on the real node: kube-router's policy controller alone (its BGP router, service
proxy and CNI off), which turns each policy into iptables chains (``KUBE-ROUTER-*``,
``KUBE-POD-FW-*``, ``KUBE-NWPLCY-*``) and ipsets of the pods' addresses.

Why kube-router: sigs.k8s.io/kube-network-policies needs the nftables ``queue`` statement, which
this kernel lacks (CONFIG_NFT_QUEUE unset); Calico is a whole network. kube-router needs
iptables, ipset and the kernel's xt_set, conntrack and NFLOG matches, all present. Traffic
from the node itself (the kubelet's probes, a call from the host) stays allowed, as kube-router
always allows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuberl.cluster.pki import NETWORK_POLICY, NODE_NAME

ROLE = "kuberl:network-policy"


def rbac() -> list[dict[str, Any]]:
    """What the controller reads (pods, namespaces, policies, its node) and writes (events)."""
    read = ["get", "list", "watch"]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": ROLE},
         "rules": [{"apiGroups": [""], "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
                    "verbs": read},
                   {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": read},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
                   {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": ROLE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": NETWORK_POLICY.cn}]},
    ]  # fmt: skip


def kube_router_args(binary: str, kubeconfig: Path, service_cidr: str, health_port: int) -> list[str]:
    return [
        binary, f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
        "--enable-ipv4=true", "--enable-ipv6=false", f"--service-cluster-ip-range={service_cidr}",
        f"--health-port={health_port}", "--metrics-port=0", "--iptables-sync-period=1m", "--v=1",
    ]  # fmt: skip
