"""Run a job with the in-process fake sandbox, as torchrun's ranks or as one process (tests only).

``python tests/dist_run.py JOB.yaml OUT`` (optionally under ``torch.distributed.run``); rank 0
writes ``OUT/result.json`` with the history and evals. Rollouts come from ScriptedArithEngine
(half of them correct), so every RL step has groups with non-zero advantages whatever the
weights: the runs compared differ in float noise, and sampled tokens would amplify it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "harness"))

import torch  # noqa: E402
from trainer_fakes import FakeSandbox, ScriptedArithEngine  # noqa: E402

from kuberl.api.job import AgenticRLJob  # noqa: E402
from kuberl.api.loader import find_one, load_manifests  # noqa: E402
from kuberl.trainer.distributed import DistContext  # noqa: E402
from kuberl.trainer.local import run_job  # noqa: E402


def main() -> None:
    import kuberl.trainer.problems as problems

    problems.EVAL_SIZE = 4
    torch.set_num_threads(1)
    job = find_one(load_manifests(sys.argv[1]), AgenticRLJob)
    out = Path(sys.argv[2])
    result = run_job(
        job,
        out,
        use_ray=False,
        executor_factory=FakeSandbox,
        engine_factory=lambda model, tok: ScriptedArithEngine(tok),
        quiet=True,
    )
    if DistContext.from_env().is_main:
        (out / "result.json").write_text(json.dumps({"history": [h.to_json() for h in result.history], "evals": result.evals}))


if __name__ == "__main__":
    main()
