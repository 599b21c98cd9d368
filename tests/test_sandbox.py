"""Sandbox service: outcomes, adversarial containment, exactly-once delivery, math-verify."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from sandbox_service import readyz, unprivileged_wrapper

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.config import ServiceConfig, WorkerConfig
from kuberl.sandbox.containment import landlock
from kuberl.sandbox.containment.slot import Slot
from kuberl.sandbox.service.client import SandboxClient
from kuberl.sandbox.service.idempotency import Conflict, ResultMemory, answer_size, payload_digest
from kuberl.sandbox.service.local import running_sandbox
from kuberl.sandbox.service.server import SandboxService, build_result, integer_fast_path
from kuberl.sandbox.service.workers import WorkerLost, WorkerProc, worker_cpus
from kuberl.sandbox.types import ExecResult

# diskMB above the 64 MB per-file limit (write_10gb meets that one) but small enough that
# write_many_files crosses it fast even on a busy disk
LIMITS = SandboxLimits(timeout_seconds=1.5, memoryMB=256, max_output_bytes=1024, max_processes=16, diskMB=96)


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


def _metric(url: str, prefix: str) -> float:
    """Sum of the samples whose name{labels} starts with ``prefix``."""
    with urllib.request.urlopen(url + "/metrics") as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix))


# what the corpus' daemons call themselves (prctl PR_SET_NAME), to find them wherever they went
MARKER = "kuberl-orphan"


def _marked_processes() -> list[str]:
    found = []
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as fh:
                if fh.read().strip() == MARKER:
                    found.append(comm.split("/")[2])
        except OSError:
            pass
    return found


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(task) as fh:
            kids += [int(k) for k in fh.read().split()]
    return kids


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[19])


def _zygotes(workers: list[int], per_worker: int) -> dict[int, int]:
    """Each worker's zygotes (its ``per_worker`` oldest children: they are forked before any
    call's child) -> their start times (not their names: a zygote is named kuberl-ready for
    the instant of each fork)."""
    found = {}
    for w in workers:
        started = {}
        for kid in _children(w):
            with contextlib.suppress(OSError):  # a call's process that just ended (ENOENT or ESRCH)
                started[kid] = _start_time(kid)
        for oldest in sorted(started, key=started.__getitem__)[:per_worker]:
            found[oldest] = started[oldest]
    return found


def _zygote_pids(url: str) -> set[int]:
    """The service's zygotes (host pids; a worker in a PID namespace is the child of
    ``unshare``, and the zygotes are its children)."""
    per_worker = 2 if readyz(url)[1]["protections"].get("light_zygote") else 1  # the full and the light one
    return set(_zygotes(_worker_pids(url), per_worker))


def _worker_pids(url: str) -> list[int]:
    """The service's workers in slot order (in a PID namespace: the child of ``unshare``)."""
    workers = []
    for pid in readyz(url)[1]["worker_pids"]:
        with open(f"/proc/{pid}/comm") as fh:
            workers.append(_children(pid)[0] if fh.read().strip() == "unshare" else pid)
    return workers


def _slot_cgroups(pool: str, controller: str = "pids") -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/{controller}/kuberl/kuberl-sbx-{pool}-*")


def _wait_until(check, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


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
    assert r.to_json() == dataclasses.asdict(r)  # every field, as the wire has always had them
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
    disk = build_result({"meta": {}, "signal": 9, "disk_exceeded_mb": 256, "stdout": "a\n"}, 2)
    assert (disk.outcome, disk.output) == (
        "error",
        "a\nOSError: disk quota exceeded: the call's files grew beyond 256 MB",
    )


def test_landlock_rights_follow_the_kernel_abi():
    assert landlock.handled_rights(0) == (0, 0)
    fs1, scoped1 = landlock.handled_rights(1)
    assert fs1 & landlock.WRITE_FILE and not fs1 & landlock.TRUNCATE and scoped1 == 0
    fs6, scoped6 = landlock.handled_rights(6)
    assert fs6 & landlock.TRUNCATE and fs6 & landlock.REFER and scoped6 & landlock.SCOPE_SIGNAL


def test_integer_fast_path():
    assert integer_fast_path("42", " 42 ") is True
    assert integer_fast_path("\\boxed{1,000}", "1000") is True
    assert integer_fast_path("-3", "3") is False
    assert integer_fast_path("1/2", "0.5") is None
    # beyond CPython's 4300-digit int() limit: compared as canonical digit strings
    assert integer_fast_path("1" * 5000, "42") is False
    assert integer_fast_path("+" + "9" * 6000, "0009" + "9" * 5999) is True
    assert integer_fast_path("-0", "0") is True and integer_fast_path("-007", "-7") is True
    assert integer_fast_path("-7", "7") is False


def test_result_memory_keys_digests_and_bounds():
    now = [0.0]
    mem = ResultMemory(max_entries=3, max_bytes=1000, ttl_s=10, clock=lambda: now[0])
    a = payload_digest({"op": "exec", "code": "print(1)"})
    b = payload_digest({"op": "exec", "code": "print(2)"})
    assert a != b and a == payload_digest({"code": "print(1)", "op": "exec"})
    mem.remember(("exec", "k1"), a, "A", 100)
    assert mem.recall(("exec", "k1"), a) == (True, "A")
    assert mem.recall(("verify", "k1"), a) == (False, None)  # another operation, another call
    with pytest.raises(Conflict, match="'k1' was already used for a different call"):
        mem.recall(("exec", "k1"), b)
    for i in range(3):  # count bound: the oldest goes
        mem.remember(("exec", f"n{i}"), a, i, 100)
    assert len(mem) == 3 and mem.recall(("exec", "k1"), a) == (False, None)
    mem.remember(("exec", "big"), a, "B", 900)  # byte bound
    assert mem.nbytes <= 1000 and mem.recall(("exec", "big"), a) == (True, "B")
    assert mem.recall(("exec", "n0"), a) == (False, None)
    now[0] = 11  # age bound
    assert mem.recall(("exec", "big"), a) == (False, None) and len(mem) == 0 and mem.nbytes == 0


def test_workers_keep_to_one_cpu_each_only_where_the_service_owns_its_cpus():
    """One worker per core (or a pod's exclusive cpuset): worker i on CPU i; more CPUs than
    workers (a shared node): no pinning."""
    assert worker_cpus(2, {0, 1}) == [0, 1]
    assert worker_cpus(4, {2, 3}) == [2, 3, 2, 3]  # more workers than CPUs: shared in turn
    assert worker_cpus(1, {5}) == [5]
    assert worker_cpus(2, set(range(64))) == [None, None]  # a pod with a quota on a big node
    assert worker_cpus(2, set()) == [None, None]


def test_a_worker_its_zygotes_and_its_calls_share_one_cpu(url):
    """The service here (2 workers) pins where the pure rule says; every process of a slot
    (worker, zygotes, the call) inherits the worker's CPU."""
    expected = worker_cpus(2, os.sched_getaffinity(0))
    workers = _worker_pids(url)
    for slot, worker in enumerate(workers):
        allowed = os.sched_getaffinity(worker)
        assert allowed == ({expected[slot]} if expected[slot] is not None else os.sched_getaffinity(0))
        for child in _children(worker):  # its zygotes and the children they forked ahead
            with contextlib.suppress(ProcessLookupError):
                assert os.sched_getaffinity(child) == allowed
    r = run(_exec(url, "import os\nprint(sorted(os.sched_getaffinity(0)))"))
    pinned = {str(sorted(os.sched_getaffinity(w))) for w in workers}
    assert r.outcome == "stdout" and r.output.strip() in pinned, r


def test_no_pin_workers_leaves_every_cpu():
    if None in worker_cpus(2, os.sched_getaffinity(0)):
        pytest.skip("more than 2 CPUs here: 2 workers would not be pinned anyway")
    with running_sandbox(workers=2, pool="nopin", extra_args=["--no-pin-workers"]) as u:
        assert all(os.sched_getaffinity(w) == os.sched_getaffinity(0) for w in _worker_pids(u))


def test_an_answers_size_is_what_it_holds():
    """What the result memory counts per answer: its texts' size in memory (wide characters
    count for more), measured without serialising it; anything else by its JSON."""
    small = answer_size({"outcome": "stdout", "output": "x", "truncated": False, "duration_s": 0.1})
    ascii_text = answer_size({"outcome": "stdout", "output": "x" * 10_000, "truncated": False, "duration_s": 0.1})
    wide_text = answer_size({"outcome": "stdout", "output": "\u5b57" * 10_000, "truncated": False, "duration_s": 0.1})
    assert small < 400 and ascii_text - small == 9_999 and wide_text > ascii_text + 10_000
    assert answer_size({"nested": ["x" * 5000]}) > 5000


def test_basic_isolation_as_root_drops_to_a_slot_uid_or_reports_no_process_cap():
    """As root RLIMIT_NPROC is ignored: a root worker in basic isolation uses a slot uid where
    other uids can run the interpreter, and otherwise says that calls have no process cap."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    for readable in (False, True):
        slot = Slot(WorkerConfig(slot=0, pool=f"unit{os.getpid()}", isolation="basic"), readable)
        try:
            prot = slot.protections
            assert not (prot["cgroup_pids"] or prot["cgroup_memory"])
            assert prot["uid"] is readable and prot["pids"] is readable
        finally:
            slot.remove()


class _FakeProc:
    """What the dispatcher looks at of a worker subprocess."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.pid = 0

    async def wait(self) -> int:
        while self.returncode is None:
            await asyncio.sleep(0.01)
        return self.returncode


class _FakeWorker:
    """Answers calls like a worker; dies on code 'die' after answering what came before it;
    fails to start ``start_failures`` times."""

    def __init__(self, start_failures: int) -> None:
        self.slot, self.up, self.pid, self.protections = 0, True, 0, {}
        self.proc = _FakeProc()
        self.start_failures = start_failures
        self.starts = self.stops = 0
        self.ran: list[str] = []

    async def run(self, calls, protect):
        for call in calls:
            await asyncio.sleep(0)
            if call["code"] == "die":
                self.proc.returncode = -9
                raise WorkerLost("sandbox worker died", blame=True)
            self.ran.append(call["code"])
            yield {"meta": {"status": "ok", "repr": None}, "stdout": f"{call['code']}\n"}

    async def stop(self, grace: float = 3.0) -> None:
        self.up = False
        self.stops += 1

    async def start(self, spawn_lock=None) -> None:
        self.starts += 1
        if self.starts <= self.start_failures:
            raise RuntimeError("cannot start")
        self.proc = _FakeProc()
        self.up = True


def test_dispatch_answers_every_call_of_a_batch_whose_worker_dies():
    """The dying call is answered with an error and not run again; the calls behind it run once
    more on the replacement; a replacement that fails to start is retried with backoff while
    the service reports not ready; no future is left unresolved."""

    async def go():
        svc = SandboxService(ServiceConfig(workers=1, batch_size=8))
        fake = _FakeWorker(start_failures=2)
        svc.workers = [fake]
        svc.ready = True
        futs = [svc.submit(("exec", f"c{i}"), {"op": "exec", "code": c, "stdin": "", "timeout": 1.0})
                for i, c in enumerate(["a", "die", "b", "c"])]  # fmt: skip
        loop_task = asyncio.create_task(svc._worker_loop(fake))  # noqa: SLF001
        await asyncio.sleep(0.05)
        ready_while_replacing = svc.is_ready()
        results = await asyncio.wait_for(asyncio.gather(*futs), 10)
        ready_after = svc.is_ready()
        loop_task.cancel()
        return results, ready_while_replacing, ready_after, fake

    results, ready_while_replacing, ready_after, fake = run(go())
    outcomes = [(r["outcome"], r["output"]) for r in results]
    assert outcomes[0] == ("stdout", "a\n") and outcomes[2:] == [("stdout", "b\n"), ("stdout", "c\n")]
    assert outcomes[1][0] == "error" and "died running this call" in outcomes[1][1]
    assert fake.ran == ["a", "b", "c"] and fake.starts == 3  # two failed starts, then up
    assert not ready_while_replacing and ready_after


def test_a_silent_worker_is_given_up_after_its_deadline_plus_margin():
    async def go():
        w = WorkerProc(0, ServiceConfig(workers=1, run_margin_s=0.2))
        w.proc = await asyncio.create_subprocess_exec(
            "sleep", "30", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        t = time.monotonic()
        try:
            with pytest.raises(WorkerLost, match="no answer within 0.3 s") as err:
                async for _ in w.run([{"op": "exec", "code": "1", "timeout": 0.1}], []):
                    pass
            return err.value.blame, time.monotonic() - t
        finally:
            await w.stop(grace=0)

    blame, took = run(go())
    assert blame and took < 2


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
    assert npy.outcome == "no_stdout" and npy.output in ("np.int64(3)", "3")  # numpy 2 / numpy 1 repr
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


# a call that makes itself dumpable (its /proc/self its own) and lowers its oom_score_adj
LOWER_OWN_OOM_SCORE = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "print(libc.prctl(4, 1, 0, 0, 0))\n"
    "try:\n"
    "    with open('/proc/self/oom_score_adj', 'w') as f:\n"
    "        f.write('0')\n"
    "    print('lowered')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)
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
        "    try:\n"
        "        os.setsid()\n"
        "    except OSError:  # (refused by the filter: a process group instead)\n"
        "        os.setpgid(0, 0)\n"
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
    # the worker's parent: the server (basic isolation) or nothing visible (PID namespace)
    "kill_server": (
        "import os, signal\n"
        "stat = open(f'/proc/{os.getppid()}/stat').read()\n"
        "server = int(stat[stat.rindex(')') + 2 :].split()[1]) or os.getppid()\n"
        "os.kill(server, signal.SIGKILL)\n"
        "print('killed', server)"
    ),
    "kill_worker_then_daemon": (
        "import ctypes, os, signal, time\n"
        "if os.fork() == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "    except OSError:  # (refused by the filter: a process group instead)\n"
        "        os.setpgid(0, 0)\n"
        f"    ctypes.CDLL(None).prctl(15, b'{MARKER}', 0, 0, 0)\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
        "time.sleep(0.1)\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
        "print('worker killed')"
    ),
    "signal_a_thread_id": (  # raw tgkill/tkill/kill at the parent, with junk in the upper 32 bits
        "import ctypes, os\n"
        "kill, tkill, tgkill = {'x86_64': (62, 200, 234), 'aarch64': (129, 130, 131)}[os.uname().machine]\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "p = os.getppid()\n"
        "L = ctypes.c_long\n"
        "print(libc.syscall(L(tgkill), L(p), L(p), L(9)), libc.syscall(L(tkill), L(p), L(9)),\n"
        "      libc.syscall(L(kill), L(p | (1 << 32)), L(9)), libc.syscall(L(kill), L(0xFFFFFFFF), L(9)),\n"
        "      ctypes.get_errno())"
    ),
    "sigkill_through_sigio": (
        "import fcntl, os, signal\n"
        "r, w = os.pipe()\n"
        "fcntl.fcntl(r, 10, signal.SIGKILL)\n"  # F_SETSIG
        "fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())\n"
        "print('owner set')"
    ),
    "read_parent_memory": "import os\nprint(open(f'/proc/{os.getppid()}/mem', 'rb'))",
    "write_outside_the_slot": (
        "import os, tempfile\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', os.path.dirname(os.getcwd())):\n"
        "    try:\n"
        "        with open(os.path.join(d, f'kuberl-escape-{os.getpid()}'), 'w') as f:\n"
        "            f.write('x')\n"
        "        print('escaped to', d)\n"
        "    except OSError as e:\n"
        "        print(d, type(e).__name__)"
    ),
    # the kernel reads fcntl's command and prctl's option as 32-bit: junk in the upper half of
    # the register must meet the same rule (F_SETSIG SIGKILL, F_SETOWN, PR_SET_DUMPABLE)
    "high_bits_in_32_bit_arguments": (
        "import ctypes, os\n"
        "fcntl_nr, prctl_nr = {'x86_64': (72, 157), 'aarch64': (25, 167)}[os.uname().machine]\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "L = ctypes.c_long\n"
        "r, w = os.pipe()\n"
        "print(libc.syscall(L(fcntl_nr), L(r), L((1 << 32) | 10), L(9)),\n"
        "      libc.syscall(L(fcntl_nr), L(r), L((1 << 32) | 8), L(os.getppid())),\n"
        "      libc.syscall(L(prctl_nr), L((1 << 32) | 4), L(1), L(0), L(0), L(0)))"
    ),
    # inode flags on the call's directory would outlive it where the directory does (basic)
    "chattr_own_directory": (
        "import array, fcntl, os\n"
        "fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
        "try:\n"
        "    fcntl.ioctl(fd, 0x40086602, array.array('l', [0x8 | 0x10000]))\n"
        "    print('set')\n"
        "except OSError as e:\n"
        "    print(e.errno)"
    ),
    # a session per process is a CPU share per process: fifteen would starve a concurrent call
    "setsid_per_process": (  # (the call's own process leads its session: a child tries)
        "import os\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "        os.write(w, b'new session')\n"
        "    except OSError as e:\n"
        "        os.write(w, str(e.errno).encode())\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "print(os.read(r, 100).decode())"
    ),
    "memfd_secret": (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.syscall(447, 0), ctypes.get_errno())"
    ),
    # a result record written by the call itself, far past the output limit, then no other
    "forged_huge_result_record": (
        "import json, os\n"
        "forged = json.dumps({'status': 'error', 'traceback': 'T' * 900000}).encode()\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, forged)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)"
    ),
    "lower_own_oom_score_then_blow_memory": (  # so that the OOM killer would pick a zygote
        LOWER_OWN_OOM_SCORE + "xs = []\n"
        "while True:\n"
        "    xs.append(bytearray(2**24))"
    ),
    "write_many_files": (  # each file under the per-file limit, 2.5 GB together (the quota stops it)
        "for i in range(40):\n"
        "    with open(f'f{i}.bin', 'wb') as f:\n"
        "        for _ in range(63):\n"
        "            f.write(b'0' * 2**20)\n"
        "print('wrote 2.5 GB')"
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
    "kill_everything": {"error"},  # seccomp: no negative pids
    "ptrace_parent": {"stdout"},
    "kill_server": {"error"},
    "kill_worker_then_daemon": {"error"},
    "signal_a_thread_id": {"stdout"},
    "sigkill_through_sigio": {"error"},
    "read_parent_memory": {"error"},
    "write_outside_the_slot": {"stdout"},
    "write_many_files": {"error"},
    "lower_own_oom_score_then_blow_memory": {"memory_limit"},
    "high_bits_in_32_bit_arguments": {"stdout"},
    "chattr_own_directory": {"stdout"},
    "setsid_per_process": {"stdout"},
    "memfd_secret": {"stdout"},
    "forged_huge_result_record": {"error"},
}


def _check_corpus_output(name: str, r: ExecResult, private_root: bool) -> None:
    """What each adversarial call must have been told (beyond its outcome), and what it must not
    have left on the host; ``private_root``: the call ran in one (full isolation)."""
    if name == "high_bits_in_32_bit_arguments":
        assert r.output.split() == ["-1", "-1", "-1"], r.output
    if name in ("chattr_own_directory", "setsid_per_process"):
        assert r.output.strip() == "1", r.output  # EPERM, from the filter
    if name == "memfd_secret":
        assert r.output.split() == ["-1", "1"], r.output
    if name == "forged_huge_result_record":
        assert r.truncated and len(r.output) <= LIMITS.max_output_bytes, (len(r.output), r.truncated)
    if name == "write_10gb":
        assert "File too large" in r.output or "Errno 27" in r.output
    if name == "read_root":  # the home is hidden (namespaces, or the unprivileged test wrapper) or unreadable
        assert "FileNotFoundError" in r.output or "PermissionError" in r.output
    if name == "list_root":
        assert ".bashrc" not in r.output and (r.outcome == "stdout" or "PermissionError" in r.output)
    if name in ("kill_parent", "kill_everything", "kill_server", "kill_worker_then_daemon"):
        # refused, or (a private root's /proc hides other uids' processes) not even found
        assert "PermissionError" in r.output or "FileNotFoundError" in r.output, r.output
    if name == "ptrace_parent":
        assert r.output.split()[0] == "-1"  # seccomp: EPERM
    if name == "signal_a_thread_id":
        assert r.output.split() == ["-1", "-1", "-1", "-1", "1"], r.output  # EPERM, upper bits ignored
    if name == "sigkill_through_sigio":
        assert "PermissionError" in r.output and "owner set" not in r.output
    if name == "read_parent_memory":  # refused, or hidden by a private root's /proc
        assert "PermissionError" in r.output or "FileNotFoundError" in r.output
    if name == "write_outside_the_slot":
        # no file reached the host's shared directories, whatever the call was told: under a
        # private root its /tmp and /dev/shm are its own scratch space, and writes there succeed
        assert not [p for d in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(d).glob("kuberl-escape-*")]
        if not private_root:  # Landlock: the call sees the host's directories, and is refused
            assert "escaped" not in r.output, r.output
    if name == "write_many_files":
        assert r.output == "OSError: disk quota exceeded: the call's files grew beyond 96 MB", r.output


def _server_uid(info: dict) -> int:
    """From /proc/PID/status: the server is not dumpable, so /proc/PID belongs to root."""
    with open(f"/proc/{info['server_pid']}/status") as fh:
        return int(next(ln for ln in fh if ln.startswith("Uid:")).split()[1])


def _skip_unless_protected(name: str, info: dict) -> None:
    protections = info["protections"]
    # writes are confined by Landlock's ruleset, or by a private root whose /tmp is the call's own
    if name == "write_outside_the_slot" and not (protections["landlock"] or protections["private_root"]):
        pytest.skip("neither Landlock nor a private root here: writes are not confined to the slot directory")
    if name == "fork_bomb" and not protections["pids"]:
        pytest.skip("no per-call process cap here (root without a slot uid or a pids cgroup), as reported")
    root_calls = _server_uid(info) == 0 and not protections["uid"]
    if name in ("read_parent_memory", "read_root", "list_root") and root_calls:
        pytest.skip("calls run as root here: root may read what it likes")


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_is_contained_and_service_keeps_serving(url, name):
    info = readyz(url)[1]
    _skip_unless_protected(name, info)
    zygotes = _zygote_pids(url)
    r = run(_exec(url, ADVERSARIAL[name]))
    assert r.outcome in EXPECTED_OUTCOMES[name], r
    assert r.duration_s < LIMITS.timeout_seconds + 1.5
    _check_corpus_output(name, r, info["protections"]["private_root"])
    # nothing of the call survives it (daemons, bomb children, spinning threads)
    _wait_until(lambda: not _slot_processes(url) and not _marked_processes(), 2)
    assert _slot_processes(url) == [] and _marked_processes() == []
    assert readyz(url)[1]["worker_restarts"] == 0
    # the zygotes share the slot's cgroup with the calls (cgroup v1): the out-of-memory killer,
    # a fork bomb and a kill of everything must still take only the call
    assert _zygote_pids(url) == zygotes
    _alive(url)


def test_a_call_is_first_for_the_oom_killer_and_cannot_change_that(url):
    """Zygotes may share a call's memory cgroup: the call's oom_score_adj is 1000, and it cannot
    lower it (its /proc/self is root's, and seccomp refuses PR_SET_DUMPABLE)."""
    if not readyz(url)[1]["protections"]["uid"]:
        pytest.skip("calls keep the service's uid here")
    code = LOWER_OWN_OOM_SCORE + "print(open('/proc/self/oom_score_adj').read().strip())\n"
    r = run(_exec(url, code))
    assert (r.outcome, r.output.split()) == ("stdout", ["-1", "PermissionError", "1000"]), r


FORK_FALLS_THROUGH = (
    "import os\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    print('child')\n"
    "else:\n"
    "    os.waitpid(pid, 0)\n"
    "    print('parent')\n"
)
FORKED_CHILD_RAISES = (
    "import os\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    raise ValueError('only the child')\n"
    "os.waitpid(pid, 0)\n"
    "print('parent')\n"
)
THREAD_POOL = (
    "from concurrent.futures import ThreadPoolExecutor\n"
    "with ThreadPoolExecutor(8) as ex:\n"
    "    print(sum(ex.map(lambda x: x * x, range(100))))\n"
)


@pytest.mark.parametrize(
    ("code", "output"),
    [(FORK_FALLS_THROUGH, "child\nparent\n"), (FORKED_CHILD_RAISES, "parent\n"), (THREAD_POOL, "328350\n")],
    ids=["fork_falls_through", "forked_child_raises", "thread_pool"],
)
def test_ordinary_code_that_forks_or_starts_threads_works(url, code, output):
    """A fork that comes back out of the code ends like a script's fork (it writes no result
    record of its own); eight threads fit under the memory limit (one malloc arena per thread
    would reserve 64 MiB each)."""
    r = run(_exec(url, code))
    assert (r.outcome, r.output) == ("stdout", output), r


THREAD_THEN_FORK = (
    "import os, threading, time\n"
    "stop = threading.Event()\n"
    "t = threading.Thread(target=stop.wait)\n"
    "t.start()\n"
    "r, w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    t.join(5)\n"  # the thread did not survive the fork: joining it returns at once
    "    os.write(w, f'{threading.active_count()} {t.is_alive()}'.encode())\n"
    "    os._exit(0)\n"
    "os.close(w)\n"
    "print(os.read(r, 100).decode())\n"
    "stop.set()\n"
)


def test_a_call_that_forks_beside_a_thread_gets_pythons_own_fork_repairs(url):
    """The zygote's children skip threading's after-fork hook (the zygote has one thread); a
    call's own fork gets it back: in the grandchild only the forking thread is alive."""
    r = run(_exec(url, THREAD_THEN_FORK))
    assert (r.outcome, r.output) == ("stdout", "1 False\n"), r


def test_every_call_draws_its_own_random_numbers(url):
    """random is reseeded in every call's process (its after-fork hook, run as the C method)."""
    code = "import random\nprint(random.getrandbits(64), random.gauss(0, 1), random.random())"
    outputs = [run(_exec(url, code)).output for _ in range(6)]
    assert len(set(outputs)) == 6, outputs


def test_a_calls_standard_streams_are_what_a_script_on_pipes_gets(url):
    """The text streams are made once in the zygote (while 1 and 2 are pipes, as in a call):
    stdout and stderr are not seekable, stdin (a memfd with the call's input) is."""
    code = (
        "import sys\n"
        "print(sys.stdout.seekable(), sys.stderr.seekable(), sys.stdin.seekable(), sys.stdin.read(),"
        " sys.stdout.encoding.lower(), sys.stdout.line_buffering)\n"
    )
    r = run(_exec(url, code, stdin="fed"))
    assert (r.outcome, r.output) == ("stdout", "False False True fed utf-8 False\n"), r


def test_calls_are_born_in_the_slot_cgroup_with_their_whole_process_cap(url):
    """Where the zygotes live in the slot's cgroup (v1, as root), a call's child is born there
    and joins nothing; the zygotes and the child forked ahead by the other one do not count
    against the call's maxProcesses: it can start exactly maxProcesses - 1 more."""
    info = readyz(url)[1]
    if not (info["protections"]["cgroup_pids"] and info["protections"]["uid"]):
        pytest.skip("no pids cgroup and slot uid here")
    inside = set()
    for cg in _slot_cgroups("test"):
        with open(f"{cg}/cgroup.procs") as fh:
            inside |= {int(p) for p in fh.read().split()}
    zygotes = _zygote_pids(url)
    if not zygotes <= inside:
        pytest.skip("the zygotes stay outside the slots' cgroups here (cgroup v2, or no v1 pids)")
    code = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    for _ in range(4):  # whichever slot (and zygote) answers
        r = run(_exec(url, code))
        assert r.outcome == "stdout", r
        assert int(r.output) == LIMITS.max_processes - 1, r
    _wait_until(lambda: not _slot_processes(url), 2)
    assert _slot_processes(url) == [] and _zygote_pids(url) == zygotes
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


def test_an_id_is_one_call_of_one_operation(url):
    """Keys are (operation, id) plus the payload's digest: a reused id with other code is a 409,
    not somebody else's answer, and a verify never answers with an execute's result."""

    async def go():
        async with aiohttp.ClientSession() as s:

            async def post(path, body):
                async with s.post(url + path, json=body) as resp:
                    return resp.status, await resp.json()

            return [
                await post("/v1/execute", {"id": "k-op", "code": "print('a')"}),
                await post("/v1/execute", {"id": "k-op", "code": "print('b')"}),
                await post("/v1/verify", {"id": "k-op", "prediction": "1/2", "gold": "3"}),
                await post("/v1/verify", {"id": "k-op", "prediction": "1/2", "gold": "3"}),
                await post("/v1/verify", {"id": "k-op", "prediction": "1/2", "gold": "0.5"}),
                await post(
                    "/v1/execute_batch",  # one conflicting id refuses the whole batch, runs nothing
                    {"calls": [{"id": "k-new", "code": "print('c')"}, {"id": "k-op", "code": "print('d')"}]},
                ),
                await post(
                    "/v1/execute_batch",
                    {"calls": [{"id": "k-twice", "code": "1"}, {"id": "k-twice", "code": "2"}]},
                ),
                await post("/v1/execute", {"id": "k-new", "code": "print('e')"}),
            ]

    first, other_code, verify, verify_again, other_pair, batch, twice, later = run(go())
    assert first[0] == 200 and first[1]["output"] == "a\n"
    assert (
        other_code[0] == 409
        and "'k-op' was already used for a different call" in other_code[1]["conflicts"][0]
    )
    assert verify == verify_again == (200, {"correct": False, "timed_out": False})
    assert other_pair[0] == 409
    assert batch[0] == 409 and len(batch[1]["conflicts"]) == 1
    assert twice[0] == 409 and "appears twice" in twice[1]["conflicts"][0]
    assert later[0] == 200 and later[1]["output"] == "e\n"  # k-new had not run with the refused batch

    async def client_sees_conflict():
        async with SandboxClient(url) as c:
            return await c._post("/v1/execute", {"id": "k-op", "code": "print('z')"}, 10)  # noqa: SLF001

    with pytest.raises(Exception, match="409"):
        run(client_sees_conflict())


def test_exactly_once_under_duplicates_and_retries(url):
    """500 calls, 150 of them sent a second time while in flight and 50 after their first
    response was dropped: every id gets one answer, the same one every time, and the service
    executes 500 calls, not 700."""
    code = "import uuid\nprint(uuid.uuid4())"
    ids = [f"burst-{os.getpid()}-{i}" for i in range(500)]
    rng = random.Random(7)
    dup, dropped = set(rng.sample(ids, 150)), set(rng.sample(ids, 50))
    before = _metric(url, 'kuberl_tool_calls_total{outcome="stdout",pool="test"}')

    async def go():
        answers: dict[str, list[str]] = {i: [] for i in ids}
        async with aiohttp.ClientSession() as s:

            async def batch(part):
                body = {"calls": [{"id": i, "code": code} for i in part]}
                while True:
                    async with s.post(url + "/v1/execute_batch", json=body) as resp:
                        if resp.status == 429:
                            await asyncio.sleep(0.05)
                            continue
                        assert resp.status == 200, await resp.text()
                        for i, r in zip(part, (await resp.json())["results"], strict=True):
                            answers[i].append(r["output"])
                        return

            async def drop_then_retry(i):
                # the whole request reaches the server, then the connection is gone: the
                # response is lost, as when a pod's connection breaks mid-call
                host, port = url.removeprefix("http://").split(":")
                payload = json.dumps({"id": i, "code": code}).encode()
                _, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                writer.close()
                await asyncio.sleep(rng.random() * 0.05)  # retry while it runs or after it ran
                await batch([i])

            chunks = [ids[k : k + 25] for k in range(0, len(ids), 25)]
            await asyncio.gather(
                *(batch(c) for c in chunks),
                *(batch([i]) for i in sorted(dup)),
                *(drop_then_retry(i) for i in sorted(dropped)),
            )
        return answers

    answers = run(go())
    for i in ids:
        expected = 1 + (i in dup) + (i in dropped)
        assert len(answers[i]) == expected and len(set(answers[i])) == 1, (i, answers[i])
    assert len({a[0] for a in answers.values()}) == 500  # 500 different executions
    assert _metric(url, 'kuberl_tool_calls_total{outcome="stdout",pool="test"}') - before == 500


def test_bad_requests_get_clear_errors(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/execute", json={"stdin": "x"}) as r1:
                a = (r1.status, await r1.text())
            async with s.post(url + "/v1/execute", data=b"{nope") as r2:
                b = (r2.status, await r2.text())
            deadlines = []
            for raw in (b"NaN", b"Infinity", b"true", b"-1", b"0", b'"5"'):
                body = b'{"code": "print(1)", "timeout": ' + raw + b"}"
                async with s.post(url + "/v1/execute", data=body) as r3:
                    deadlines.append((raw, r3.status, await r3.text()))
            return a, b, deadlines

    (s1, t1), (s2, t2), deadlines = run(go())
    assert s1 == 400 and "code" in t1
    assert s2 == 400 and "not JSON" in t2
    for raw, status, text in deadlines:  # never a call without a deadline, nor one of 1 s from `true`
        assert status == 400 and "'timeout' must be a positive number of seconds" in text, (raw, text)


def test_deeply_nested_json_gets_a_400_and_the_service_stays_healthy(url):
    """Nesting past the parser's recursion limit (a few hundred KB of '[[[[') or past the
    front's own bound is a client's error: a 400 that says so, on every route, and the next
    call still runs. A body nested within the bound is served."""
    deep = 200_000
    bodies = {
        "/v1/execute": [b"[" * deep + b"]" * deep, b'{"a":' * 5000 + b"1" + b"}" * 5000],
        "/v1/execute_batch": [b'{"calls": [' + b"[" * deep + b"]" * deep + b"]}"],
        "/v1/verify": [b'{"prediction": "1", "gold": "1", "id": ' + b"[" * 40 + b"]" * 40 + b"}"],
    }
    ok_body = b'{"code": "print(7)", "extra": ' + b"[" * 20 + b"]" * 20 + b"}"

    async def go():
        async with aiohttp.ClientSession() as s:
            answers = []
            for route, datas in bodies.items():
                for data in datas:
                    async with s.post(url + route, data=data) as r:
                        answers.append((route, len(data), r.status, await r.text()))
            async with s.post(url + "/v1/execute", data=ok_body) as r:
                ok = (r.status, await r.json())
            async with s.get(url + "/healthz") as r:
                health = r.status
            return answers, ok, health

    answers, (ok_status, ok), health = run(go())
    for route, size, status, text in answers:
        assert status == 400 and "nests arrays or objects deeper than" in text, (route, size, status, text)
    assert ok_status == 200 and ok["output"] == "7\n", ok
    assert health == 200


def test_verify_math_and_hard_inputs_time_out(url):
    """2^(10^9) vs 3^(10^8) keeps math-verify busy far beyond the 2 s verify deadline of the
    fixture: only the worker's outer kill ends it (math-verify's own alarms are off), so the
    answer comes at the deadline, flagged as a timeout, and is counted as one."""

    def counts() -> list[float]:
        prefix = 'kuberl_sandbox_verify_calls_total{{outcome="{}",pool="test"}}'
        return [_metric(url, prefix.format(o)) for o in ("correct", "wrong", "timeout")]

    before = counts()

    async def go():
        async with SandboxClient(url) as c:
            easy = await c.verify_batch([("\\frac{1}{2}", "0.5"), ("42", "42"), ("x+1", "1+x"), ("3", "4")])
        async with aiohttp.ClientSession() as s:
            t = time.monotonic()
            async with s.post(
                url + "/v1/verify", json={"prediction": "2^{10^{9}}", "gold": "3^{10^{8}}"}
            ) as r:
                hard = (r.status, await r.json())
            return easy, hard, time.monotonic() - t

    easy, hard, took = run(go())
    assert easy == [True, True, True, False]
    assert hard == (200, {"correct": False, "timed_out": True})
    assert 1.9 < took < 4.0, took  # the 2 s deadline, not math-verify's 5 s alarms
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [3, 1, 1]  # correct, wrong, timeout
    _alive(url)


def test_verify_long_integers_and_a_bad_pair_do_not_fail_the_batch(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            pairs = [
                {"prediction": "1" * 5000, "gold": "42"},
                {"prediction": "7" * 6000, "gold": "+" + "7" * 6000},
                {"prediction": "\\frac{", "gold": "1"},
                {"prediction": "1", "gold": "1"},
            ]
            async with s.post(url + "/v1/verify_batch", json={"pairs": pairs}) as r:
                batch = (r.status, await r.json())
            async with s.post(url + "/v1/verify", json=pairs[0]) as r:
                single = (r.status, await r.json())
            return batch, single

    batch, single = run(go())
    assert batch == (200, {"correct": [False, True, False, True], "timed_out": [False] * 4})
    assert single == (200, {"correct": False, "timed_out": False})


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


# Run as root, the wrapper gives the service what a SandboxPool pod has: a non-root uid shared
# by the server, its workers and every call. The interpreter sits in a 0700 home here, so the
# wrapper first replaces that home with a tmpfs re-exposing only the interpreter (in a private
# mount namespace, the worker's own helper), then drops to a uid of its own with setpriv.
@pytest.fixture(scope="module")
def basic_url():
    wrapper = unprivileged_wrapper()
    with running_sandbox(
        workers=1, limits=LIMITS, pool="basic", extra_args=["--isolation", "basic"], wrapper=wrapper or []
    ) as u:
        yield u


def _descendants(roots: list[int]) -> list[str]:
    """Processes below ``roots``, but a worker's idle child forked ahead for its next call and
    its zygote (which forks those children)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,comm=,args="], capture_output=True, text=True).stdout
    rows = [ln.split(None, 3) for ln in out.splitlines()]
    workers = {int(r[0]) for r in rows if len(r) == 4 and "kuberl.sandbox.process.worker" in r[3]}
    ready = {int(r[0]) for r in rows if r[2] in ("kuberl-ready", "kuberl-zygote") and int(r[1]) in workers}
    found, frontier = [], set(roots)
    while frontier:
        kids = [r for r in rows if int(r[1]) in frontier and int(r[0]) not in ready]
        found += [" ".join(r) for r in kids]
        frontier = {int(r[0]) for r in kids}
    return found


# the whole corpus: without namespaces, cgroups or slot uids the seccomp filter keeps the server
# and workers out of reach, Landlock confines writes, the disk watch bounds them, RLIMIT_NPROC on
# the shared uid caps processes and the subreaper sweeps kill what a call leaves behind
BASIC_CORPUS = tuple(sorted(ADVERSARIAL))


def test_basic_isolation_reports_what_is_active(basic_url):
    info = readyz(basic_url)[1]
    assert info["isolation"] == "basic" and info["uids"] == []
    prot = info["protections"]
    assert not (prot["cgroup_memory"] or prot["cgroup_pids"] or prot["namespaces"])
    assert prot["rlimits"] and prot["setsid"] and prot["disk_quota"]
    if _server_uid(info) != 0:  # what a pod gets: the shared non-root uid carries the process cap
        assert prot["pids"] and not prot["uid"]


@pytest.mark.parametrize("name", BASIC_CORPUS)
def test_basic_isolation_contains_the_corpus_without_cgroups_or_uids(basic_url, name):
    """No cgroup, no slot uid, one uid for server, workers and calls (as in a pod): the call
    is bounded, nothing it started survives it, the server and worker live on."""
    status, info = readyz(basic_url)
    assert status == 200
    _skip_unless_protected(name, info)
    r = run(_exec(basic_url, ADVERSARIAL[name]))
    assert r.outcome in EXPECTED_OUTCOMES[name], r
    assert r.duration_s < LIMITS.timeout_seconds + 1.5
    _check_corpus_output(name, r, info["protections"]["private_root"])
    _wait_until(lambda: not _marked_processes() and not _descendants(info["worker_pids"]), 2)
    assert _descendants(info["worker_pids"]) == [] and _marked_processes() == []
    after = readyz(basic_url)
    assert after[0] == 200 and after[1]["worker_pids"] == info["worker_pids"], after
    assert after[1]["server_pid"] == info["server_pid"] and after[1]["worker_restarts"] == 0
    _alive(basic_url)


def test_basic_isolation_leaves_a_call_its_own_signals(basic_url):
    """The kill guard is aimed at the service's pids, not at signals as such."""
    code = (
        "import os, signal, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "os.kill(pid, signal.SIGKILL)\n"
        "print(os.waitpid(pid, 0)[1] & 0x7F)\n"
        "os.kill(os.getpid(), 0)\n"
        "os.kill(0, 0)\n"  # its own process group
        "print('ok')"
    )
    r = run(_exec(basic_url, code))
    assert (r.outcome, r.output) == ("stdout", "9\nok\n"), r


def test_basic_isolation_a_call_cannot_signal_the_zygotes(basic_url):
    """Calls share the service's uid here: the filter refuses signals to every worker's zygote
    (its own pid and the pids from the workers' hellos), which would otherwise stop the worker
    forking calls. Where Landlock scopes signals (kernel >= 6.12) that holds twice."""
    info = readyz(basic_url)[1]
    per_worker = 2 if info["protections"].get("light_zygote") else 1  # the full and the light one
    zygotes = _zygotes(info["worker_pids"], per_worker)
    assert len(zygotes) == per_worker * len(info["worker_pids"])
    code = (
        "import os, signal\n"
        f"for pid in {sorted(zygotes)!r}:\n"
        "    for sig in (signal.SIGKILL, signal.SIGSTOP):\n"
        "        try:\n"
        "            os.kill(pid, sig)\n"
        "            print('signalled', pid)\n"
        "        except OSError as e:\n"
        "            print(type(e).__name__)\n"
    )
    r = run(_exec(basic_url, code))
    assert r.outcome == "stdout" and "signalled" not in r.output, r
    _alive(basic_url)
    assert _zygotes(info["worker_pids"], per_worker) == zygotes  # the same processes, still there
    assert readyz(basic_url)[1]["worker_restarts"] == info["worker_restarts"]


def test_a_lost_worker_is_replaced_its_orphans_killed_and_its_batch_answered(basic_url):
    """The worker dies (SIGKILL from outside) while a call that left a setsid daemon runs: that
    call gets an error, the two calls batched behind it run on the replacement, /readyz says 503
    until it is up, and the server (a subreaper) killed the daemon the dead worker left."""
    status, info = readyz(basic_url)
    assert status == 200
    (worker,) = info["worker_pids"]
    culprit = (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "    except OSError:  # (refused by the filter: a process group instead)\n"
        "        os.setpgid(0, 0)\n"
        f"    ctypes.CDLL(None).prctl(15, b'{MARKER}', 0, 0, 0)\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
        "time.sleep(30)"
    )
    seen: list[int] = []

    def kill_worker_when_the_daemon_is_up():
        _wait_until(lambda: bool(_marked_processes()), 10)
        os.kill(worker, signal.SIGKILL)
        _wait_until(lambda: readyz(basic_url)[0] == 503, 5)
        seen.append(readyz(basic_url)[0])

    killer = threading.Thread(target=kill_worker_when_the_daemon_is_up)
    killer.start()

    async def go():
        async with SandboxClient(basic_url) as c:  # one request: the three calls form one batch
            return await c.execute_batch([(culprit, ""), ("print(1)", ""), ("print(2)", "")])

    first, second, third = run(go())
    killer.join()
    assert first.outcome == "error" and "sandbox worker died running this call" in first.output, first
    assert [(r.outcome, r.output) for r in (second, third)] == [("stdout", "1\n"), ("stdout", "2\n")]
    assert seen == [503]
    _wait_until(lambda: not _marked_processes(), 5)
    assert _marked_processes() == []
    _wait_until(lambda: readyz(basic_url)[0] == 200, 30)
    status, after = readyz(basic_url)
    assert status == 200 and after["worker_restarts"] == 1 and after["worker_pids"] != [worker]
    assert after["server_pid"] == info["server_pid"]
    # the call that was running (orphaned with its worker) is gone too: the server has only its worker
    assert [int(row.split()[0]) for row in _descendants([info["server_pid"]])] == after["worker_pids"]
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


def test_sandbox_pod_tmp_holds_every_workers_disk_quota():
    """The pod's /tmp emptyDir (where the slots live) must outgrow what all workers' calls may
    write, or one busy pod is evicted for its emptyDir instead of a call being killed."""
    from kuberl.api import SandboxPool
    from kuberl.operator.render.builders import build_for

    pool = SandboxPool.model_validate(
        {"metadata": {"name": "tools"}, "spec": {"workersPerPod": 16, "limits": {"diskMB": 512}}}
    )
    dep = next(o for o in build_for(pool) if o["kind"] == "Deployment")
    tmp = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tmp")
    assert int(tmp["emptyDir"]["sizeLimit"].removesuffix("Mi")) >= 16 * 512 + 128
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["KUBERL_SANDBOX_LIMITS"])["diskMB"] == 512  # what the workers enforce


def test_sandbox_pool_runtime_class_reaches_the_pods_and_bad_names_are_refused():
    """spec.runtimeClassName (gVisor, Kata) is the pods' RuntimeClass; a name Kubernetes would
    refuse is refused here, naming the field."""
    from pydantic import ValidationError

    from kuberl.api import SandboxPool
    from kuberl.operator.render.builders import build_for

    def pod_spec(spec: dict) -> dict:
        pool = SandboxPool.model_validate({"metadata": {"name": "tools"}, "spec": spec})
        dep = next(o for o in build_for(pool) if o["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]

    assert pod_spec({"runtimeClassName": "gvisor"})["runtimeClassName"] == "gvisor"
    assert "runtimeClassName" not in pod_spec({})
    with pytest.raises(ValidationError, match="runtimeClassName"):
        pod_spec({"runtimeClassName": "gVisor!"})


MEMFD = (
    "import os\n"
    "try:\n"
    "    fd = os.memfd_create('m')\n"
    "    os.write(fd, b'x')\n"
    "    print('memfd')\n"
    "except OSError as e:\n"
    "    print(e.errno)\n"
)


def test_memfd_only_where_a_memory_cgroup_counts_it(url, basic_url):
    """memfd pages are counted by a memory cgroup, not by RLIMIT_AS (a memfd closed after a
    one-page mapping holds all its pages): without a memory cgroup the filter refuses it."""
    full = readyz(url)[1]["protections"]["cgroup_memory"]
    assert run(_exec(url, MEMFD)).output == ("memfd\n" if full else "1\n")
    assert not readyz(basic_url)[1]["protections"]["cgroup_memory"]
    assert run(_exec(basic_url, MEMFD)).output == "1\n"
