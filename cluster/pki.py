"""The control plane's certificates and service-account key, made with the ``openssl`` command.

One CA signs the API server's serving certificate and a client certificate per component. The
API server authenticates a client certificate as user CN in groups O, so the admin is in
``system:masters`` and the controller manager and scheduler are the users the built-in RBAC
bindings name (``system:kube-controller-manager``, ``system:kube-scheduler``). Service-account
tokens are signed with an RSA key the controller manager also gets.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kuberl.cluster.errors import ClusterError

DAYS = 3650


@dataclass(frozen=True)
class ClientIdentity:
    """Who a client certificate says its holder is: user ``cn`` in the ``groups``."""

    name: str
    cn: str
    groups: tuple[str, ...] = ()

    def subject(self) -> str:
        return "".join(f"/O={g}" for g in self.groups) + f"/CN={self.cn}"


ADMIN = ClientIdentity("admin", "kuberl-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
# kwok plays every kubelet: it writes node and pod status, which only a node's own identity or an
# admin may; it runs as a member of system:masters like kubeadm's own tooling.
KWOK = ClientIdentity("kwok", "kwok-controller", ("system:masters",))
# The real node (cluster/node.py): its kubelet as the Node authorizer's node user, kube-proxy as
# the user the built-in system:node-proxier binding names, and the API server's own client
# certificate for the kubelets (logs, exec, port-forward).
NODE_NAME = "kuberl-node"
KUBELET = ClientIdentity("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",))
KUBE_PROXY = ClientIdentity("kube-proxy", "system:kube-proxy")
APISERVER_KUBELET_CLIENT = ClientIdentity("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                          ("system:masters",))
# the node's NetworkPolicy controller (cluster/netpol.py), bound to a read-mostly ClusterRole
NETWORK_POLICY = ClientIdentity("network-policy", "kuberl:network-policy")
# the node's cluster DNS (cluster/dns.py)
DNS = ClientIdentity("dns", "kuberl:dns")
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, KWOK, KUBELET, KUBE_PROXY, APISERVER_KUBELET_CLIENT,
           NETWORK_POLICY, DNS)

SERVING_NAMES = (
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:127.0.0.1",
    # the `kubernetes` Service's ClusterIP (first address of the Service range): how pods on the
    # real node reach the API server (cluster/node.py redirects it to 127.0.0.1)
    "IP:10.96.0.1",
)


@dataclass(frozen=True)
class Pki:
    """Paths of everything :func:`make_pki` writes into one folder."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.root / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.root / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    def client_cert(self, who: ClientIdentity) -> Path:
        return self.root / f"{who.name}.crt"

    def client_key(self, who: ClientIdentity) -> Path:
        return self.root / f"{who.name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")


def _signed(pki: Pki, cert: Path, key: Path, subject: str, extensions: str) -> None:
    csr = cert.with_suffix(".csr")
    ext = cert.with_suffix(".ext")
    ext.write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-subj", subject,
             "-out", str(csr), cwd=pki.root)  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
             "-CAcreateserial", "-days", str(DAYS), "-sha256", "-extfile", str(ext), "-out", str(cert),
             cwd=pki.root)  # fmt: skip
    csr.unlink()
    ext.unlink()


def make_pki(root: Path) -> Pki:
    """Write a CA, the API server's serving pair, one client pair per :data:`CLIENTS` entry and the
    service-account key pair into ``root``; what is already there is kept (a restart reuses it)."""
    if shutil.which("openssl") is None:
        raise ClusterError("the `openssl` command is needed to make the cluster's certificates: "
                           "install it (Debian: apt-get install openssl)")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    pki = Pki(root)
    if not pki.ca_cert.is_file():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki.ca_key),
                 "-subj", "/CN=kuberl-cluster-ca", "-days", str(DAYS), "-sha256",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                 "-out", str(pki.ca_cert), cwd=root)  # fmt: skip
    if not pki.serving_cert.is_file():
        _signed(pki, pki.serving_cert, pki.serving_key, "/CN=kube-apiserver",
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(SERVING_NAMES)}\n")
    for who in CLIENTS:
        if not pki.client_cert(who).is_file():
            _signed(pki, pki.client_cert(who), pki.client_key(who), who.subject(),
                    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage=clientAuth\n")
    if not pki.sa_key.is_file():
        _openssl("genrsa", "-out", str(pki.sa_key), "2048", cwd=root)
        _openssl("rsa", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), cwd=root)
    return pki
