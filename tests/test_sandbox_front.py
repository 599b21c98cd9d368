"""The sandbox's HTTP front under abuse: bodies too large, bodies and heads that never finish,
more connections than it allows; in full isolation (root) and basic (a non-root uid whose
open-file soft limit is 1,024, as in a pod)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import selectors
import shutil
import socket
import threading
import time
import urllib.parse

import pytest

from kuberl.api.sandbox_pool import SandboxLimits
from kuberl.sandbox.service.client import SandboxClient
from kuberl.sandbox.service.local import running_sandbox
from tests.sandbox_helpers import readyz, unprivileged_wrapper

LIMITS = SandboxLimits(timeout_seconds=5, memoryMB=256, maxCodeKB=64, maxStdinKB=64, maxRequestMB=4)
BODY_TIMEOUT, IDLE_TIMEOUT = 2.0, 3.0
FRONT = ["--body-timeout", str(BODY_TIMEOUT), "--idle-timeout", str(IDLE_TIMEOUT)]


def _service(mode: str, extra: list[str] | None = None):
    wrapper: list[str] = []
    if mode == "basic":
        found = unprivileged_wrapper()
        if found is None:
            pytest.skip("cannot run the service as a non-root uid here")
        prlimit = shutil.which("prlimit")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # a pod's default: 1,024 open files unless the service raises its own soft limit
        wrapper = ([prlimit, f"--nofile=1024:{hard}"] if prlimit else []) + found
    return running_sandbox(
        workers=2, limits=LIMITS, pool=f"front-{mode}", wrapper=wrapper,
        extra_args=["--isolation", mode, *FRONT, *(extra or [])],
    )  # fmt: skip


@pytest.fixture(scope="module", params=["full", "basic"])
def svc(request):
    with _service(request.param) as url:
        yield request.param, url


def _addr(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def _request_head(path: str, length: int | None, chunked: bool = False, close: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
    if close:
        head += "Connection: close\r\n"
    if chunked:
        head += "Transfer-Encoding: chunked\r\n"
    elif length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def _answer(sock: socket.socket, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """(status, what was read) once a whole response has arrived, the server closed the
    connection, or ``timeout`` passed."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while not _complete(data) and (chunk := sock.recv(65536)):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, data


def _status_of(sock: socket.socket) -> int | None:
    return _answer(sock)[0]


def _post(url: str, path: str, payload: dict) -> tuple[int | None, bytes]:
    body = json.dumps(payload).encode()
    with socket.create_connection(_addr(url), timeout=10) as s:
        s.sendall(_request_head(path, len(body), close=True) + body)
        return _answer(s)


def _rss_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing for pid {pid}")


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/execute", "/v1/execute_batch", "/v1/verify", "/v1/verify_batch"])
def test_a_body_over_the_limit_is_refused_from_its_length_before_it_is_read(svc, path):
    _, url = svc
    with socket.create_connection(_addr(url), timeout=10) as s:
        s.sendall(_request_head(path, 200 * 2**20) + b'{"code": "')  # 200 MiB announced, 10 bytes sent
        t = time.perf_counter()
        status, data = _answer(s)
    assert status == 413, data[:300]
    assert b"maxRequestMB (4)" in data and time.perf_counter() - t < 5


def test_a_chunked_body_is_cut_at_the_limit(svc):
    _, url = svc
    with socket.create_connection(_addr(url), timeout=10) as s:
        s.sendall(_request_head("/v1/execute", None, chunked=True))
        chunk = b"x" * 2**20
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(8):  # 8 MiB offered, 4 allowed
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, data = _answer(s)
    assert status == 413, data[:300]


@pytest.mark.parametrize(("field", "setting"), [("code", "maxCodeKB"), ("stdin", "maxStdinKB")])
def test_code_or_stdin_over_its_limit_is_refused_naming_the_field(svc, field, setting):
    _, url = svc
    call = {"code": "print(1)", "stdin": "", field: "é" * 40_000}  # 80,000 bytes of UTF-8 > 64 KiB
    status, data = _post(url, "/v1/execute", call)
    assert status == 413 and f"'{field}' is 80000 bytes, over the pool's limits.{setting} (64 KiB)".encode() in data
    status, data = _post(url, "/v1/execute_batch", {"calls": [{"code": "print(2)"}, call]})
    assert status == 413, data[:300]
    status, data = _post(url, "/v1/execute", {"code": "print(3)", "stdin": "é" * 30_000})  # 60,000 bytes
    assert status == 200 and json.loads(data.split(b"\r\n\r\n", 1)[1])["output"] == "3\n"


def test_three_200_mib_requests_cost_the_service_less_than_100_mib(svc):
    _, url = svc
    pid = readyz(url)[1]["server_pid"]
    before = _rss_kib(pid, "VmRSS")
    statuses: list[int | None] = []

    def flood(chunked: bool) -> None:
        with socket.create_connection(_addr(url), timeout=30) as s:
            s.sendall(_request_head("/v1/execute_batch", None if chunked else 200 * 2**20, chunked=chunked))
            piece = b"x" * 2**20
            with contextlib.suppress(OSError):
                for _ in range(200):
                    s.sendall((b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece)
            statuses.append(_status_of(s))

    threads = [threading.Thread(target=flood, args=(i < 2,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    grew_mib = (_rss_kib(pid, "VmHWM") - before) / 1024
    assert statuses == [413, 413, 413], statuses
    assert grew_mib < 100, f"the service's peak RSS grew {grew_mib:.0f} MiB"


# -- time ----------------------------------------------------------------------------------------


def test_a_head_that_never_ends_is_dropped_after_the_idle_timeout(svc):
    _, url = svc
    socks = [socket.create_connection(_addr(url), timeout=10) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(b"POST /v1/execute HTTP/1.1\r\nHost: sandbox\r\nContent-Le")
        t = time.monotonic()
        for s in socks:
            _answer(s, timeout=IDLE_TIMEOUT + 10)
        assert time.monotonic() - t < IDLE_TIMEOUT + 5
    finally:
        for s in socks:
            s.close()


def _half_sent(url: str, count: int) -> list[socket.socket]:
    """``count`` connections, each with a request head and 13 bytes of a 1,000-byte body sent."""
    head = _request_head("/v1/execute", 1000) + b'{"code": "pri'
    held = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect(_addr(url))
            s.sendall(head)
        except OSError:  # beyond the connection cap: closed at once
            s.close()
            continue
        held.append(s)
    return held


def _wait_closed(held: list[socket.socket], within: float) -> int:
    """How many of ``held`` the server has not closed (or answered 408) after ``within`` s."""
    sel = selectors.DefaultSelector()
    for s in held:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_left, deadline = len(held), time.monotonic() + within
    while open_left and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                chunk = key.fileobj.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk or chunk.startswith(b"HTTP/1.1 408"):
                sel.unregister(key.fileobj)
                open_left -= 1
    return open_left


def test_5000_half_sent_requests_neither_stop_calls_nor_stay(svc):
    """Trivial calls on a client's open connection keep a p99 under 100 ms while 5,000
    connections hold half-sent requests, and every held connection is closed within the body
    timeout (or at once, beyond the connection cap)."""
    _, url = svc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 6000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))

    async def scenario() -> tuple[list[float], list[socket.socket], float]:
        async with SandboxClient(url) as c:
            assert (await c.execute("print(1)")).output == "1\n"  # its connection is open
            flood = asyncio.create_task(asyncio.to_thread(_half_sent, url, 5000))
            while not flood.done():  # busy, so the idle timeout does not close its connection
                await c.execute("print(1)")
            held, opened = await flood, time.monotonic()
            lat = []
            for _ in range(200):
                t = time.perf_counter()
                assert (await c.execute("print(1)")).output == "1\n"
                lat.append(time.perf_counter() - t)
            return sorted(lat), held, opened

    lat, held, opened = asyncio.run(scenario())
    try:
        p99 = lat[int(0.99 * (len(lat) - 1))]
        left = _wait_closed(held, max(0.0, opened + BODY_TIMEOUT + 8 - time.monotonic()))
    finally:
        for s in held:
            s.close()
    assert len(held) > 4000, f"only {len(held)} of 5000 connections were taken"
    assert left == 0, f"{left} of {len(held)} half-sent requests still open {BODY_TIMEOUT + 8:g} s after the flood"
    assert p99 < 0.1, f"trivial p99 {p99 * 1000:.0f} ms with 5000 half-sent requests held"
    assert readyz(url)[0] == 200


def test_connections_beyond_the_cap_are_closed_as_they_arrive():
    with _service("full", ["--max-connections", "40"]) as url:
        socks = [socket.create_connection(_addr(url), timeout=10) for _ in range(60)]
        try:
            time.sleep(0.5)
            closed = 0
            for s in socks:
                s.setblocking(False)
                try:
                    closed += s.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            assert closed >= 20, closed
        finally:
            for s in socks:
                s.close()
        time.sleep(0.5)  # the held ones closed: room again
        status, _ = _post(url, "/v1/execute", {"code": "print(1)"})
        assert status == 200
