"""Runs a job file (the checkpoint tests' learning job) in this process and SIGKILLs the process
at one point of the run, as an OOM kill or a lost node ends a trainer pod:

* ``update N``: right after the N-th optimizer step of the run (SFT steps count one each, an
  RL step one per mini-batch), so an RL update is half applied in memory and not saved;
* ``checkpoint N``: half-way through writing the N-th checkpoint file (half its bytes on disk).

    python tests/kill_during.py POINT N JOB.yaml OUT

The rollouts' sandbox is the tests' deterministic CoinVerifySandbox and the held-out set has 4
problems, as in tests/test_trainer_checkpoint.py, so the run is the one those tests compare to.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import kuberl.trainer.checkpoint as checkpoint  # noqa: E402
import kuberl.trainer.stages as stages  # noqa: E402
from kuberl.api.job import AgenticRLJob  # noqa: E402
from kuberl.api.loader import find_one, load_manifests  # noqa: E402
from kuberl.trainer.local import run_job  # noqa: E402
from tests.trainer_fakes import CoinVerifySandbox  # noqa: E402


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_update(at: int) -> None:
    step = torch.optim.AdamW.step
    count = 0

    def counted(self, *args, **kwargs):
        nonlocal count
        out = step(self, *args, **kwargs)
        count += 1
        if count == at:
            _die()
        return out

    torch.optim.AdamW.step = counted


def kill_in_checkpoint(at: int) -> None:
    write = checkpoint._write_blob
    count = 0

    def half_written(payload, path: Path, name: str) -> None:
        nonlocal count
        count += 1
        if count < at:
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


def main() -> int:
    point, at, job_file, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    {"update": kill_in_update, "checkpoint": kill_in_checkpoint}[point](at)
    stages.EVAL_SIZE = 4
    job = find_one(load_manifests(job_file), AgenticRLJob)
    run_job(job, out, use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    return 0  # not reached when the kill point is


if __name__ == "__main__":
    raise SystemExit(main())
