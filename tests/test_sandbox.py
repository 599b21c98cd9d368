"""Sandbox service: outcomes, adversarial containment, exactly-once delivery, math-verify."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import aiohttp
import pytest

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.client import SandboxClient
from kuberl.sandbox.local import running_sandbox
from kuberl.sandbox.server import build_result, integer_fast_path
from kuberl.sandbox.types import ExecResult

LIMITS = SandboxLimits(timeout_seconds=1.5, memoryMB=256, max_output_bytes=1024, max_processes=16)


@pytest.fixture(scope="module")
def url():
    with running_sandbox(
        workers=2, limits=LIMITS, pool="test", extra_args=["--verify-timeout-seconds", "2"]
    ) as u:
        yield u


def run(coro):
    return asyncio.run(coro)


async def _exec(url: str, code: str, stdin: str = "") -> ExecResult:
    async with SandboxClient(url) as c:
        return await c.execute(code, stdin)


def _alive(url: str) -> None:
    r = run(_exec(url, "print('alive')"))
    assert (r.outcome, r.output) == ("stdout", "alive\n")


def _slot_processes(url: str) -> list[str]:
    """Processes of this service's slot uids (each service draws its own uid block)."""
    with urllib.request.urlopen(url + "/readyz") as resp:
        uids = set(json.loads(resp.read())["uids"])
    assert uids, "the slot uid drop is expected to be active on this machine"
    out = subprocess.run(["ps", "-eo", "uid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if int(ln.split()[0]) in uids]


# ---- pure parts -------------------------------------------------------------------------------


def test_exec_result_tool_response_and_flags():
    r = ExecResult("stdout", "x" * 10, True, 0.1)
    assert r.to_tool_response().endswith("[output truncated]") and not r.is_error
    assert ExecResult("timeout", "TimeoutError: execution exceeded 2 s", False, 2).is_error
    assert ExecResult.from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="unknown sandbox outcome"):
        ExecResult.from_json({"outcome": "bogus"})


def test_build_result_maps_every_outcome():
    assert build_result({"meta": {"status": "ok", "repr": None}, "stdout": "3\n"}, 2).outcome == "stdout"
    nos = build_result({"meta": {"status": "ok", "repr": "[1, 2]"}, "stdout": ""}, 2)
    assert (nos.outcome, nos.output) == ("no_stdout", "[1, 2]")
    assert build_result({"meta": {"status": "error", "traceback": "T"}}, 2).output == "T"
    t = build_result({"timed_out": True, "meta": {}}, 2)
    assert (t.outcome, t.output) == ("timeout", "TimeoutError: execution exceeded 2 s")
    assert build_result({"meta": {"status": "memory"}}, 2).outcome == "memory_limit"
    assert build_result({"meta": {}, "oom": True, "signal": 9}, 2).outcome == "memory_limit"
    killed = build_result({"meta": {}, "signal": 11}, 2)
    assert killed.outcome == "error" and "signal 11" in killed.output


def test_integer_fast_path():
    assert integer_fast_path("42", " 42 ") is True
    assert integer_fast_path("\\boxed{1,000}", "1000") is True
    assert integer_fast_path("-3", "3") is False
    assert integer_fast_path("1/2", "0.5") is None


# ---- service --------------------------------------------------------------------------------


def test_four_outcomes_and_stdin(url):
    async def go():
        async with SandboxClient(url) as c:
            return await asyncio.gather(
                c.execute("print(sum(range(5)))"),
                c.execute("import numpy as np\nnp.arange(3).sum()"),
                c.execute("x = 1\nx = 2"),
                c.execute("def f():\n    return 1/0\nf()"),
                c.execute("while True:\n    pass"),
                c.execute("a, b = map(int, input().split())\nprint(a * b)", "6 7\n"),
                c.execute("print('x' * 5000)"),
                c.execute("def broken(:\n    pass"),
            )

    out, npy, none, err, loop, stdin, big, syntax = run(go())
    assert (out.outcome, out.output) == ("stdout", "10\n")
    assert (npy.outcome, npy.output) == ("no_stdout", "np.int64(3)") or npy.output == "3"
    assert (none.outcome, none.output) == ("no_stdout", "")
    assert err.outcome == "error" and "ZeroDivisionError" in err.output and "line 2, in f" in err.output
    assert loop.outcome == "timeout" and "TimeoutError: execution exceeded 1.5 s" in loop.to_tool_response()
    assert 1.4 < loop.duration_s < 3.0
    assert (stdin.outcome, stdin.output) == ("stdout", "42\n")
    assert big.truncated and len(big.output) == LIMITS.max_output_bytes
    assert big.to_tool_response().endswith("[output truncated]")
    assert syntax.outcome == "error" and "SyntaxError" in syntax.output


def test_readyz_reports_protections_and_metrics(url):
    with urllib.request.urlopen(url + "/readyz") as resp:
        info = json.loads(resp.read())
    assert info["ready"] and info["workers"] == 2
    assert set(info["protections"]) >= {"cgroup_memory", "cgroup_pids", "uid", "seccomp", "namespaces"}
    _alive(url)
    with urllib.request.urlopen(url + "/metrics") as resp:
        text = resp.read().decode()
    assert 'kuberl_tool_calls_total{outcome="stdout",pool="test"}' in text
    assert 'kuberl_sandbox_queue_depth{pool="test"}' in text
    assert 'kuberl_sandbox_workers_busy{pool="test"}' in text
    assert "kuberl_tool_call_latency_seconds_bucket" in text


ADVERSARIAL = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "infinite_loop": "while True:\n    pass",
    "alloc_10gb": "x = bytearray(10 * 1024**3)",
    "alloc_gradual": "import numpy as np\nxs = []\nwhile True:\n    xs.append(np.ones(2**24))",
    "write_10gb": (
        "with open('big.bin', 'wb') as f:\n    for _ in range(10 * 1024):\n        f.write(b'0' * 2**20)"
    ),
    "signal_ignoring_threads": (
        "import signal, threading\n"
        "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
        "def spin():\n"
        "    while True:\n"
        "        pass\n"
        "for _ in range(4):\n"
        "    threading.Thread(target=spin).start()\n"
        "spin()"
    ),
    "setsid_double_fork_daemon": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            time.sleep(0.1)\n"
        "    os._exit(0)\n"
        "print('parent done')"
    ),
    "read_root": "print(open('/root/.bashrc').read())",
    "list_root": "import os\nprint(os.listdir('/root'))",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)",
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('still here')",
    "ptrace_parent": (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.ptrace(16, os.getppid(), 0, 0)\n"
        "print(r, ctypes.get_errno())"
    ),
}


EXPECTED_OUTCOMES = {
    "fork_bomb": {"error", "timeout"},
    "infinite_loop": {"timeout"},
    "alloc_10gb": {"memory_limit"},
    "alloc_gradual": {"memory_limit"},
    "write_10gb": {"error"},
    "signal_ignoring_threads": {"timeout"},
    "setsid_double_fork_daemon": {"stdout"},
    "read_root": {"error"},
    "list_root": {"stdout", "error"},
    "kill_parent": {"error"},
    "kill_everything": {"stdout", "error"},  # ESRCH: nothing else it may signal
    "ptrace_parent": {"stdout"},
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_is_contained_and_service_keeps_serving(url, name):
    r = run(_exec(url, ADVERSARIAL[name]))
    expected = EXPECTED_OUTCOMES[name]
    assert r.outcome in expected, r
    assert r.duration_s < LIMITS.timeout_seconds + 1.5
    if name == "write_10gb":
        assert "File too large" in r.output or "Errno 27" in r.output
    if name == "read_root":  # the home is hidden (namespaces) or unreadable (uid)
        assert "FileNotFoundError" in r.output or "PermissionError" in r.output
    if name == "list_root":
        assert ".bashrc" not in r.output and (r.outcome == "stdout" or "PermissionError" in r.output)
    if name == "kill_parent":
        assert "PermissionError" in r.output
    if name == "ptrace_parent":
        assert r.output.split()[0] == "-1"  # seccomp: EPERM
    # nothing of the call survives it (daemons, bomb children, spinning threads)
    deadline = time.monotonic() + 2
    while _slot_processes(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slot_processes(url) == []
    _alive(url)


def test_seccomp_filter_denies_sockets_and_namespaces(url):
    """The precompiled BPF filter is really installed in every call (not only reported)."""
    with urllib.request.urlopen(url + "/readyz") as resp:
        if not json.loads(resp.read())["protections"]["seccomp"]:
            pytest.skip("libseccomp is not available on this machine")
    code = (
        "import ctypes, os, socket\n"
        "try:\n    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n    print('inet created')\n"
        "except PermissionError as e:\n    print('inet', e.errno)\n"
        "a, b = socket.socketpair()\nprint('unix ok')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x40000000), ctypes.get_errno())\n"  # CLONE_NEWNET
        "print('nnp', open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
        "print('mode', open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
    )
    for _ in range(3):  # every call, not only the first one of a worker
        r = run(_exec(url, code))
        assert r.outcome == "stdout", r
        assert r.output.splitlines() == ["inet 1", "unix ok", "unshare -1 1", "nnp 1", "mode 2"], r.output


def test_no_network_even_to_loopback(url):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted: list[object] = []

    def accept():
        try:
            accepted.append(srv.accept())
        except OSError:
            pass

    th = threading.Thread(target=accept)
    th.start()
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    )
    r = run(_exec(url, code))
    th.join()
    srv.close()
    assert r.outcome == "error" and "connected" not in r.output, r
    assert accepted == []
    _alive(url)


def test_idempotent_retry_is_not_executed_twice(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"id": "same-id-1", "code": "import uuid\nprint(uuid.uuid4())"}
            outs = []
            for b in (body, body, dict(body, id="other-id")):
                async with s.post(url + "/v1/execute", json=b) as resp:
                    outs.append((await resp.json())["output"])
            return outs

    first, again, other = run(go())
    assert first == again and first != other


def test_bad_requests_get_clear_errors(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/execute", json={"stdin": "x"}) as r1:
                a = (r1.status, await r1.text())
            async with s.post(url + "/v1/execute", data=b"{nope") as r2:
                b = (r2.status, await r2.text())
            return a, b

    (s1, t1), (s2, t2) = run(go())
    assert s1 == 400 and "code" in t1
    assert s2 == 400 and "not JSON" in t2


def test_verify_math_and_hard_inputs_time_out(url):
    async def go():
        async with SandboxClient(url) as c:
            easy = await c.verify_batch([("\\frac{1}{2}", "0.5"), ("42", "42"), ("x+1", "1+x"), ("3", "4")])
            t = time.monotonic()
            hard = await c.verify("9^{9^{9}}", "9^{9^{9}}+1")
            return easy, hard, time.monotonic() - t

    easy, hard, took = run(go())
    assert easy == [True, True, True, False]
    assert hard is False and took < 4.5
    _alive(url)


def test_backpressure_and_exactly_once_under_overload():
    async def go(u):
        async with aiohttp.ClientSession() as s:

            async def raw(i):
                async with s.post(u + "/v1/execute", json={"code": "import time\ntime.sleep(0.05)"}) as r:
                    return r.status, r.headers.get("Retry-After")

            statuses = await asyncio.gather(*(raw(i) for i in range(30)))
        async with SandboxClient(u) as c:
            single = await asyncio.gather(*(c.execute(f"print({i})") for i in range(60)))
            batch = await c.execute_batch([("print(input())", str(i)) for i in range(120)])
        return statuses, single, batch

    with running_sandbox(workers=1, limits=LIMITS, extra_args=["--queue-limit", "4"]) as u:
        statuses, single, batch = run(go(u))
    assert any(st == 429 and ra for st, ra in statuses) and any(st == 200 for st, _ in statuses)
    assert [r.output for r in single] == [f"{i}\n" for i in range(60)]
    assert [r.output for r in batch] == [f"{i}\n" for i in range(120)]


# ---- basic isolation: what an unprivileged SandboxPool pod gets ----------------------------------


@pytest.fixture(scope="module")
def basic_url():
    with running_sandbox(workers=1, limits=LIMITS, pool="basic", extra_args=["--isolation", "basic"]) as u:
        yield u


def _descendants(roots: list[int]) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [ln.split(None, 2) for ln in out.splitlines()]
    found, frontier = [], set(roots)
    while frontier:
        kids = [r for r in rows if int(r[1]) in frontier]
        found += [" ".join(r) for r in kids]
        frontier = {int(r[0]) for r in kids}
    return found


# the corpus minus what needs a slot uid or a pids cgroup (fork bomb, signalling other uids)
BASIC_CORPUS = (
    "infinite_loop", "alloc_10gb", "alloc_gradual", "write_10gb", "signal_ignoring_threads",
    "setsid_double_fork_daemon",
)  # fmt: skip


def test_basic_isolation_reports_what_is_active(basic_url):
    with urllib.request.urlopen(basic_url + "/readyz") as resp:
        info = json.loads(resp.read())
    assert info["isolation"] == "basic" and info["uids"] == []
    prot = info["protections"]
    assert not (prot["uid"] or prot["cgroup_memory"] or prot["cgroup_pids"] or prot["namespaces"])
    assert prot["rlimits"] and prot["setsid"]


@pytest.mark.parametrize("name", BASIC_CORPUS)
def test_basic_isolation_contains_the_corpus_without_cgroups_or_uids(basic_url, name):
    """No cgroup and no slot uid: rlimits bound the call and the subreaper sweep kills what it
    leaves behind (here the daemon that setsid + double-forked away from the call)."""
    with urllib.request.urlopen(basic_url + "/readyz") as resp:
        workers = json.loads(resp.read())["worker_pids"]
    r = run(_exec(basic_url, ADVERSARIAL[name]))
    assert r.outcome in EXPECTED_OUTCOMES[name], r
    assert r.duration_s < LIMITS.timeout_seconds + 1.5
    assert _descendants(workers) == []
    _alive(basic_url)


def _leftovers(pool: str) -> list[str]:
    pattern = f"kuberl-sbx-{pool}-*"
    found = glob.glob(os.path.join(tempfile.gettempdir(), pattern))
    found += glob.glob(f"/sys/fs/cgroup/*/kuberl/{pattern}") + glob.glob(
        f"/sys/fs/cgroup/kuberl-sandbox/{pattern}"
    )
    return found


def test_stopping_the_service_leaves_no_slot_cgroups_or_directories():
    pool = f"leak{os.getpid()}"
    with running_sandbox(workers=2, limits=LIMITS, pool=pool) as u:
        _alive(u)
        assert _leftovers(pool), "the slots' scratch directories exist while serving"
    deadline = time.monotonic() + 10
    while _leftovers(pool) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(pool) == []
