"""Benchmark: the weight push, measured (issue 41 item 4).

What one push of the real-model example's policy (SmolLM2-135M, float32 on the engine as
``examples/smollm2-cpu.yaml`` serves it) costs on each path, against a plain memory copy of
the same bytes in the same run:

* **memory copy**: ``dst.copy_(src)`` of every tensor the push writes, into buffers allocated
  beforehand: the machine's copy limit for these bytes;
* **local engine** (``kuberl run`` with ``engine: local``): ``LocalWeights.sync`` ends in
  ``LocalEngine.set_weights``, a ``load_state_dict`` copy into the engine's private model;
* **disk, publish**: ``DiskWeights``' write of the version folder (``write_hf_folder`` through
  ``DiskWeightSync.publish``: safetensors in a hidden folder, renamed into place);
* **disk, vLLM reload**: ``VLLMEngine.update_weights_from_disk`` on a real vLLM server
  (``/pause``, ``reload_weights`` of the folder, ``/reset_prefix_cache``,
  ``/update_weight_version``, ``/resume``); with ``--partial`` also the partial-rollouts push
  (``/pause?mode=keep`` and the running requests' KV reset);
* **disk, total**: publish + reload, the push of a fleet run; its share of the real-model
  example's RL step (``--step-seconds``, from the committed log of that run);
* **shm, publish**: ``SharedMemorySlots.publish`` of the same tensors into a raw weights slot
  in ``/dev/shm`` (both slots written once before timing: a run rewrites pages mapped once);
* **shm, vLLM transfer**: ``VLLMEngine.update_weights_from_disk`` of the slot, which goes through
  vLLM's weight-transfer routes to kuberl's shared-memory backend (rollout/vllm_shm.py), with
  the same pause, cache reset, label and resume; and the transfer routes alone;
* **shm, total**: publish + transfer, the push of ``kuberl run`` on a local vLLM server.

Each path runs ``--repeats`` times; the median and the best are reported.

    python bench/weight_push.py [--model DIR] [--repeats 3] [--no-vllm] [--partial]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache" / "kuberl" / "models" / "hf" / "smollm2-135m-instruct"
# examples/smollm2-cpu.yaml's mean RL step on 2026-11-27 (bench/logs/real-model-2026-11-27.log)
REAL_MODEL_STEP_S = 23.9


def timed(fn: Callable[[], object], repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of ``repeats`` calls; ``cpu`` gets this process's CPU seconds of each (on a
    loaded machine the wall time is mostly waiting for a core; the CPU time is the work)."""
    out = []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        out.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return out


def row(
    name: str, nbytes: int, seconds: list[float], copy_bps: float | None, cpu: list[float] | None = None
) -> dict[str, float | str | None]:
    med, best = statistics.median(seconds), min(seconds)
    bps = nbytes / med
    return {
        "path": name,
        "bytes": nbytes,
        "median_s": med,
        "best_s": best,
        "GB_per_s": bps / 1e9,
        "copy_over_path": (copy_bps / bps) if copy_bps else 1.0,
        "cpu_s": statistics.median(cpu) if cpu else None,
    }


def render(rows: list[dict], step_s: float) -> str:
    head = f"{'path':<28}{'MB':>8}{'median s':>10}{'best s':>9}{'GB/s':>8}{'x copy time':>13}{'of RL step':>12}{'CPU s':>8}"
    lines = [head]
    for r in rows:
        share = f"{100 * r['median_s'] / step_s:.1f} %"
        cpu = f"{r['cpu_s']:.3f}" if r["cpu_s"] is not None else "-"
        lines.append(
            f"{r['path']:<28}{r['bytes'] / 1e6:>8.1f}{r['median_s']:>10.3f}{r['best_s']:>9.3f}"
            f"{r['GB_per_s']:>8.2f}{r['copy_over_path']:>13.1f}{share:>12}{cpu:>8}"
        )
    return "\n".join(lines)


async def vllm_pushes(url: str, folder: str, repeats: int, partial: bool) -> list[float]:
    from kuberl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(url, partial_rollouts=partial)
    out = []
    try:
        for i in range(repeats):
            t = time.perf_counter()
            await engine.update_weights_from_disk(folder, version=i + 1)
            out.append(time.perf_counter() - t)
    finally:
        await engine.close()
    return out


async def vllm_reload_rpcs(url: str, folder: str, repeats: int) -> list[float]:
    """The ``reload_weights`` call alone (no pause, cache reset or version label around it): how
    much of a push is vLLM's own in-place reload rather than the HTTP steps around it."""
    from kuberl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(url)
    out = []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            await engine.reload_weights(folder)
            out.append(time.perf_counter() - t)
    finally:
        await engine.close()
    return out


async def shm_pushes(url: str, slots, tensors: dict[str, torch.Tensor], repeats: int, first: int) -> dict[str, list[float]]:
    """``repeats`` shared-memory pushes (versions from ``first``): each publishes into the next
    slot, then the engine takes it in a whole push; then ``repeats`` transfers alone (of the
    last slot, its version again: no pause, cache reset or label around them)."""
    from kuberl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(url)
    out: dict[str, list[float]] = {"publish": [], "push": [], "transfer": []}
    try:
        for i in range(repeats):
            t = time.perf_counter()
            path = slots.publish(tensors, first + i)
            out["publish"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await engine.update_weights_from_disk(path, version=first + i)
            out["push"].append(time.perf_counter() - t)
        for _ in range(repeats):
            t = time.perf_counter()
            await engine.transfer_weights(path, first + repeats - 1)
            out["transfer"].append(time.perf_counter() - t)
    finally:
        await engine.close()
    return out


def vllm_rows(args, model_dir: Path, folder: str, written: int, publish_s: list[float], copy_bps: float,
              work: Path, rows: list[dict], tensors: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """The real vLLM server's reload of the published folder, and publish + reload; then the
    shared-memory push (kuberl run's local server is started with its backend, as here)."""
    from kuberl.rollout.vllm_server import SHM_BACKEND, VLLMServerConfig, running_vllm
    from kuberl.trainer.shm_weights import SharedMemorySlots, shm_root

    config = VLLMServerConfig(
        model=str(model_dir), dtype=args.dtype, max_model_len=1024, kv_cache_gib=0.5, weight_transfer=SHM_BACKEND
    )
    t = time.perf_counter()
    with running_vllm(config, log_path=work / "vllm.log") as url:
        print(f"vLLM server up in {time.perf_counter() - t:.0f} s", flush=True)
        reload_s = asyncio.run(vllm_pushes(url, folder, args.repeats, partial=False))
        rows.append(row("disk: vLLM reload", written, reload_s, copy_bps))
        rpc_s = asyncio.run(vllm_reload_rpcs(url, folder, args.repeats))
        rows.append(row("  of it reload_weights RPC", written, rpc_s, copy_bps))
        total = [a + b for a, b in zip(publish_s, reload_s, strict=True)]
        rows.append(row("disk: total (fleet push)", written, total, copy_bps))
        if args.partial:
            keep_s = asyncio.run(vllm_pushes(url, folder, args.repeats, partial=True))
            rows.append(row("disk: vLLM reload (keep)", written, keep_s, copy_bps))
        root = shm_root("bench", written)
        if root is None:
            print("no room for two slots in /dev/shm: shared-memory rows skipped", flush=True)
            return
        slots = SharedMemorySlots(root)
        try:
            for v in (1001, 1002):  # both slots' pages exist before timing, as after a run's first pushes
                slots.publish(tensors, v)
            shm = asyncio.run(shm_pushes(url, slots, tensors, args.repeats, first=1003))
        finally:
            slots.close()
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        rows.append(row("shm: publish (copy)", raw, shm["publish"], copy_bps))
        rows.append(row("shm: vLLM transfer", raw, shm["push"], copy_bps))
        rows.append(row("  of it the transfer routes", raw, shm["transfer"], copy_bps))
        total = [a + b for a, b in zip(shm["publish"], shm["push"], strict=True)]
        rows.append(row("shm: total (kuberl run push)", raw, total, copy_bps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="the engine's serving dtype (the example's: float32)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the real vLLM server's reload")
    ap.add_argument("--partial", action="store_true", help="also the partial-rollouts push (pause keep)")
    ap.add_argument(
        "--step-seconds", type=float, default=REAL_MODEL_STEP_S,
        help="the real-model example's RL step the push is a share of (default: its 2026-11-27 run)",
    )
    ap.add_argument("--workdir", default=None, help="where the version folders go (default: a temp dir)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    from kuberl.rollout.local_engine import LocalEngine
    from kuberl.trainer.distributed import DistContext, full_state_dict
    from kuberl.trainer.hf import engine_tensors, load_hf_policy, write_hf_folder
    from kuberl.trainer.weight_sync import DiskWeightSync

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"no model at {model_dir}: run `kuberl models prepare smollm2-135m-instruct {model_dir}`")
    dtype = getattr(torch, args.dtype)
    print(f"load average at start {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; "
          f"{os.cpu_count()} CPUs; model {model_dir.name}; serving dtype {args.dtype}; repeats {args.repeats}")  # fmt: skip
    policy = load_hf_policy(model_dir)
    sd = full_state_dict(policy, DistContext())
    tensors = engine_tensors(sd, model_dir, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    dst = {k: torch.empty_like(v) for k, v in tensors.items()}

    def copy_all() -> None:
        for k, v in tensors.items():
            dst[k].copy_(v)

    copy_all()  # touch the destination pages once
    copy_cpu: list[float] = []
    copy_s = timed(copy_all, args.repeats, copy_cpu)
    copy_bps = nbytes / statistics.median(copy_s)
    rows = [row("memory copy", nbytes, copy_s, None, copy_cpu)]

    local = LocalEngine(policy, seed=0)
    local.set_weights(sd, 0)
    local_cpu: list[float] = []
    local_s = timed(lambda: local.set_weights(sd, 1), args.repeats, local_cpu)
    local_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows.append(row("local engine set_weights", local_bytes, local_s, copy_bps, local_cpu))

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kuberl-weight-push-"))
    disk = DiskWeightSync(work / "weights", keep=2)
    versions = iter(range(1, 1000))
    publish_cpu: list[float] = []
    publish_s = timed(
        lambda: disk.publish(lambda d: write_hf_folder(sd, model_dir, d, dtype), next(versions)),
        args.repeats,
        publish_cpu,
    )
    folder = disk.current
    assert folder is not None
    written = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    rows.append(row("disk: publish (write)", written, publish_s, copy_bps, publish_cpu))

    try:
        if not args.no_vllm:
            vllm_rows(args, model_dir, folder, written, publish_s, copy_bps, work, rows, tensors)
    finally:  # what was measured is printed whatever the server did
        print(render(rows, args.step_seconds))
        print("x copy time: the path's median seconds over the memory copy's (same bytes); CPU s: this process's")
        source = "bench/logs/real-model-2026-11-27.log" if args.step_seconds == REAL_MODEL_STEP_S else "--step-seconds"
        print(f"RL step of the real-model example: {args.step_seconds:.1f} s ({source})")
        print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
