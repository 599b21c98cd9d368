"""A containerd of one's own (root, state, sockets under a temporary folder; its CRI plugin off)
and a pod's container, as the operator renders it, run there with ``ctr run`` the way a kubelet
would run it: its user, every capability dropped, no_new_privs, a read-only root, tmpfs for its
emptyDirs, the runtime's default seccomp profile, its command, args and plain env values.

The images tests (tests/test_image_build.py) and bench/image_build.py start it; the host's own
/run/containerd is never touched.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# containerd's default OCI capability set: what "capabilities: {drop: [ALL]}" removes (ctr 1.6
# takes no ALL, only names)
DEFAULT_CAPS = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
                "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")


@dataclass(frozen=True)
class Containerd:
    folder: Path
    address: str
    namespace: str = "k8s.io"

    def ctr(self, *args: str) -> list[str]:
        return ["ctr", "--address", self.address, "-n", self.namespace, *args]


def config_toml(folder: Path) -> str:
    return "\n".join([
        "version = 2",
        f'root = "{folder}/root"',
        f'state = "{folder}/state"',
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
        "[grpc]", f'  address = "{folder}/c.sock"',
        "[ttrpc]", f'  address = "{folder}/c.ttrpc.sock"',
        "[debug]", f'  address = "{folder}/c.debug.sock"',
        "",
    ])  # fmt: skip


@contextlib.contextmanager
def private_containerd(timeout: float = 60) -> Iterator[Containerd]:
    """containerd on sockets under a fresh /tmp folder (short: a unix socket path is < 108 bytes);
    stopped, its containers' tasks killed and the folder removed on exit."""
    folder = Path(tempfile.mkdtemp(prefix="kctd-", dir="/tmp"))
    (folder / "config.toml").write_text(config_toml(folder))
    log = (folder / "containerd.log").open("w")
    proc = subprocess.Popen(["containerd", "--config", str(folder / "config.toml")], stdout=log, stderr=log)
    ctd = Containerd(folder, f"{folder}/c.sock")
    try:
        deadline = time.monotonic() + timeout
        while subprocess.run(ctd.ctr("version"), capture_output=True, timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start: {(folder / 'containerd.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield ctd
    finally:
        listed = subprocess.run(ctd.ctr("tasks", "ls", "-q"), capture_output=True, text=True, timeout=30)
        for task in listed.stdout.split():
            subprocess.run(ctd.ctr("tasks", "kill", "-s", "SIGKILL", task), capture_output=True, timeout=30)
        time.sleep(0.5)
        for task in listed.stdout.split():
            subprocess.run(ctd.ctr("tasks", "delete", "-f", task), capture_output=True, timeout=30)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        for mount in sorted((line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                             if line.split()[4].startswith(str(folder))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def ctr_run_args(container: dict, pod_security: dict, volumes: list[dict], image_user: str) -> list[str]:
    """``ctr run`` flags for a rendered container: only what a kubelet on containerd would apply
    from it, so the container sees what the pod's does. Refuses what it cannot reproduce (ctr 1.6
    cannot set a user: the image's ``image_user`` must be the one the pod asks for)."""
    sc = {**pod_security, **container.get("securityContext", {})}
    if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        raise ValueError(f"only seccompProfile RuntimeDefault is reproduced, not {sc.get('seccompProfile')}")
    if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc.get("capabilities", {}).get("add"):
        raise ValueError(f"only capabilities drop [ALL] is reproduced, not {sc.get('capabilities')}")
    flags = ["--seccomp", *(w for cap in DEFAULT_CAPS for w in ("--cap-drop", f"CAP_{cap}"))]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", sc.get("runAsUser"))
    if uid is None:
        raise ValueError("the container sets no runAsUser")
    if f"{uid}:{gid}" != image_user:
        raise ValueError(f"the pod runs as {uid}:{gid}, the image as {image_user}: ctr run cannot change it")
    sizes = {v["name"]: v.get("emptyDir", {}).get("sizeLimit") for v in volumes if "emptyDir" in v}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in sizes:
            raise ValueError(f"volume {mount['name']} is not an emptyDir")
        size = sizes[mount["name"]]
        options = "nosuid:nodev" + (f":size={size.removesuffix('i').lower()}" if size else "")
        flags += ["--mount", f"type=tmpfs,src=tmpfs,dst={mount['mountPath']},options={options}"]
    for env in container.get("env", []):
        if "value" in env:
            flags += ["--env", f"{env['name']}={env['value']}"]
    return flags
