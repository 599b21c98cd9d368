"""Runs a job file (the checkpoint tests' learning job) in this process and SIGKILLs the process
at one point of the run, as an OOM kill or a lost node ends a trainer pod:

* ``update N``: right after the N-th optimizer step of the run (SFT steps count one each, an
  RL step one per mini-batch), so an RL update is half applied in memory and not saved;
* ``checkpoint N``: half-way through writing the N-th checkpoint file (half its bytes on disk);
* ``reload N``: while the engine reloads the N-th weight push (vLLM: its ``reload_weights``
  call, or with shared-memory pushes its ``/update_weights``, sent, the server paused and
  reading the weights);
* ``publish N``: half-way through writing the N-th weights an engine would load (a folder's
  safetensors file half on disk, or a shared-memory slot half copied, its manifest removed);
* ``step N``: between steps, right after the N-th RL step's record is written;
* ``generate N``: mid-generation, once the N-th request to a vLLM engine is on its way.

    python harness/kill_during.py POINT N JOB.yaml OUT       # N = 0: never (a resume)

The held-out set has 4 problems. The rollouts' sandbox is the tests' deterministic
CoinVerifySandbox, as in tests/test_trainer_checkpoint.py (so the run is the one those tests
compare to), except for jobs rolled out on vLLM: those get the real sandbox, as ``kuberl run``.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for kuberl

import torch  # noqa: E402
from trainer_fakes import CoinVerifySandbox  # noqa: E402

import kuberl.trainer.checkpoint as checkpoint  # noqa: E402
import kuberl.trainer.problems as problems  # noqa: E402
from kuberl.api.job import AgenticRLJob  # noqa: E402
from kuberl.api.loader import find_one, load_manifests  # noqa: E402
from kuberl.trainer.local import run_job  # noqa: E402


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _nth(at: int) -> Callable[[], bool]:
    """A counter of calls: True on the ``at``-th, False on every other."""
    calls = itertools.count(1)
    return lambda: next(calls) == at


def kill_in_update(at: int) -> None:
    step, hit = torch.optim.AdamW.step, _nth(at)

    def counted(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if hit():
            _die()
        return out

    torch.optim.AdamW.step = counted


def kill_in_checkpoint(at: int) -> None:
    write, hit = checkpoint._write_blob, _nth(at)

    def half_written(payload, path: Path, name: str) -> None:
        if not hit():
            return write(payload, path, name)
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        _die()

    checkpoint._write_blob = half_written


def kill_in_reload(at: int) -> None:
    from kuberl.rollout.vllm_engine import VLLMEngine

    call, hit = VLLMEngine._rl_call, _nth(at)

    async def reloading(self, path: str, json=None):
        if path in ("/collective_rpc", "/update_weights") and hit():
            asyncio.ensure_future(call(self, path, json))
            await asyncio.sleep(0.3)  # the request is on the wire, the server reloading
            _die()
        return await call(self, path, json)

    VLLMEngine._rl_call = reloading


def kill_in_publish(at: int) -> None:
    import kuberl.trainer.hf as hf
    from kuberl.trainer.shm_weights import SharedMemorySlots

    write, publish, hit = hf.write_hf_folder, SharedMemorySlots.publish, _nth(at)

    class Torn(dict):
        """Tensors whose copy into the slot stops half-way, killed."""

        def values(self):
            values = list(super().values())
            for i, v in enumerate(values):
                if i == len(values) // 2:
                    _die()
                yield v

    def half_copied(self, tensors, version, config_from=None):
        return publish(self, Torn(tensors) if hit() else tensors, version, config_from)

    def half_written(state, source_dir, dest, *args, **kwargs):
        out = write(state, source_dir, dest, *args, **kwargs)
        if hit():
            for f in Path(dest).glob("*.safetensors"):
                data = f.read_bytes()
                f.write_bytes(data[: len(data) // 2])
            _die()
        return out

    hf.write_hf_folder = half_written
    SharedMemorySlots.publish = half_copied


def kill_after_step(at: int) -> None:
    from kuberl.trainer.metrics import MetricsSink

    record, hit = MetricsSink.step, _nth(at)

    def recorded(self, rec):
        out = record(self, rec)
        if rec.type == "rl" and hit():
            _die()
        return out

    MetricsSink.step = recorded


def kill_in_generation(at: int) -> None:
    from kuberl.rollout.vllm_engine import VLLMEngine

    generate, hit = VLLMEngine.generate, _nth(at)

    async def generating(self, req):
        if hit():
            asyncio.get_running_loop().call_later(0.3, _die)  # this request and its peers in flight
        return await generate(self, req)

    VLLMEngine.generate = generating


POINTS = {"update": kill_in_update, "checkpoint": kill_in_checkpoint, "reload": kill_in_reload,
          "publish": kill_in_publish, "step": kill_after_step, "generate": kill_in_generation}  # fmt: skip


def main() -> int:
    point, at, job_file, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    if at:
        POINTS[point](at)
    problems.EVAL_SIZE = 4
    job = find_one(load_manifests(job_file), AgenticRLJob)
    sandbox = None if job.spec.rollout.engine == "vllm" else CoinVerifySandbox
    run_job(job, out, use_ray=False, executor_factory=sandbox, quiet=True)
    return 0  # not reached when the kill point is


if __name__ == "__main__":
    raise SystemExit(main())
