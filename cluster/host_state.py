"""What a real node changes on its host, recorded before it starts and undone after it stops.

A kubelet, kube-proxy, containerd and the CNI plugins change state that outlives them: sysctls
(forwarding, the kubelet's kernel defaults), iptables chains and rules (``KUBE-*``, ``CNI-*``, in
every table, IPv4 and IPv6), mounts (pod volumes, overlay root filesystems, network namespaces),
cgroups, and folders under /var and /run that no option moves. :func:`record` writes what the
host has before ``up``; :func:`restore` puts back each sysctl that changed, deletes the rules and
chains that were not there, and removes the folders and entries that were not there. Only
differences are undone: what the host had before stays, whoever made it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SYSCTLS = (
    # the bridge plugin (isGateway) and the node: pods' packets are routed through the host
    "net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv4/conf/default/forwarding",
    "net/ipv6/conf/all/forwarding", "net/ipv6/conf/default/forwarding",
    # Service replies between pods on one bridge pass through iptables (kube-proxy's DNAT)
    "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables",
    "net/ipv4/conf/all/route_localnet",
    # the kubelet's kernel defaults (protectKernelDefaults: false lets it set them)
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
    # kube-proxy's conntrack settings
    "net/netfilter/nf_conntrack_max", "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait", "net/netfilter/nf_conntrack_tcp_be_liberal",
)  # fmt: skip
# Folders the programs write to whatever their options say (libcni's cache, containerd's shim
# sockets, the kubelet's /var/log/containers links and volume-plugin folder).
HOST_DIRS = ("/var/lib/cni", "/run/containerd", "/var/run/netns", "/var/log/containers", "/var/log/pods",
             "/var/lib/kubelet", "/usr/libexec/kubernetes", "/etc/cni", "/opt/cni")
# Folders any other program of that name on the host uses too (another containerd keeps its
# shims' sockets and FIFOs in /run/containerd whatever its options say): left while one runs.
SHARED_DIRS = {"/run/containerd": "containerd"}
SAVERS = (("iptables", "iptables-save", "iptables-restore"), ("ip6tables", "ip6tables-save", "ip6tables-restore"))
NFT_FAMILY = {"iptables": "ip", "ip6tables": "ip6"}  # where iptables-nft keeps each family's tables
BUILTIN_CHAINS = {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
CGROUP_FS = Path("/sys/fs/cgroup")
PROC_SYS = Path("/proc/sys")


def read_sysctls() -> dict[str, str]:
    out = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = (PROC_SYS / name).read_text().strip()
    return out


def _version(saver: str) -> str:
    return subprocess.run([saver, "--version"], capture_output=True, text=True).stdout


def iptables_save(saver: str) -> str:
    if shutil.which(saver) is None:
        return ""
    return subprocess.run([saver], capture_output=True, text=True, timeout=60).stdout


def parse_save(text: str) -> dict[str, dict[str, list[str]]]:
    """``iptables-save`` text as {table: {"chains": [...], "rules": ["-A CHAIN ...", ...]}}."""
    tables: dict[str, dict[str, list[str]]] = {}
    table = None
    for line in text.splitlines():
        if line.startswith("*"):
            table = tables.setdefault(line[1:], {"chains": [], "rules": []})
        elif table is None or line.startswith("#") or line == "COMMIT":
            continue
        elif line.startswith(":"):
            table["chains"].append(line[1:].split()[0])
        elif line.startswith("-A "):
            table["rules"].append(line)
    return tables


def undo_script(before: str, now: str) -> str:
    """``iptables-restore --noflush`` input that deletes the rules and chains of ``now`` that
    ``before`` lacks: rules first (those in chains about to go are flushed with them), then the
    chains' contents, then the chains."""
    old, new = parse_save(before), parse_save(now)
    parts = []
    for name, table in new.items():
        was = old.get(name, {"chains": [], "rules": []})
        gone_chains = [c for c in table["chains"] if c not in was["chains"] and c not in BUILTIN_CHAINS]
        old_rules = set(was["rules"])
        deletes = ["-D " + r[3:] for r in table["rules"]
                   if r not in old_rules and r.split()[1] not in gone_chains]
        if not deletes and not gone_chains:
            continue
        parts += [f"*{name}", *deletes, *(f"-F {c}" for c in gone_chains), *(f"-X {c}" for c in gone_chains),
                  "COMMIT"]
    return "\n".join(parts) + "\n" if parts else ""


def empty_new_tables(before: str, now: str) -> list[str]:
    """Tables of ``now`` that ``before`` lacks and that hold no rule and no chain of their own:
    what is left of a family's tables once :func:`undo_script` ran (iptables-nft creates a table
    on first use and cannot delete one)."""
    old, new = parse_save(before), parse_save(now)
    return [name for name, t in new.items()
            if name not in old and not t["rules"] and set(t["chains"]) <= BUILTIN_CHAINS]


def ipsets() -> list[str]:
    if shutil.which("ipset") is None:
        return []
    return sorted(subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split())


def dir_entries(path: str) -> list[str] | None:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return []


def snapshot() -> dict:
    """What :func:`restore` compares the host against."""
    return {
        "sysctls": read_sysctls(),
        "iptables": {family: iptables_save(saver) for family, saver, _ in SAVERS},
        "dirs": {d: dir_entries(d) for d in HOST_DIRS},
        "ipsets": ipsets(),
    }


def record(path: Path) -> dict:
    """Write the host's state to ``path`` unless a record is there (a node restarted without its
    ``down`` keeps the first record: the host as it was before any node)."""
    if path.is_file():
        return json.loads(path.read_text())
    snap = snapshot()
    path.write_text(json.dumps(snap, indent=1))
    return snap


def mounts_under(prefixes: list[str]) -> list[str]:
    """Mount points at or below any of ``prefixes``, deepest first."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].encode().decode("unicode_escape")
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_under(prefixes: list[str]) -> list[str]:
    """Unmount everything at or below ``prefixes`` (lazily where busy); what was unmounted."""
    done = []
    for _ in range(3):  # a mount can hide another at the same point
        points = mounts_under(prefixes)
        if not points:
            break
        for point in points:
            proc = subprocess.run(["umount", point], capture_output=True)
            if proc.returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)
            done.append(point)
    return done


def cgroup_dirs(name: str) -> list[Path]:
    """``name`` (a top-level cgroup) in every mounted hierarchy that has it."""
    if not CGROUP_FS.is_dir():
        return []
    return [h / name for h in sorted(CGROUP_FS.iterdir()) if (h / name).is_dir()]


def cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs(name):
        for d, _, _ in os.walk(top):  # cgroups vanish while it walks: os.walk skips them
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in (Path(d) / "cgroup.procs").read_text().split())
    return pids


def kill_cgroup(name: str, timeout: float = 10.0) -> int:
    """SIGKILL every process in cgroup ``name`` (any hierarchy) until none is left; how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while (pids := cgroup_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)
    return len(killed)


def remove_cgroup(name: str) -> list[str]:
    """rmdir ``name`` and its children in every hierarchy, deepest first; what could not go."""
    left = []
    for top in cgroup_dirs(name):
        for d in [Path(d) for d, _, _ in os.walk(top, topdown=False)]:  # children first
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                left.append(str(d))
    return left


def processes_named(name: str) -> list[int]:
    """Processes whose program is ``name`` (the node's own are stopped before :func:`restore`)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(os.readlink(f"/proc/{entry}/exe")).name == name:
                    found.append(int(entry))
    return found


def restore(snap: dict) -> list[str]:
    """Undo what changed since ``snap``; a line per change undone (what ``down`` reports)."""
    done = []
    for family, saver, restorer in SAVERS:
        script = undo_script(snap["iptables"].get(family, ""), iptables_save(saver))
        if script:
            proc = subprocess.run([restorer, "--noflush"], input=script, capture_output=True, text=True)
            done.append(f"{family}: removed {script.count(chr(10) + '-X ')} chains, "
                        f"{script.count(chr(10) + '-D ')} rules" + (f" ({proc.stderr.strip()})" if proc.returncode else ""))
        tables = empty_new_tables(snap["iptables"].get(family, ""), iptables_save(saver))
        if tables and shutil.which("nft") and "nf_tables" in _version(saver):
            for table in tables:
                subprocess.run(["nft", "delete", "table", NFT_FAMILY[family], table], capture_output=True)
            done.append(f"{family}: removed the empty tables {', '.join(tables)}")
        elif tables:
            done.append(f"{family}: the empty tables {', '.join(tables)} stay (apt-get install nftables removes them)")
    new_sets = [s for s in ipsets() if s not in snap.get("ipsets", [])]
    for name in new_sets:  # after the rules that matched them
        subprocess.run(["ipset", "destroy", name], capture_output=True)
    if new_sets:
        done.append(f"destroyed {len(new_sets)} ipsets")
    for name, value in snap["sysctls"].items():
        path = PROC_SYS / name
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value)
                done.append(f"sysctl {name.replace('/', '.')} = {value}")
    for d, entries in snap["dirs"].items():
        now = dir_entries(d)
        if now is None:
            continue
        if d in SHARED_DIRS and (users := processes_named(SHARED_DIRS[d])):
            done.append(f"{d} stays: another {SHARED_DIRS[d]} uses it (pid {users[0]})")
            continue
        if entries is None:
            unmount_under([d])
            shutil.rmtree(d, ignore_errors=True)
            done.append(f"removed {d}")
            continue
        for entry in set(now) - set(entries):
            target = Path(d) / entry
            unmount_under([str(target)])
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
            done.append(f"removed {target}")
    return done
