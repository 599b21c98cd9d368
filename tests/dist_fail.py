"""Rank 0 fails while rank 1 waits in a collective (tests only; run under torch.distributed.run):
with ``DistContext.close`` in a ``finally``, as ``run_job`` does, both must exit at once."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kuberl.trainer.distributed import DistContext  # noqa: E402


def main() -> None:
    ctx = DistContext.from_env()
    ctx.init("cpu")
    try:
        if ctx.is_main:
            raise RuntimeError("rank 0 fails")
        ctx.broadcast(None)
        ctx.barrier()
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
