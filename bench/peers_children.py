"""The subprocesses of ``bench/peers.py`` (``peers.py --child KIND ...``): kuberl's run, TRL's run
and the evaluator that scores saved policies. Each runs in its own process so that its peak RSS
is its own and a crash takes nothing else down.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def keep_published(dest: Path) -> None:
    """Every weight version the kuberl run publishes for its vLLM server stays readable under
    ``dest/vNNNNNNNN``. A checkpoint folder (``KUBERL_VLLM_SHM=0``) has its files hard-linked
    (no copy, microseconds) as it is published, before the run prunes older versions (it keeps
    2): the run writes these folders anyway. A shared-memory slot (the local server's default)
    is rewritten two versions later, so its tensors are saved as an HF folder there, which the
    run's clock does include (about a folder write a step, against kuberl)."""
    from kuberl.trainer import shm_weights, weight_sync
    from kuberl.trainer.hf import save_hf_folder

    slots_publish = shm_weights.SharedMemorySlots.publish

    def slots_publish_and_keep(self, tensors, version: int, config_from) -> str:
        path = slots_publish(self, tensors, version, config_from)
        keep = weight_sync.version_dir(dest, version)
        shutil.rmtree(keep, ignore_errors=True)
        save_hf_folder(dict(tensors), config_from, keep)
        return path

    shm_weights.SharedMemorySlots.publish = slots_publish_and_keep

    publish = weight_sync.DiskWeightSync.publish

    def publish_and_keep(self, write, version: int) -> str:
        path = Path(publish(self, write, version))
        keep = dest / path.name
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
        for f in path.iterdir():
            if f.is_file():
                try:
                    os.link(f, keep / f.name)
                except OSError:  # another filesystem: a copy, which the run's clock does include
                    shutil.copy2(f, keep / f.name)
        return str(path)

    weight_sync.DiskWeightSync.publish = publish_and_keep


def child_kuberl(manifest: Path, out: Path, policies: Path | None = None) -> int:
    """In the child: run kuberl in-process so that RUSAGE_SELF is the trainer's own peak; with
    ``policies``, every pushed weight version is kept there for the evaluator."""
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.trainer.local import run_job

    if policies is not None:
        keep_published(policies)
    job = find_one(load_manifests(str(manifest)), AgenticRLJob)
    t0 = time.perf_counter()
    run_job(job, out, use_ray=False, quiet=True)
    summary = {
        "train_seconds": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # the vLLM server and the sandbox, children of the run: the largest of them
        "peak_rss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def child_trl(settings: Path, out: Path, manifest: Path) -> int:
    """In the child: a sandbox service with the kuberl side's pool settings, then TRL's run."""
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.sandbox.service.local import running_sandbox

    pool = find_one(load_manifests(str(manifest)), AgenticRLJob).spec.sandbox.pool
    s = json.loads(settings.read_text())
    with running_sandbox(workers=pool.workers_per_pod, limits=pool.limits) as url:
        s["sandbox_url"] = url
        settings.write_text(json.dumps(s, indent=2))
        sys.path.insert(0, str(REPO / "bench"))
        from peers_trl import main as trl_main

        return trl_main([str(settings), str(out)])


def export_checkpoint(run: Path, source_dir: Path, dest: Path) -> None:
    """The last checkpoint of a kuberl run as a float32 HF folder (what both sides start from)."""
    import torch

    from kuberl.trainer.checkpoint import CheckpointStore
    from kuberl.trainer.hf import write_hf_folder

    payload = CheckpointStore(str(run / "checkpoints")).load()
    if payload is None:
        raise SystemExit(f"no checkpoint under {run / 'checkpoints'}")
    write_hf_folder(payload["model"], source_dir, dest, dtype=torch.float32)
    # the template the model was served with (chat_template.jinja is among the copied sidecars)


def child_eval(manifest: Path, folder: Path, out: Path, policies: list[str] | None = None) -> int:
    """Held-out accuracy exactly as kuberl's in-run evaluation computes it (TrainerRun._evaluate_on:
    the eval problems, one sample at the run's temperature, the same seed, kuberl's rollout loop
    on a local vLLM server, sandbox verify), writing ``out/eval.json``.

    Without ``policies``: of the HF folder ``folder`` itself (``{"accuracy": ...}``). With them:
    one server started on ``folder`` loads each policy folder in turn (the run's own in-place
    weight reload) and scores it; ``"base"`` scores ``folder`` as started
    (``{"accuracies": {policy: accuracy}, "seconds": {policy: s}}``, written after each)."""
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.rollout import template
    from kuberl.rollout.fleet import FleetSource
    from kuberl.rollout.loop import BatchRequest
    from kuberl.rollout.vllm_server import running_vllm
    from kuberl.rollout.worker import RolloutWorker
    from kuberl.sandbox.service.local import running_sandbox
    from kuberl.trainer import data as data_mod
    from kuberl.trainer.local import local_vllm_config
    from kuberl.trainer.policy import build_tokenizer
    from kuberl.trainer.problems import EVAL_SIZE
    from kuberl.trainer.tokenizer import BPETokenizer

    job = find_one(load_manifests(str(manifest)), AgenticRLJob)
    spec = job.spec
    stage = spec.stages[0]
    probs = [
        p
        for src in spec.data.eval or ["builtin:arith"]
        for p in data_mod.load_problems(src, EVAL_SIZE, spec.data.seed + data_mod.EVAL_SEED_OFFSET)
    ]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(job, out)
    pool = spec.sandbox.pool
    request = BatchRequest(
        [template.render_prompt(p.question, spec.rollout.prompt_template) for p in probs],
        [p.answer for p in probs],
        1,
        temperature=spec.rollout.temperature,
        seed=spec.seed * 7919 + 17,
        max_turns=spec.stage_max_turns(stage),
        max_response_tokens=spec.stage_max_response_tokens(stage),
    )
    accs: dict[str, float] = {}
    secs: dict[str, float] = {}
    with (
        running_sandbox(workers=pool.workers_per_pod, limits=pool.limits) as sandbox,
        running_vllm(local_vllm_config(job, folder.resolve()), log_path=out / "vllm-eval.log") as url,
    ):
        make_tokenizer = functools.partial(BPETokenizer.from_str, tok.to_str())
        worker = RolloutWorker(None, make_tokenizer, sandbox, fleet=FleetSource(urls=(url,), engine="vllm"))
        try:
            for i, policy in enumerate(policies or ["base"]):
                t = time.perf_counter()
                if policy != "base":
                    worker.load_weights(str(Path(policy).resolve()), version=i + 1)
                groups = worker.rollouts(request)
                accs[policy] = sum(g[0].reward for g in groups) / len(groups)
                secs[policy] = time.perf_counter() - t
                doc = {"accuracies": accs, "seconds": secs} if policies else {"accuracy": accs["base"]}
                (out / "eval.json").write_text(json.dumps({**doc, "model": str(folder)}))
        finally:
            worker.close()
    return 0


def child_main(kind: str, rest: list[str]) -> int:
    if kind == "kuberl":
        return child_kuberl(Path(rest[0]), Path(rest[1]), Path(rest[2]) if len(rest) > 2 else None)
    if kind == "trl":
        return child_trl(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    if kind == "eval":
        return child_eval(Path(rest[0]), Path(rest[1]), Path(rest[2]), rest[3:] or None)
    raise SystemExit(f"unknown child {kind!r}: kuberl, trl or eval")
