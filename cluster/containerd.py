"""The real node's containerd: its own state and socket under the cluster folder (never the
host's containerd service), runc through the v2 shim, overlayfs, and CNI plugins from the host.

Its root (image content, unpacked layers, metadata) outlives the cluster: :func:`image_root`,
~/.cache/kuberl/node/containerd, as /var/lib/containerd outlives a node's reboots while
/run/containerd (the state) does not. Loading kuberl's 6 GB trainer image costs minutes and
~12 GB of disk; kept there, the next ``cluster up`` has it (``image_build.load_into`` imports
only an image id the root lacks or has not unpacked, the image it replaces kept referenced until
the new one is unpacked, so the layers both share stay). ``forget_containers`` leaves only
images in it at ``down``.

The machine this was made on has cgroup v1 without systemd (cgroupfs), and its root lacks
CAP_SYS_RESOURCE, so runc may not raise a pause container's ``oom_score_adj``:
``restrict_oom_score_adj`` keeps it at the kubelet's value or above.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from kuberl.cluster.errors import ClusterError
from kuberl.cluster.pause_image import PAUSE_TAG

NAMESPACE = "k8s.io"  # the CRI plugin's
# Plugins the node never uses; the snapshotters among them probe the host's filesystems at start.
DISABLED = ("io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
            "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
            "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing")


def image_root() -> Path:
    """Where every real node's containerd keeps its images (one real node runs on a host at a time)."""
    return Path(os.environ.get("KUBERL_NODE_IMAGES") or Path.home() / ".cache" / "kuberl" / "node" / "containerd")


def paths(node_dir: Path) -> dict[str, Path]:
    base = node_dir / "containerd"
    return {"root": image_root(), "state": base / "state", "socket": base / "containerd.sock",
            "config": base / "config.toml", "runc_root": base / "runc", "opt": base / "opt"}


def config_toml(node_dir: Path, cni_bin: str, cni_conf: Path) -> str:
    """containerd 1.6's configuration (version 2) for the node in ``node_dir``."""
    p = paths(node_dir)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    disabled = ", ".join(f'"{d}"' for d in DISABLED)
    return f"""version = 2
root = "{p['root']}"
state = "{p['state']}"
disabled_plugins = [{disabled}]

[grpc]
  address = "{p['socket']}"

[ttrpc]
  address = "{p['socket']}.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{p['opt']}"

[{cri}]
  sandbox_image = "{PAUSE_TAG}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  disable_apparmor = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{p['runc_root']}"

[{cri}.cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{cni_conf}"
  max_conf_num = 1
"""


def ctr(node_dir: Path, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["ctr", "--address", str(paths(node_dir)["socket"]), "-n", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ClusterError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def import_archive(node_dir: Path, archive: Path) -> None:
    """Load an OCI or Docker image archive into the node's image store (pods name its tag with
    ``imagePullPolicy: Never`` or ``IfNotPresent``)."""
    ctr(node_dir, "images", "import", str(archive))


def forget_containers(node_dir: Path) -> int:
    """Delete every container (pods' and their sandboxes', their processes killed) with its writable layer, so
    that the root, which the next node reuses, holds images only; the number deleted. Best
    effort: what is left is what a node finds after a crash, and its kubelet removes it."""
    try:
        ids = ctr(node_dir, "containers", "list", "-q", timeout=30).split()
    except (ClusterError, subprocess.TimeoutExpired):
        return 0
    deleted = 0
    for cid in ids:
        with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):  # its processes are killed: a record
            ctr(node_dir, "tasks", "delete", "--force", cid, timeout=30)
        with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
            ctr(node_dir, "containers", "delete", cid, timeout=30)
            deleted += 1
    return deleted


def images(node_dir: Path) -> list[str]:
    return ctr(node_dir, "images", "list", "-q").split()


def shim_pids(node_dir: Path) -> list[int]:
    """The shims this containerd started: they outlive it (each in a session of its own), and
    name its socket on their command line."""
    socket = str(paths(node_dir)["socket"]).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline.split(b"\0")[0] and socket in cmdline:
            found.append(int(entry))
    return found


def kill_shims(node_dir: Path) -> int:
    pids = shim_pids(node_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return len(pids)
