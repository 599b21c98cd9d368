"""Sandbox throughput and latency vs a spawn-a-python-per-call baseline (code-judge style).

    python bench/sandbox_throughput.py [--calls 600] [--workers 2] [--rate 180] [--burst 10000]

Prints calls/s and p50/p99 latency for trivial and sympy snippets through the service, the
same for the baseline (one ``python -c`` per call, ``workers`` at a time), their ratio, the
latency of trivial calls arriving open-loop at ``--rate`` calls/s, and optionally a burst of
N calls checked to be answered exactly once (order and content).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from kuberl.sandbox.client import SandboxClient
from kuberl.sandbox.local import running_sandbox

SNIPPETS = {
    "trivial": "print(sum(range(100)))",
    "sympy": "import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 1))",
}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _ours(url: str, code: str, calls: int, concurrency: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with SandboxClient(url) as c:

        async def one() -> None:
            async with sem:
                t = time.perf_counter()
                r = await c.execute(code)
                lat.append(time.perf_counter() - t)
                assert r.outcome == "stdout", r

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return calls / (time.perf_counter() - t0), lat


async def _baseline(code: str, calls: int, concurrency: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            await asyncio.wait_for(p.communicate(), 30)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    return calls / (time.perf_counter() - t0), lat


async def _open_loop(url: str, code: str, rate: float, seconds: float) -> tuple[float, list[float]]:
    """Poisson arrivals at ``rate`` calls/s (open loop, like rollouts emitting tool calls):
    the latency a call sees at that load, queueing included."""
    import random

    rng = random.Random(0)
    lat: list[float] = []
    async with SandboxClient(url) as c:

        async def one() -> None:
            t = time.perf_counter()
            r = await c.execute(code)
            lat.append(time.perf_counter() - t)
            assert r.outcome == "stdout", r

        tasks = []
        t0 = time.perf_counter()
        next_at = t0
        while next_at - t0 < seconds:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return len(tasks) / (time.perf_counter() - t0), lat


async def _burst(url: str, n: int) -> tuple[float, bool]:
    async with SandboxClient(url, request_timeout=600) as c:
        t0 = time.perf_counter()
        res = await c.execute_batch([("print(input())", str(i)) for i in range(n)])
        took = time.perf_counter() - t0
    return took, [r.output for r in res] == [f"{i}\n" for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--baseline-calls", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16, help="in-flight calls through the service")
    ap.add_argument("--burst", type=int, default=0, help="also send N calls at once (e.g. 10000)")
    ap.add_argument(
        "--rate", type=float, default=180.0, help="open-loop trivial calls/s for the latency-at-load line"
    )
    args = ap.parse_args()
    with running_sandbox(workers=args.workers) as url:
        for name, code in SNIPPETS.items():
            asyncio.run(_ours(url, code, 20, args.concurrency))  # warm connections
            ours, lat = asyncio.run(_ours(url, code, args.calls, args.concurrency))
            base, blat = asyncio.run(_baseline(code, args.baseline_calls, args.workers))
            print(
                f"{name:8s} ours {ours:7.1f} calls/s p50 {statistics.median(lat) * 1e3:6.1f} ms "
                f"p99 {_pct(lat, 0.99) * 1e3:6.1f} ms | spawn baseline {base:6.1f} calls/s "
                f"p50 {statistics.median(blat) * 1e3:6.1f} ms | ratio {ours / base:5.1f}x"
            )
            # latency of a lone call (no queueing): the p99 target is about the service, not the queue
            _, solo = asyncio.run(_ours(url, code, min(200, args.calls), 1))
            print(f"{name:8s} unloaded latency p50 {statistics.median(solo) * 1e3:6.1f} ms "
                  f"p99 {_pct(solo, 0.99) * 1e3:6.1f} ms")  # fmt: skip
        if args.rate > 0:
            got, olat = asyncio.run(_open_loop(url, SNIPPETS["trivial"], args.rate, 10.0))
            print(f"trivial  open loop at {args.rate:.0f} calls/s offered: {got:.1f} calls/s served, "
                  f"p50 {statistics.median(olat) * 1e3:6.1f} ms p99 {_pct(olat, 0.99) * 1e3:6.1f} ms")  # fmt: skip
        if args.burst:
            took, exact = asyncio.run(_burst(url, args.burst))
            print(f"burst    {args.burst} calls in {took:.1f} s ({args.burst / took:.0f} calls/s); "
                  f"every call answered exactly once, in order: {exact}")  # fmt: skip
            if not exact:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
