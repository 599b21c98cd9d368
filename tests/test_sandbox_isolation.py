"""Sandbox isolation: what a call can see of the host, and what it can leave behind.

Both isolation modes run the same cases: ``full`` (root: namespaces, a minimal read-only root,
a per-call tmpfs, slot uids, cgroups) and ``basic`` (what a non-root pod gets: Landlock read and
write allowlists, seccomp, rlimits). After every case a healthy call must be answered by the same
server and workers: one call can never take the service down.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_helpers import alive, exec_code, memory_probe
from sandbox_service import readyz, unprivileged_wrapper
from venvs import venv_like_this_interpreter

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.containment.fsview import readonly_paths, service_paths
from kuberl.sandbox.containment.slot import CLEAN_BUDGET_SECONDS
from kuberl.sandbox.process.routing import zygote_for
from kuberl.sandbox.service.local import running_sandbox

LIMITS = SandboxLimits(timeout_seconds=3, memoryMB=256, max_output_bytes=4096, max_processes=16, diskMB=64)
SECRET = f"kuberl-secret-{os.getpid()}-do-not-leak"
REPO = Path(__file__).resolve().parent.parent
# world-readable host files a call must still not read
HOST_TMP_FILE = Path("/tmp") / f"kuberl-host-file-{os.getpid()}.txt"
HOST_SECRETS_DIR = Path("/tmp") / f"kuberl-fake-secrets-{os.getpid()}"


# the svc fixture: a service holding SECRET in its environment
pytestmark = pytest.mark.sandbox_service(
    limits=LIMITS, pool="iso", env={"KUBERL_TEST_SECRET": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET}, pod_files=False
)


@pytest.fixture(scope="module", autouse=True)
def host_files() -> Iterator[None]:
    """World-readable host files holding SECRET, there before the module's services start (an
    autouse fixture comes before the others of its scope) and until they stop."""
    HOST_TMP_FILE.write_text(SECRET)
    HOST_TMP_FILE.chmod(0o644)
    HOST_SECRETS_DIR.mkdir(exist_ok=True)
    (HOST_SECRETS_DIR / "token").write_text(SECRET)
    try:
        yield
    finally:
        HOST_TMP_FILE.unlink(missing_ok=True)
        (HOST_SECRETS_DIR / "token").unlink(missing_ok=True)
        HOST_SECRETS_DIR.rmdir()


def _run(url: str, code: str, zygote: str | None = None):
    """One call; with ``zygote``, on that zygote (the code must route there, or be sent there
    by a leading comment that names a heavy library: routing reads comments too)."""
    return exec_code(url, code if zygote is None else _routed(code, zygote))


ZYGOTES = ("light", "full")
TO_FULL = "# numpy: a comment that sends this call to the full zygote\n"


def _routed(code: str, zygote: str) -> str:
    code = TO_FULL + code if zygote == "full" else code
    assert zygote_for({"op": "exec", "code": code}) == zygote, code
    return code


def _healthy_after(url: str, before: dict) -> None:
    """The same server and workers answer a plain call after the case, on both zygotes."""
    alive(url)
    r = _run(url, "print('alive')", "full")
    assert (r.outcome, r.output) == ("stdout", "alive\n"), r
    status, info = readyz(url)
    assert status == 200, info
    assert info["server_pid"] == before["server_pid"]
    assert info["worker_pids"] == before["worker_pids"] and info["worker_restarts"] == 0, info


# ---- what a call sees ---------------------------------------------------------------------------


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_the_environment_is_an_allowlist(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "for p in ('/proc/self/environ', '/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n"
        "        print(p, open(p, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    r = _run(url, code, zygote)
    assert r.outcome == "stdout", r
    assert SECRET not in r.output and "AWS_SECRET" not in r.output, r.output
    names = set(eval(r.output.splitlines()[0]))  # noqa: S307 - our own printed list
    assert names <= {"PATH", "HOME", "TMPDIR", "USER", "LOGNAME", "LANG", "LC_ALL", "PYTHONIOENCODING", "PYTHONHASHSEED",
                     "PYTHONDONTWRITEBYTECODE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                     "MKL_NUM_THREADS", "MPLCONFIGDIR", "XDG_CACHE_HOME"}, names  # fmt: skip
    assert {"PATH", "HOME", "TMPDIR"} <= names
    _healthy_after(url, before)


def _host_paths() -> list[str]:
    import kuberl.sandbox.service.server as server_module

    return [
        str(REPO / "pyproject.toml"),
        str(REPO),
        str(HOST_TMP_FILE),
        str(HOST_SECRETS_DIR / "token"),
        str(HOST_SECRETS_DIR),
        "/etc/shadow",
        "/etc/passwd",
        "/root",
        "/home",
        "/var/run/secrets",
        server_module.__file__,
        os.path.dirname(server_module.__file__),
    ]


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_host_files_are_out_of_sight(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    paths = _host_paths()
    code = (
        "import os, glob\n"
        f"paths = {paths!r} + glob.glob('/tmp/kuberl-sbx-*') + glob.glob('/tmp/*')\n"
        "for p in paths:\n"
        "    try:\n"
        "        if os.path.isdir(p):\n"
        "            got = os.listdir(p)\n"
        "        else:\n"
        "            got = open(p, 'rb').read(64)\n"
        "        print('READ', p, got)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    r = _run(url, code, zygote)
    assert r.outcome == "stdout", r
    assert SECRET not in r.output
    # a call's own scratch space may be listed (it is empty), and the directories on the way
    # to the interpreter (/root holds .pyenv under pyenv); nothing else of the host's
    skeleton = {part for p in readonly_paths() for part in Path(p).parts}
    leaked = []
    for ln in r.output.splitlines():
        if ln.startswith("READ"):
            listed = ln.split(" ", 2)[2]
            if not (listed.startswith("[") and set(eval(listed)) <= skeleton):  # noqa: S307
                leaked.append(ln)
    assert leaked == [], leaked
    _healthy_after(url, before)


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_proc_shows_no_host_mounts_or_processes(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os\n"
        "for p in ('/proc/self/mountinfo', '/proc/mounts'):\n"
        "    try:\n"
        "        print(open(p).read())\n"
        "    except OSError as e:\n"
        "        print('denied', type(e).__name__)\n"
        "try:\n"
        "    print('pids', [p for p in os.listdir('/proc') if p.isdigit()])\n"
        "except OSError as e:\n"
        "    print('denied', type(e).__name__)\n"
    )
    r = _run(url, code, zygote)
    assert r.outcome == "stdout", r
    # A host path may show only as the mount of a tree the call reads (the interpreter and its
    # packages, wherever they are installed: a venv inside the checkout is one) or of the empty
    # mount over the service's own code; nothing else of the checkout or of /work
    visible = set(readonly_paths()) | set(service_paths())
    leaked = []
    for line in r.output.splitlines():
        fields = line.split()
        if str(REPO) not in line and "/work" not in line:
            continue
        mount_point = fields[4] if line[:1].isdigit() else fields[1]  # mountinfo, /proc/mounts
        if mount_point not in visible:
            leaked.append(line)
    assert leaked == [], r.output
    _healthy_after(url, before)


def test_the_python_tools_still_work(svc):
    """The interpreter, its packages, tempfile, HOME and /dev's harmless files are usable."""
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os, tempfile, json, decimal, fractions, sqlite3, zoneinfo\n"
        "import numpy as np, sympy, scipy.optimize\n"
        "fd, path = tempfile.mkstemp(); os.write(fd, b'x'); os.close(fd)\n"
        "with tempfile.NamedTemporaryFile('w') as f:\n"
        "    f.write('y')\n"
        "d = tempfile.mkdtemp()\n"
        "os.makedirs(os.path.expanduser('~/.cache/lib'), exist_ok=True)\n"
        "open(os.path.expanduser('~/.cache/lib/x'), 'w').write('z')\n"
        "open('here.txt', 'w').write('w')\n"
        "assert open('/dev/urandom', 'rb').read(4) and open('/dev/zero', 'rb').read(2) == b'\\0\\0'\n"
        "open('/dev/null', 'w').write('gone')\n"
        "con = sqlite3.connect(':memory:'); con.execute('select 1')\n"
        "import getpass, threading, os\n"
        "getpass.getuser()\n"
        "t = threading.Thread(target=os.cpu_count); t.start(); t.join()\n"
        "print(path.startswith(os.environ['TMPDIR']), sympy.factor('x**2-1'), int(np.arange(4).sum()))\n"
    )
    r = _run(url, code)
    assert (r.outcome, r.output) == ("stdout", "True (x - 1)*(x + 1) 6\n"), r
    _healthy_after(url, before)


# ---- what a call can leave behind ---------------------------------------------------------------


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_the_service_reads_no_file_the_call_chose(svc, zygote):
    """A call that swaps the paths a service might read its output from gets its own output."""
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os, sys\n"
        "print('mine')\n"
        "sys.stdout.flush()\n"
        "for name in ('.stdout', '.stderr', 'stdout', 'stderr', '.stdin'):\n"
        "    try:\n"
        "        os.unlink(name)\n"
        "    except OSError:\n"
        "        pass\n"
        f"    os.symlink({str(HOST_TMP_FILE)!r}, name)\n"
    )
    r = _run(url, code, zygote)
    assert (r.outcome, r.output) == ("stdout", "mine\n"), r
    fifo = (
        "import os\n"
        "for name in ('.stdout', '.stderr', 'stdout', 'stderr'):\n"
        "    try:\n"
        "        os.unlink(name)\n"
        "    except OSError:\n"
        "        pass\n"
        "    os.mkfifo(name)\n"
        "print('fifos')\n"
    )
    started = time.monotonic()
    r = _run(url, fifo, zygote)
    assert (r.outcome, r.output) == ("stdout", "fifos\n"), r
    assert time.monotonic() - started < LIMITS.timeout_seconds
    _healthy_after(url, before)


LEFTOVERS = {
    "deep_tree": (
        "import os\n"
        "for i in range(3000):\n"  # 6000 characters: past PATH_MAX
        "    os.mkdir('d')\n"
        "    os.chdir('d')\n"
        "print('deep')\n"
    ),
    "locked_dirs": (
        "import os\n"
        "os.makedirs('a/b/c')\n"
        "open('a/b/c/f', 'w').write('x')\n"
        "os.chmod('a/b/c', 0)\n"
        "os.chmod('a/b', 0o500)\n"
        "os.chmod('a', 0)\n"
        "print('locked')\n"
    ),
    "many_files": (
        "import os, time\n"
        "end = time.monotonic() + 1.0\n"
        "n = 0\n"
        "while time.monotonic() < end:\n"
        "    open(f'f{n}', 'w').close()\n"
        "    n += 1\n"
        "print('many')\n"
    ),
    "odd_names": (
        "import os\n"
        "for name in ('-rf', '\\n', ' ', 'a\\\\b', '..x', '\\udcff'):\n"
        "    os.mkdir(name.encode('utf-8', 'surrogateescape'))\n"
        "os.symlink('/', 'root-link')\n"
        "os.symlink('.', 'loop')\n"
        "os.mkfifo('pipe')\n"
        "print('odd')\n"
    ),
}


@pytest.mark.parametrize("zygote", ZYGOTES)
@pytest.mark.parametrize("name", sorted(LEFTOVERS))
def test_what_a_call_leaves_is_gone_for_the_next(svc, name, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    started = time.monotonic()
    r = _run(url, LEFTOVERS[name], zygote)
    # making the tree may run out of time (Landlock checks every level of a deep path) or of
    # inodes; removing it must not take long whatever it is
    assert r.outcome in ("stdout", "timeout", "error"), r
    assert time.monotonic() - started < LIMITS.timeout_seconds + CLEAN_BUDGET_SECONDS + 4
    for _ in range(4):  # whichever slot answers, its scratch space starts empty
        seen = _run(url, "import os\nprint(sorted(os.listdir('.')))")
        assert (seen.outcome, seen.output) == ("stdout", "[]\n"), seen
    _healthy_after(url, before)


# what a call can change of its directory itself, each on its own (any of them alone must be
# undone for the next call)
LEAVE_ON_THE_DIRECTORY = {
    "xattr": "os.setxattr('.', 'user.note', b'for the next call')",
    "mode": "os.chmod('.', 0o757)",
    "times": "os.utime('.', (1, 1))",
}
DIRECTORY_SEEN = (
    "import os\n"
    "st = os.stat('.')\n"
    "print(os.listxattr('.'), oct(st.st_mode & 0o777), st.st_mtime > 1, os.listdir('.'))\n"
)


@pytest.mark.parametrize("change", sorted(LEAVE_ON_THE_DIRECTORY))
def test_a_call_leaves_nothing_on_its_directory_itself(svc, change):
    """Attributes, mode and times of the call's directory (not an entry in it) are back to a
    fresh one's for the next call: a private root's tmpfs kept because nothing in it changed
    must really be unchanged, and a slot directory is stripped of them."""
    mode, url, _ = svc
    before = readyz(url)[1]
    left = _run(url, f"import os\n{LEAVE_ON_THE_DIRECTORY[change]}\nprint('changed')\n")
    assert (left.outcome, left.output) == ("stdout", "changed\n"), left
    for _ in range(4):  # whichever slot answers (the workers take calls in turn)
        seen = _run(url, DIRECTORY_SEEN)
        assert (seen.outcome, seen.output) == ("stdout", "[] 0o700 True []\n"), seen
    _healthy_after(url, before)


IPC = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "key = 0x6B75626C\n"
    "made = libc.shmget(key, 4096, 0o1000 | 0o666)\n"  # IPC_CREAT
    "sem = libc.semget(key, 1, 0o1000 | 0o666)\n"
    "msg = libc.msgget(key, 0o1000 | 0o666)\n"
    "print(made >= 0, sem >= 0, msg >= 0)\n"
)
IPC_SEEN = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "key = 0x6B75626C\n"
    "print(libc.shmget(key, 0, 0) >= 0, libc.semget(key, 0, 0) >= 0, libc.msgget(key, 0, 0) >= 0)\n"
)


def test_kernel_objects_die_with_the_call(svc):
    mode, url, _ = svc
    before = readyz(url)[1]
    _run(url, IPC)
    for _ in range(4):
        seen = _run(url, IPC_SEEN)
        assert (seen.outcome, seen.output) == ("stdout", "False False False\n"), seen
    with open("/proc/sysvipc/shm") as fh:  # nor on the host
        assert "1802855020" not in fh.read()  # the key in decimal
    _healthy_after(url, before)


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_only_unix_sockets(svc, zygote):
    """No network, and none of the families that reach the host or the kernel without one."""
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import socket\n"
        "families = {'unix': 1, 'inet': 2, 'inet6': 10, 'netlink': 16, 'packet': 17, 'alg': 38, 'vsock': 40,\n"
        "            'xdp': 44, 'bluetooth': 31, 'can': 29, 'rds': 21, 'tipc': 30}\n"
        "for name, fam in families.items():\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET, socket.SOCK_RAW):\n"
        "        try:\n"
        "            socket.socket(fam, kind).close()\n"
        "            print('open', name, kind)\n"
        "        except OSError:\n"
        "            pass\n"
        "a, b = socket.socketpair()\n"
        "a.sendall(b'x'); print(b.recv(1))\n"
    )
    r = _run(url, code, zygote)
    assert r.outcome == "stdout", r
    opened = {ln.split()[1] for ln in r.output.splitlines() if ln.startswith("open")}
    # without a private root a unix socket could reach the host's by path: socket pairs only
    assert opened == ({"unix"} if before["protections"]["private_root"] else set()), r.output
    assert r.output.endswith("b'x'\n"), r.output
    _healthy_after(url, before)


def test_no_programs_and_no_reach_into_other_processes(svc):
    """No exec; prlimit, scheduling and priority calls only on the caller itself (a call under the
    service's uid could otherwise cut the server's open-file limit or pin it to one core)."""
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import ctypes, os, resource, subprocess, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "try:\n"
        "    os.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n"
        "except OSError as e:\n"
        "    print('exec', e.errno)\n"
        "other = os.getppid() or 1\n"
        "class RL(ctypes.Structure):\n"
        "    _fields_ = [('cur', ctypes.c_ulong), ('max', ctypes.c_ulong)]\n"
        "print('prlimit', libc.prlimit(other, 7, ctypes.byref(RL(0, 0)), None))\n"
        "print('affinity', libc.sched_setaffinity(other, 8, ctypes.byref(ctypes.c_ulong(1))))\n"
        "print('nice', libc.setpriority(0, other, 19), libc.setpriority(2, 0, 19))\n"
        "print('dumpable', libc.prctl(4, 0, 0, 0, 0))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
        "os.sched_setaffinity(0, os.sched_getaffinity(0))\n"
        "print('own ok', libc.setpriority(0, 0, 5))\n"
    )
    r = _run(url, code)
    assert r.outcome == "stdout", r
    assert r.output.split("\n")[:6] == [
        "exec 1", "prlimit -1", "affinity -1", "nice -1 -1", "dumpable -1", "own ok 0"
    ], r.output  # fmt: skip
    _healthy_after(url, before)


def test_no_new_user_namespaces(svc):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import ctypes, os, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "CLONE_NEWUSER = 0x10000000\n"
        "print('unshare', libc.unshare(CLONE_NEWUSER))\n"
        "nr = {'x86_64': 56, 'aarch64': 220}[os.uname().machine]\n"
        "pid = libc.syscall(ctypes.c_long(nr), ctypes.c_long(CLONE_NEWUSER | signal.SIGCHLD), 0, 0, 0, 0)\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "print('clone', pid)\n"
        "nr3 = {'x86_64': 435, 'aarch64': 435}[os.uname().machine]\n"
        "print('clone3', libc.syscall(ctypes.c_long(nr3), 0, 0))\n"
    )
    r = _run(url, code)
    assert r.outcome == "stdout", r
    assert r.output.split() == ["unshare", "-1", "clone", "-1", "clone3", "-1"], r.output
    _healthy_after(url, before)


# ---- failing fast and bounded output -------------------------------------------------------------


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_runaway_recursion_fails_fast(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    ok = _run(url, "import sys\nsys.setrecursionlimit(10**5)\ndef f(n):\n    return 0 if n == 0 else f(n - 1)\n"
                   "print(f(50000))", zygote)  # fmt: skip
    assert (ok.outcome, ok.output) == ("stdout", "0\n"), ok
    # an error raised 90,000 frames deep: the unwinding and traceback a runaway stopped at the
    # cap costs too (the 50,000 frames above return without either: a tenth of it)
    deep = "import sys\nsys.setrecursionlimit(10**5)\ndef f(n):\n    return 1 // 0 if n == 0 else f(n - 1)\nf(90000)\n"
    before_deep = _run(url, deep, zygote)
    assert before_deep.outcome == "error" and "ZeroDivisionError" in before_deep.output, before_deep
    code = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)\n"
    r = _run(url, code, zygote)
    assert r.outcome == "error" and "RecursionError" in r.output, r
    after_deep = _run(url, deep, zygote)
    # stopped at the cap (100,000 frames), not after 10**7: about as long as the error 90,000
    # frames deep under this moment's load (measured on both sides of it), within a second idle
    baseline = max(before_deep.duration_s, after_deep.duration_s)
    assert r.duration_s < max(1.0, 3 * baseline), (r, before_deep.duration_s, after_deep.duration_s)
    _healthy_after(url, before)


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_too_much_output_is_truncated_with_the_codes_own_outcome(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    r = _run(url, "import sys\nfor i in range(200000):\n    print(i)\nprint('end', file=sys.stderr)", zygote)
    assert r.outcome == "stdout" and r.truncated, r
    assert r.output.startswith("0\n1\n2\n") and "Errno" not in r.output, r.output[-200:]
    r = _run(url, "for i in range(200000):\n    print(i)\n1 / 0", zygote)
    assert r.outcome == "error" and r.truncated and "ZeroDivisionError" in r.output, r.output[-300:]
    _healthy_after(url, before)


@pytest.mark.parametrize("zygote", ZYGOTES)
def test_files_unlinked_while_open_count_against_the_quota(svc, zygote):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os\n"
        "fs = []\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(16):\n"
        "        f = open(f'f{i}', 'wb')\n"
        "        os.unlink(f'f{i}')\n"
        "        fs.append(f)\n"
        "        for _ in range(60):\n"
        "            f.write(b'0' * 2**20)\n"
        "            f.flush()\n"
        "            written += 1\n"
        "finally:\n"
        "    print('written MB', written)\n"
    )
    r = _run(url, code, zygote)
    assert r.outcome == "error", r
    lines = [ln for ln in r.output.splitlines() if ln.startswith("written MB")]
    assert not lines or int(lines[0].split()[-1]) <= LIMITS.disk_mb + 16, r.output
    _healthy_after(url, before)


def test_undecodable_output_reaches_the_client_as_valid_utf8(svc):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'bad \\xff\\xfe out\\n')\n"
        "sys.stdout.flush()\n"
        "raise ValueError(b'\\xff\\xfe'.decode('utf-8', 'surrogateescape'))\n"
    )
    req = urllib.request.Request(
        url + "/v1/execute", data=json.dumps({"code": code}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        raw = resp.read()
    raw.decode("utf-8")  # strict
    assert b"\\ud" not in raw.lower(), raw  # no lone surrogates escaped into the JSON
    body = json.loads(raw)
    assert body["outcome"] == "error" and "ValueError" in body["output"], body
    body["output"].encode("utf-8")  # strict: no lone surrogates
    _healthy_after(url, before)


def test_protections_report_the_filesystem_view(svc):
    mode, url, _ = svc
    prot = readyz(url)[1]["protections"]
    assert prot["env_allowlist"] and prot["fs_view"] and prot["stack_limit"]
    if mode == "full" and sys.platform == "linux" and os.geteuid() == 0:
        assert prot["private_root"] and prot["call_tmpfs"] and prot["ipc_namespace"]


def _service_processes(worker_pids: list[int]) -> list[tuple[int, str, str]]:
    """(pid, state, name) of this service's processes below its workers, from one look at ps."""
    import subprocess

    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [ln.split() for ln in ps.splitlines()]
    ours, frontier = set(), set(worker_pids)
    while frontier:
        frontier = {int(r[0]) for r in rows if int(r[1]) in frontier} - ours
        ours |= frontier
    return [(int(r[0]), r[2], " ".join(r[3:])) for r in rows if int(r[0]) in ours]


def test_a_dead_child_forked_ahead_costs_no_call(svc):
    """The idle child a worker forked for its next call can die (another slot's call can signal
    it on kernels without Landlock signal scoping): the call runs on a fresh one."""
    import signal

    mode, url, _ = svc
    before = readyz(url)[1]
    def ready_children() -> list[int]:
        """This service's live children forked ahead. A zygote is named kuberl-ready for the
        moment it forks (a slow instant on a loaded machine), so the names are read a few
        times and a process ever seen as kuberl-zygote is left out; so is a killed child its
        worker has not reaped yet (state Z, or X while it goes), which keeps the name."""
        zygotes: set[int] = set()
        for _ in range(4):
            procs = _service_processes(before["worker_pids"])
            zygotes |= {pid for pid, _, name in procs if name == "kuberl-zygote"}
            time.sleep(0.02)
        return [
            pid for pid, state, name in procs
            if name == "kuberl-ready" and pid not in zygotes and state[0] not in "ZX"
        ]  # fmt: skip

    # a worker forks ahead once it has cleaned up after the last call: one child per zygote
    # (the deadline is for a loaded machine: the loop ends as soon as they are all there)
    wanted = len(before["worker_pids"]) * (2 if before["protections"].get("light_zygote") else 1)
    deadline, next_call = time.monotonic() + 30, time.monotonic() + 1
    while len(ready := ready_children()) < wanted and time.monotonic() < deadline:
        time.sleep(0.1)
        # a call makes a worker replace a child forked ahead that died since (earlier cases);
        # once a second, not before every read: the call takes a child forked ahead itself, and
        # its worker forks the next one only after answering
        if time.monotonic() > next_call:
            alive(url)
            next_call = time.monotonic() + 1
    assert len(ready) == wanted, ready
    for pid in ready:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    for _ in range(3):
        alive(url)
        r = _run(url, "print('alive')", "full")
        assert (r.outcome, r.output) == ("stdout", "alive\n"), r
    status, info = readyz(url)
    assert status == 200 and info["worker_pids"] == before["worker_pids"] and info["worker_restarts"] == 0


# ---- pure parts and the Landlock mechanism -----------------------------------------------------


def test_read_rules_cut_a_hidden_directory_out_of_an_allowlist():
    from kuberl.sandbox.containment.fsview import hidden_beneath, minimal, read_rules

    tree = {
        "/py/lib": ["python3.11", "libpython.so"],
        "/py/lib/python3.11": ["os.py", "site-packages"],
        "/py/lib/python3.11/site-packages": ["numpy", "kuberl", "kuberl-0.1.dist-info"],
    }
    whole, list_only = read_rules(["/py/lib", "/usr/lib"], ["/py/lib/python3.11/site-packages/kuberl"], tree.get)
    assert list_only == ["/py/lib", "/py/lib/python3.11", "/py/lib/python3.11/site-packages"]
    assert sorted(whole) == sorted([
        "/usr/lib", "/py/lib/libpython.so", "/py/lib/python3.11/os.py",
        "/py/lib/python3.11/site-packages/numpy", "/py/lib/python3.11/site-packages/kuberl-0.1.dist-info",
    ])  # fmt: skip
    assert read_rules(["/usr/lib"], ["/work/checkout/sandbox"], tree.get) == (["/usr/lib"], [])
    assert hidden_beneath(["/a", "/b"], ["/a/x", "/c/y", "/a"]) == ["/a/x"]
    assert minimal(["/a/b", "/a", "/ab", "/a/"]) == ["/a", "/ab"]


def test_landlock_list_only_directories_hide_their_files(tmp_path):
    """What basic isolation does to kuberl's own package when it is installed in site-packages."""
    from kuberl.sandbox.containment import landlock
    from kuberl.sandbox.containment.fsview import read_rules

    abi = landlock.abi_version()
    if abi < 1:
        pytest.skip("no Landlock on this kernel")
    (tmp_path / "site" / "kuberl").mkdir(parents=True)
    (tmp_path / "site" / "kuberl" / "server.py").write_text("secret code")
    (tmp_path / "site" / "numpy").mkdir()
    (tmp_path / "site" / "numpy" / "core.py").write_text("public code")
    (tmp_path / "scratch").mkdir()
    whole, list_only = read_rules([str(tmp_path / "site")], [str(tmp_path / "site" / "kuberl")])
    ruleset = landlock.Ruleset.build([str(tmp_path / "scratch")], [], abi, whole, list_only)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        out = []
        try:
            import ctypes

            ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs
            ruleset.restrict_self()
            for p in ("site/numpy/core.py", "site/kuberl/server.py"):
                try:
                    out.append(open(tmp_path / p).read())
                except OSError as e:
                    out.append(type(e).__name__)
            out.append(",".join(sorted(os.listdir(tmp_path / "site"))))
        finally:
            os.write(w, "|".join(out).encode())
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = os.read(r, 4096).decode()
    ruleset.close()
    assert got == "public code|PermissionError|kuberl,numpy", got


@pytest.mark.parametrize("mode", ["full", "basic"])
def test_the_service_code_installed_in_site_packages_is_out_of_sight(installed_wheel, mode):
    """Installed from a wheel, kuberl lies in the site-packages calls may read: its files are cut
    out of the view (an empty mount in the private root, list-only under Landlock)."""
    import shutil
    import subprocess
    import tempfile

    wrapper: list[str] = []
    if mode == "basic":
        found = unprivileged_wrapper()
        if found is None:
            pytest.skip("cannot run the service as a non-root uid here")
        wrapper = found
    top = Path(tempfile.mkdtemp(prefix="kuberl-venv-", dir="/tmp"))
    try:
        top.chmod(0o755)  # the unprivileged service must reach its interpreter
        python = str(venv_like_this_interpreter(top / "venv"))
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        shutil.copytree(installed_wheel, purelib, dirs_exist_ok=True)
        server_py = Path(purelib) / "kuberl" / "sandbox" / "service" / "server.py"
        assert server_py.is_file()
        with running_sandbox(
            workers=1, limits=LIMITS, pool=f"wheel-{mode}", extra_args=["--isolation", mode],
            wrapper=wrapper, python=python, cwd=str(top),  # not the checkout: its kuberl would win
        ) as url:  # fmt: skip
            protections = readyz(url)[1]["protections"]
            # a venv under /tmp still gets the private root (its scratch space is elsewhere)
            assert protections["fs_view"] and protections["private_root"] == (mode == "full"), protections
            code = (
                "import numpy\n"
                f"for p in ({str(server_py)!r}, {str(server_py.parents[2] / '__init__.py')!r}):\n"
                "    try:\n"
                "        print('READ', len(open(p).read()))\n"
                "    except OSError as e:\n"
                "        print(type(e).__name__)\n"
            )
            r = _run(url, code)
            assert r.outcome == "stdout" and "READ" not in r.output, r
            alive(url)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_clear_dir_removes_any_tree_and_stops_at_its_budget(tmp_path):
    from kuberl.sandbox.containment.fsview import clear_dir

    top = tmp_path / "slot"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(2500):  # 5000 characters below top: past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    (top / "locked" / "inner").mkdir(parents=True)
    (top / "locked" / "inner" / "f").write_text("x")
    (top / "locked" / "inner").chmod(0)
    (top / "locked").chmod(0o500)
    os.symlink("/", top / "root-link")
    os.mkfifo(top / "pipe")
    (top / "bad\udcffname".encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")).mkdir()
    assert clear_dir(str(top), budget_s=30.0) is True
    assert os.listdir(top) == [] and os.path.isdir("/")  # the link was removed, not followed
    for i in range(2000):
        (top / f"f{i}").touch()
    assert clear_dir(str(top), budget_s=0.0) is False  # out of budget: the caller moves it aside
    assert clear_dir(str(top), budget_s=30.0) is True and os.listdir(top) == []


FORGED_RECORDS = {
    "deep_json": "b'[' * 100000",
    "wrong_types": "b'{\"status\": \"ok\", \"repr\": 5}'",
    "wrong_traceback": "b'{\"status\": \"error\", \"traceback\": [1]}'",
    "garbage": "b'\\xff' * 70000",
}


@pytest.mark.parametrize("name", sorted(FORGED_RECORDS))
def test_a_forged_result_record_costs_only_its_own_call(svc, name):
    """The pipe a call's result record travels on is also open to the call's code: whatever it
    writes there, the worker stays up and the next call is answered."""
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os, stat\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        st = os.fstat(fd)\n"
        "    except OSError:\n"
        "        continue\n"
        "    if stat.S_ISFIFO(st.st_mode):\n"
        "        try:\n"
        f"            os.write(fd, {FORGED_RECORDS[name]})\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"
    )
    r = _run(url, code)
    assert r.outcome in ("error", "stdout", "no_stdout"), r
    _healthy_after(url, before)


def test_a_call_finds_nothing_of_earlier_calls_in_its_memory(svc):
    """Each call is a fork: it must not start with memory that held earlier calls (their code,
    stdin and output, a verification's gold answer and prediction). The probe scans its whole
    writable memory (or, without /proc, its whole malloc heap) for markers that earlier calls
    on the same workers carried, against a control marker that exists only in the probe: the
    control must be found (the scan is real), each marker no more often than the control."""
    import asyncio

    from kuberl.sandbox.service.client import SandboxClient

    mode, url, _ = svc
    before = readyz(url)[1]
    tag = f"{os.getpid()}-{mode}-{os.urandom(4).hex()}"
    marks = {k: f"kuberl-{k}-{tag}" for k in ("code", "stdin", "output", "gold", "prediction")}

    async def earlier() -> None:
        async with SandboxClient(url) as c:
            code = f"x = {marks['code']!r}\nprint(input(), {marks['output'][::-1]!r}[::-1])"
            r = await c.execute(code, marks["stdin"])
            assert marks["output"] in r.output, r
            await c.verify(f"\\text{{{marks['prediction']}}}", f"\\text{{{marks['gold']}}}")

    for _ in range(2):  # both workers
        asyncio.run(earlier())
    names = sorted(marks)
    control = os.urandom(8).hex() + "-lortnoc-lrebuk"  # reversed: only the probe makes it
    probe = memory_probe([*(marks[k][::-1] for k in names), control])
    for _ in range(3):
        r = _run(url, probe)
        assert r.outcome == "stdout", r
        out = json.loads(r.output)
        *found, own = out["counts"]
        assert own >= 1, out  # the scan reads the probe's own memory
        assert dict(zip(names, found, strict=True)) == dict.fromkeys(names, own), out
    _healthy_after(url, before)


QUOTA_DODGES = {
    "write_only_directory": "os.mkdir('d', 0o300)\nos.chdir('d')\n",
    "past_path_max": "for i in range(18):\n    os.mkdir('x' * 250)\n    os.chdir('x' * 250)\n",
}


@pytest.mark.parametrize("name", sorted(QUOTA_DODGES))
def test_files_the_worker_cannot_easily_see_count_against_the_quota(svc, name):
    mode, url, _ = svc
    before = readyz(url)[1]
    code = (
        "import os\n"
        + QUOTA_DODGES[name]
        + "written = 0\n"
        "try:\n"
        "    for i in range(40):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(8):\n"
        "                f.write(b'0' * 2**20)\n"
        "                written += 1\n"
        "finally:\n"
        "    print('written MB', written)\n"
    )
    r = _run(url, code)
    assert r.outcome == "error" and "quota" in r.output or "No space" in r.output, r
    _healthy_after(url, before)


HELD_WITHOUT_A_NAME = {
    # each file mapped one page and unlinked, no descriptor left open: it holds all its blocks
    "mapped_after_unlink": (
        "import ctypes, os, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,\n"
        "                      ctypes.c_long]\n"
        "for i in range(30):\n"
        "    fd = os.open(f'f{i}', os.O_CREAT | os.O_RDWR, 0o600)\n"
        "    os.posix_fallocate(fd, 0, 8 * 2**20)\n"
        "    libc.mmap(None, 4096, 1, 1, fd, 0)\n"
        "    os.close(fd)\n"
        "    os.unlink(f'f{i}')\n"
        "time.sleep(2)\n"
        "print('held 240 MB')\n"
    ),
    # names without blocks: directory entries all the same (20000 x 4 KiB is past the 64 MB
    # quota). Hard links to one empty file, because they are quick to make: empty files would
    # do the same, at a few thousand a second on a slot directory. A private root's tmpfs
    # bounds names by its inodes and the memory cgroup (dentries are charged) instead.
    "many_names": (
        "import os, time\n"
        "os.close(os.open('e', os.O_CREAT | os.O_WRONLY, 0o600))\n"
        "for i in range(20000):\n"
        "    os.link('e', f'n{i}')\n"
        "time.sleep(1)\n"
        "print('made 20000')\n"
    ),
}


@pytest.mark.parametrize("name", sorted(HELD_WITHOUT_A_NAME))
def test_disk_held_without_a_name_or_in_empty_files_counts_against_the_quota(svc, name):
    mode, url, _ = svc
    if mode == "basic" and name == "mapped_after_unlink":
        pytest.skip("a worker that is not root cannot follow /proc/PID/map_files: known limit, docs/sandbox.md")
    before = readyz(url)[1]
    r = _run(url, HELD_WITHOUT_A_NAME[name])
    if mode == "full" and name == "many_names":  # within the tmpfs's inodes and memory
        assert (r.outcome, r.output) == ("stdout", "made 20000\n"), r
    else:
        assert r.outcome == "error" and ("quota" in r.output or "No space" in r.output), (r, r.duration_s)
    _healthy_after(url, before)


# ---- the two zygotes ------------------------------------------------------------------------------

# Everything the sandbox sets up for a call, as the call sees it: written to route to the light
# zygote (no heavy name, nothing that imports by a computed name); TO_FULL sends it to the full
# one. Not compared: pids, and RLIMIT_AS (the memory budget on top of the image, which differs).
SANDBOX_STATE = (
    "import json, os, resource, signal, sys, tempfile\n"
    "def read(path):\n"
    "    try:\n"
    "        with open(path) as fh:\n"
    "            return fh.read()\n"
    "    except OSError as e:\n"
    "        return type(e).__name__\n"
    "def link(path):\n"
    "    try:\n"
    "        return os.readlink(path)\n"
    "    except OSError as e:\n"
    "        return type(e).__name__\n"
    "status = [ln for ln in read('/proc/self/status').splitlines()\n"
    "          if ln.split(':')[0] in ('Uid', 'Gid', 'Groups', 'NoNewPrivs', 'Seccomp', 'Seccomp_filters',\n"
    "                                  'CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')]\n"
    "limits = {n: resource.getrlimit(r) for n, r in (('cpu', resource.RLIMIT_CPU), ('fsize', resource.RLIMIT_FSIZE),\n"
    "          ('nofile', resource.RLIMIT_NOFILE), ('core', resource.RLIMIT_CORE), ('nproc', resource.RLIMIT_NPROC),\n"
    "          ('stack', resource.RLIMIT_STACK), ('data', resource.RLIMIT_DATA))}\n"
    "fds = []\n"
    "for fd in range(64):\n"
    "    try:\n"
    "        os.fstat(fd)\n"
    "        fds.append(fd)\n"
    "    except OSError:\n"
    "        pass\n"
    "sys.setrecursionlimit(10**7)\n"
    "print(json.dumps({\n"
    "    'ids': [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()], 'status': status,\n"
    "    'ns': {n: link('/proc/self/ns/' + n) for n in ('ipc', 'mnt', 'net', 'pid', 'uts', 'cgroup', 'user')},\n"
    "    'cgroup': read('/proc/self/cgroup'), 'mounts': read('/proc/self/mountinfo'),\n"
    "    'env': dict(os.environ), 'cwd': os.getcwd(), 'tmp': tempfile.gettempdir(), 'umask': os.umask(0o22),\n"
    "    'limits': limits, 'fds': fds, 'session_leader': os.getsid(0) == os.getpid(),\n"
    "    'recursion': sys.getrecursionlimit(), 'listing': sorted(os.listdir('.')),\n"
    "    'signals': [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ)],\n"
    f"    'host_file': read({str(HOST_TMP_FILE)!r}), 'checkout': read({str(REPO / 'pyproject.toml')!r}),\n"
    "}, sort_keys=True))\n"
)


def _comparable(output: str, mode: str) -> str:
    """A call's sandbox state without what varies from call to call by design: under one
    shared uid (basic) the process cap is the uid's task count at the call's start plus the
    slot's allowance, so only its being finite compares."""
    state = json.loads(output)
    if mode == "basic":
        soft, hard = state["limits"].pop("nproc")
        assert 0 < soft == hard < 2**31, state
    return json.dumps(state, sort_keys=True)


def _differences(light: set[str], full: set[str]) -> dict[str, list[object]]:
    """The fields in which the states only the light zygote's calls saw differ from those only
    the full one's saw, with both sides' values: what a failure has to show."""
    a, b = [json.loads(x) for x in sorted(light)], [json.loads(x) for x in sorted(full)]
    keys = sorted({k for s in a + b for k in s if len({json.dumps(t.get(k), sort_keys=True) for t in a + b}) > 1})
    return {k: [[s.get(k) for s in a], [s.get(k) for s in b]] for k in keys}


def test_both_zygotes_give_their_calls_the_same_sandbox(svc):
    """The light zygote's children enter the sandbox by the same code as the full one's: the
    same ids, capabilities, filter, namespaces (IPC included), cgroup, mounts, environment,
    rlimits (the stack one included), descriptors and recursion cap; no host file either way."""
    mode, url, _ = svc
    before = readyz(url)[1]
    # each worker (slot) has its own uid, namespaces and directory: what the light zygote's
    # calls see on some worker, the full one's see on that worker. Light, full, full, light:
    # whichever way the server spreads calls over the workers, both kinds reach the same ones
    seen: dict[str, set[str]] = {"light": set(), "full": set()}
    for i in range(12):
        for zygote in ("light", "full", "full", "light"):
            r = _run(url, SANDBOX_STATE, zygote)
            assert r.outcome == "stdout", r
            seen[zygote].add(_comparable(r.output, mode))
        if i >= 2 and seen["light"] == seen["full"]:
            break
    assert seen["light"] == seen["full"], _differences(seen["light"] - seen["full"], seen["full"] - seen["light"])
    state = json.loads(sorted(seen["light"])[0])
    assert SECRET not in json.dumps(state) and state["recursion"] <= 100_000
    assert state["session_leader"] and state["listing"] == [] and state["fds"][:3] == [0, 1, 2], state
    assert len(state["fds"]) == 4, state  # and the result record's pipe
    if mode == "full" and os.geteuid() == 0:
        assert state["ns"]["ipc"] != os.readlink("/proc/self/ns/ipc") and state["ids"][0] != 0, state
    _healthy_after(url, before)


def test_calls_run_on_the_zygote_their_code_asks_for_and_a_stray_import_works(svc):
    """Only the full zygote's children start with numpy loaded. A call whose code slips past
    the scan and imports numpy anyway (here through ``warnings``, which imports a category's
    module by name) runs on the light zygote all the same: it merely imports numpy cold."""
    mode, url, _ = svc
    before = readyz(url)[1]
    witness = "import sys\ntable = sys\nprint(sum(k.endswith('_multiarray_umath') for k in table.modules))\n"
    for _ in range(2):  # whichever worker answers
        assert _run(url, witness, "light").output == "0\n"
        assert _run(url, witness, "full").output == "1\n"
    stray = "import warnings\nw = warnings._getcategory('nu' + 'mpy.exceptions.ComplexWarning')\nprint(w.__name__)\n"
    r = _run(url, stray + witness, "light")
    assert (r.outcome, r.output) == ("stdout", "ComplexWarning\n1\n"), r
    _healthy_after(url, before)


def _zygote_processes(worker_pids: list[int]) -> dict[str, list[int]]:
    """This service's zygotes by kind (only the full one maps numpy's extension).

    A zygote is named kuberl-ready for the moment it forks a child (the child is born with that
    name), so one look can miss it: the names are read a few times and the zygotes seen alive
    in any of them are kept."""
    seen: set[int] = set()
    for _ in range(5):
        seen |= {pid for pid, _, name in _service_processes(worker_pids) if name == "kuberl-zygote"}
        time.sleep(0.02)
    found: dict[str, list[int]] = {"light": [], "full": []}
    for pid in sorted(seen):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # dead, not yet reaped
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone since
            continue
        found["full" if "_multiarray_umath" in maps else "light"].append(pid)
    return found


def test_a_lost_light_zygote_costs_no_call():
    """Killed (out of memory, say), a light zygote costs no call: the full one forks every call
    from then on, in the same workers."""
    import signal

    mode = "full" if os.geteuid() == 0 else "basic"
    args = ["--isolation", mode]
    with running_sandbox(workers=2, limits=LIMITS, pool="lost-zygote", extra_args=args) as url:
        before = readyz(url)[1]
        assert before["protections"]["light_zygote"], before
        zygotes = _zygote_processes(before["worker_pids"])
        assert len(zygotes["light"]) == len(zygotes["full"]) == 2, zygotes
        for pid in zygotes["light"]:
            os.kill(pid, signal.SIGKILL)
        for _ in range(3):
            for zygote in ZYGOTES:
                r = _run(url, "print(6 * 7)", zygote)
                assert (r.outcome, r.output) == ("stdout", "42\n"), (zygote, r)
        _healthy_after(url, before)
        assert _zygote_processes(before["worker_pids"]) == {"light": [], "full": zygotes["full"]}
