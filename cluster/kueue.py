"""Kueue on the local control plane: its manager as one more program, its CRDs, and its
webhooks reachable by kube-apiserver.

Everything runs on the host, so the webhook configurations point kube-apiserver at
``https://127.0.0.1:<port>/<path>`` (a ``url`` client config instead of the in-cluster Service)
and Kueue serves them with the API server's own serving certificate (its names include
127.0.0.1; the cluster CA is the ``caBundle``). Kueue's internal certificate management is off:
there is no Service or Secret to rotate. Only the webhooks of Kueue's own API group are
registered: the built-in job integrations' (pods, Deployments, batch Jobs, ...) would put
Kueue in the path of every such object the cluster makes.

The configuration enables AgenticRLJob as an external framework (kuberl's operator is its job
integration: it owns a Workload per queued job; see docs/cluster.md) on top of Kueue's default
``batch/job``, which holds a queued job's child Jobs while its Workload is not admitted.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kuberl.cluster.errors import ClusterError
from kuberl.util.ports import free_port

if TYPE_CHECKING:
    from kuberl.cluster.control_plane import ClusterState
    from kuberl.cluster.pki import Pki

NAMESPACE = "kueue-system"
GROUP = "kueue.x-k8s.io"
EXTERNAL_FRAMEWORKS = ("AgenticRLJob.v1alpha1.kuberl.io",)
CRD_DIR = "crds"  # beside the kueue binary (cluster/build.py copies them out of the module)
WEBHOOK_MANIFESTS = "webhook-manifests.yaml"
# The on-demand visibility API needs an APIService in front of it; off, nothing listens on 8082.
FEATURE_GATES = "VisibilityOnDemand=false"
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
"""Where Kueue's manager (v0.17, cmd/kueue/main.go) reads its metrics server's certificate
whenever its internal certificate management is off, a fixed path, even with metrics off
(``bindAddress: "0"``, as here). Any valid pair does: the server it is for never starts."""


def config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's manager configuration (config.kueue.x-k8s.io/v1beta2) for one local cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
    }


def own_webhooks(manifests: list[dict[str, Any]], port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations reduced to the webhooks of its own API group, each sent to
    ``https://127.0.0.1:<port><path>`` and trusting ``ca_pem``."""
    out = []
    ca = base64.b64encode(ca_pem).decode()
    for doc in manifests:
        hooks = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if groups != {GROUP}:
                continue
            path = ((hook.get("clientConfig") or {}).get("service") or {}).get("path")
            if not path:
                raise ClusterError(f"Kueue's webhook {hook.get('name')} names no service path to serve it at")
            hooks.append({**hook, "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca},
                          "timeoutSeconds": 10})
        if hooks:
            out.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"],
                        "metadata": {"name": f"kueue-{doc['metadata']['name']}"}, "webhooks": hooks})
    if not out:
        raise ClusterError("Kueue's webhook manifests hold no webhook of kueue.x-k8s.io: is the build complete?")
    return out


def args(binary: str, config_path: Path) -> list[str]:
    return [binary, f"--config={config_path}", f"--feature-gates={FEATURE_GATES}", "--zap-log-level=1"]


def prepare(state: ClusterState, pki: Pki) -> tuple[list[str], int]:
    """Write Kueue's config and certificates into the cluster folder; (its command line, its
    health port)."""
    home = Path(state.dir) / "kueue"
    certs = home / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pki.serving_cert, certs / "tls.crt")
    shutil.copyfile(pki.serving_key, certs / "tls.key")
    (certs / "tls.key").chmod(0o600)
    _metrics_certs(certs)
    webhook_port, health_port = free_port(), free_port()
    (home / "config.yaml").write_text(yaml.safe_dump(config(webhook_port, health_port, certs)))
    (home / "webhook-port").write_text(str(webhook_port))
    command = [*args(state.binaries["kueue"], home / "config.yaml"), f"--kubeconfig={state.kubeconfig}"]
    return command, health_port


def _metrics_certs(certs: Path) -> None:
    if all((METRICS_CERT_DIR / f).is_file() for f in ("tls.crt", "tls.key")):
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for f in ("tls.crt", "tls.key"):
            shutil.copyfile(certs / f, METRICS_CERT_DIR / f)
        (METRICS_CERT_DIR / "tls.key").chmod(0o600)
    except OSError as err:
        raise ClusterError(f"Kueue's manager reads a certificate from {METRICS_CERT_DIR}, which cannot be written "
                           f"({err}): run `kuberl cluster up` as root once, or put a tls.crt and tls.key there") from None


def install(state: ClusterState, pki: Pki, kubectl: Callable[..., str]) -> None:
    """Kueue's namespace, CRDs and webhook configurations in one server-side apply (each kubectl
    run costs seconds on a loaded machine), then the CRDs established."""
    bin_dir = Path(state.binaries["kueue"]).parent
    crds = [yaml.safe_load(p.read_text()) for p in sorted((bin_dir / CRD_DIR).glob("*.yaml"))]
    if not crds:
        raise ClusterError(f"no Kueue CRDs in {bin_dir / CRD_DIR}: remove {bin_dir} to rebuild Kueue")
    port = int((Path(state.dir) / "kueue" / "webhook-port").read_text())
    manifests = [d for d in yaml.safe_load_all((bin_dir / WEBHOOK_MANIFESTS).read_text()) if d]
    hooks = own_webhooks(manifests, port, pki.ca_cert.read_bytes())
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    items = json.dumps({"apiVersion": "v1", "kind": "List", "items": [namespace, *crds, *hooks]})
    kubectl(state, "apply", "--server-side", "--force-conflicts", "--field-manager=kuberl-cluster", "-f", "-",
            input=items)
    kubectl(state, "wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{c['metadata']['name']}" for c in crds))


def _ready(health_port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=5) as resp:
        return resp.status == 200


def start(state: ClusterState, pki: Pki, timeout: float, *, launch: Callable[[ClusterState, str, list[str]], None],
          wait: Callable[..., None], kubectl: Callable[..., str]) -> None:
    """Start Kueue's manager (``launch`` and ``wait`` are the control plane's own) once its
    CRDs and webhooks are in, and wait until it serves them."""
    command, health_port = prepare(state, pki)
    install(state, pki, kubectl)
    launch(state, "kueue", command)
    wait(state, "kueue", lambda: _ready(health_port), timeout)
