"""Benchmark: API reads per resync pass, list cache vs one GET per child (issue 14, item 12).

Runs the real operator (kopf) against the API emulator with N groups of (SandboxPool,
RolloutFleet, AgenticRLJob using both), waits until every object is reconciled, then counts
the reads (GET and LIST, watches excluded) the operator sends per resync pass. The baseline is
the same operator with its read cache switched off: a GET per child it applies, a LIST per
child kind per object for pruning, a LIST of pods per object -- what it did before the cache.

    python -P bench/operator_api_load.py                # 1, 3 and 10 groups
    python -P bench/operator_api_load.py --groups 1 5

Counts, not timings: the figure does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))  # the kmock API emulator

from kube_emulator import ClusterEmulator  # noqa: E402

from kuberl.operator.runtime import context
from kuberl.operator.runtime.context import OperatorConfig
from kuberl.operator.runtime.main import operate

NS = "bench"
API = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}"


class CountingEmulator(ClusterEmulator):
    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.method == "GET" and raw_request.query.get("watch") != "true":
            self.__dict__.setdefault("reads", []).append(raw_request.path)
        return await super().__call__(raw_request)


def _doc(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


async def reads_per_pass(groups: int, *, cached: bool, window: float = 4.0, interval: float = 0.4) -> float:
    original = context.operator_cache
    if not cached:
        context.operator_cache = lambda: None  # type: ignore[assignment,return-value]
    try:
        async with (
            CountingEmulator(namespaces={NS}) as emu,
            kmock.Server(emu) as srv,
            aiohttp.ClientSession() as s,
        ):
            url = str(srv.url).rstrip("/")
            cfg = OperatorConfig(
                reconcile_interval=interval,
                autoscale_interval=1e6,
                login=lambda **_: kopf.ConnectionInfo(server=url, default_namespace=NS),
            )
            stop, ready = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(
                operate(cfg, namespaces=[NS], stop_flag=stop, ready_flag=ready, fast=True)
            )
            try:
                await asyncio.wait_for(ready.wait(), 30)
                for i in range(groups):
                    for plural, doc in (
                        ("sandboxpools", _doc("SandboxPool", f"p{i}", {"replicas": 1})),
                        (
                            "rolloutfleets",
                            _doc(
                                "RolloutFleet",
                                f"f{i}",
                                {"model": {"uri": "m"}, "accelerator": {"profile": "cpu"}},
                            ),
                        ),
                        (
                            "agenticrljobs",
                            _doc(
                                "AgenticRLJob",
                                f"j{i}",
                                {
                                    "model": {"base": "m"},
                                    "data": {"train": "s3://d/t.jsonl"},
                                    "rollout": {"fleetRef": f"f{i}"},
                                    "sandbox": {"poolRef": f"p{i}"},
                                },
                            ),
                        ),
                    ):
                        async with s.post(url + f"{API}/{plural}", json=doc) as rsp:
                            rsp.raise_for_status()
                for _ in range(600):
                    done = True
                    for plural in ("sandboxpools", "rolloutfleets", "agenticrljobs"):
                        async with s.get(url + f"{API}/{plural}") as rsp:
                            items = (await rsp.json())["items"]
                        done &= len(items) == groups and all(
                            (o.get("status") or {}).get("phase") for o in items
                        )
                    if done:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError("objects were not reconciled within 60 s")
                await asyncio.sleep(2 * interval)
                emu.__dict__["reads"] = []
                await asyncio.sleep(window)
                reads = list(emu.__dict__["reads"])
            finally:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(task, 10)
    finally:
        context.operator_cache = original
    passes = reads.count(f"{API}/agenticrljobs")
    if passes == 0:
        raise RuntimeError("no resync pass in the window")
    return len(reads) / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 3, 10])
    args = ap.parse_args()
    for groups in args.groups:
        ours = asyncio.run(reads_per_pass(groups, cached=True))
        base = asyncio.run(reads_per_pass(groups, cached=False))
        print(
            f"objects {3 * groups:3d}  reads/pass: cache {ours:6.1f}  no cache {base:6.1f}  "
            f"ratio {base / ours:5.1f}x  per object: {ours / (3 * groups):5.2f} vs {base / (3 * groups):5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
