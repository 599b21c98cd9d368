"""Cluster DNS for the real node: CoreDNS on the host, on the node's address port 53, answering
``cluster.local`` from the API server (Services, headless Services' pods, as kube-dns does) and
forwarding other names to the host's resolvers. The kubelet hands its address to pods as their
nameserver (``clusterDNS``), so ``POOL.NAMESPACE.svc`` (a trainer's sandbox URL) and
``TRAINER-0.TRAINER.NAMESPACE.svc`` resolve inside pods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuberl.cluster.pki import DNS

ROLE = "kuberl:dns"
DOMAIN = "cluster.local"


def corefile(node_ip: str, kubeconfig: Path, health_port: int, ready_port: int) -> str:
    return f""".:53 {{
    bind {node_ip}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} kuberl
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf
    cache 5
    loadbalance
}}
"""


def rbac() -> list[dict[str, Any]]:
    """What the kubernetes plugin watches (kube-dns' system:coredns role)."""
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": ROLE},
         "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces", "endpoints"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": ROLE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DNS.cn}]},
    ]  # fmt: skip


def coredns_args(binary: str, corefile_path: Path) -> list[str]:
    return [binary, "-conf", str(corefile_path)]
