"""Benchmark: kuberl vs Hugging Face TRL's GRPOTrainer on the same real model, data, tool and reward.

One invocation runs, on this machine, the same RL work through kuberl and through TRL 1.16
(``pip install -e '.[bench]'``), each side in its own subprocess so that its peak RSS is its own:

- model: SmolLM2-135M-Instruct (``kuberl:smollm2-135m-instruct``) after kuberl's short SFT on
  tool-call traces (examples/smollm2-cpu.yaml's SFT stage, run once here and exported as an HF
  folder both sides start from: the raw model does not call tools);
- prompts: the pool kuberl draws for the RL stage (``builtin:arith``), in the same order;
- tool: kuberl's Python sandbox (one service per side, same limits), through each framework's
  own tool-calling path (kuberl's rollout loop; TRL's ``tools=`` loop, with a chat template that
  renders kuberl's compact ChatML format and TRL's Qwen response parser for ``<tool_call>``);
- reward: 1 when the sandbox's math-verify accepts the final ``<answer>`` (both sides);
- plain GRPO (TRL has no Resample-on-Correct), P prompts x G samples, max tokens, turns, lr and
  warmup, clip bounds, grad clip, AdamW betas: mapped by :func:`trl_settings` from the manifest.

Generation: kuberl through its local vLLM server (``--kuberl-engines vllm``) and/or its in-process
LocalEngine (``local``, the transformers-class engine); TRL through transformers (``model.generate``)
because its vLLM paths do not run on this CPU machine (bench/README.md says why).

    python bench/peers.py [--steps 5] [--seeds 0 1 2] [--kuberl-engines vllm local] [--out /tmp/kuberl-peers]
                          [--precision float32|bf16]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "examples" / "smollm2-cpu.yaml"

# kuberl loss aggregation -> TRL loss_type with the same normalisation
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


def rl_manifest(
    base: dict[str, Any],
    model_dir: str,
    *,
    steps: int,
    seed: int,
    engine: str,
    prompts: int,
    group: int,
    heldout: str | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """The kuberl side's manifest: ``base`` (the real-model example) with only its RL stage, plain
    GRPO with ``prompts`` x ``group`` rollouts per step, started from ``model_dir``, evaluated on
    the ``heldout`` jsonl (default: the builtin 256), its update in ``precision`` (default: the
    example's) (pure)."""
    m = copy.deepcopy(base)
    spec = m["spec"]
    if heldout:
        spec["data"]["eval"] = [heldout]
    rl = [s for s in spec["stages"] if s["type"] == "rl"]
    if not rl:
        raise ValueError("the base manifest has no rl stage to compare")
    stage = dict(rl[0], steps=steps)
    spec["stages"] = [stage]
    spec["model"] = {"base": model_dir}
    spec["seed"] = seed
    spec["rollout"]["engine"] = engine
    if engine != "vllm":
        spec["rollout"].pop("fleet", None)
    algo = spec["algorithm"]
    algo.update(name="grpo", groupSize=group, batchPrompts=prompts)
    algo.pop("oversample", None)
    # TRL runs the update as one forward of the whole batch (gradient_accumulation_steps 1): so
    # does this side, for a like-for-like time and peak (the gradient is the same either way)
    spec.get("trainer", {}).pop("microBatchTokens", None)
    if precision is not None:
        spec.setdefault("trainer", {})["precision"] = precision
    spec["checkpoint"] = dict(spec.get("checkpoint", {}), everySteps=max(steps + 1, 1))
    m["metadata"]["name"] = f"peers-{engine}-s{seed}"
    return m


def trl_settings(job, model_dir: str, sandbox_url: str, threads: int) -> dict[str, Any]:
    """TRL GRPOTrainer settings doing the same work as kuberl ``job``'s first RL stage (pure).

    Everything that decides what is trained maps one to one; what TRL cannot express raises.
    """
    spec = job.spec
    a = spec.algorithm
    idx, stage = next((i, s) for i, s in enumerate(spec.stages) if s.type == "rl")
    if a.name != "grpo":
        raise ValueError(f"TRL has no {a.name}; compare with algorithm.name: grpo")
    if a.loss_aggregation not in LOSS_TYPES:
        raise ValueError(f"no TRL loss_type aggregates like {a.loss_aggregation}")
    if a.async_level:
        raise ValueError("TRL's GRPOTrainer is synchronous; compare with asyncLevel 0")
    if a.clip.negative_ratio_cap is not None or a.entropy_coef:
        raise ValueError("clip.negativeRatioCap and entropyCoef have no TRL equivalent here")
    batch = stage.batch_size or a.batch_prompts
    return {
        "model": model_dir,
        "sandbox_url": sandbox_url,
        "threads": threads,
        "data": stage.data or spec.data.train,
        # kuberl's RL pool (filtering.rl_pool): steps * batch problems, seed data.seed + 1000 (stage index + 1)
        "pool_size": stage.steps * batch,
        "pool_seed": spec.data.seed + 1000 * (idx + 1),
        "learning_rate": stage.learning_rate or a.learning_rate,
        "warmup_steps": a.warmup_steps,
        "grpo_config": {
            "max_steps": stage.steps,
            "per_device_train_batch_size": batch * a.group_size,
            "gradient_accumulation_steps": 1,
            "num_generations": a.group_size,
            "steps_per_generation": a.mini_batches,  # mini_batches optimizer steps per generation batch
            "num_iterations": a.ppo_epochs,
            "learning_rate": stage.learning_rate or a.learning_rate,
            "beta": a.kl_coef,
            "epsilon": a.clip.low,
            "epsilon_high": a.clip.high,
            "loss_type": LOSS_TYPES[a.loss_aggregation],
            "scale_rewards": "group",
            "max_grad_norm": a.grad_clip,
            "max_completion_length": spec.stage_max_response_tokens(stage),
            "max_tool_calling_iterations": spec.stage_max_turns(stage) - 1,
            "temperature": spec.rollout.temperature,
            "top_p": spec.rollout.top_p,
            "top_k": 0,
            "shuffle_dataset": False,  # kuberl walks its pool in order
            "seed": spec.seed,
            "use_cpu": True,
            "bf16": spec.trainer.precision == "bf16",  # autocast over float32 weights, as kuberl's
            "fp16": False,
            "gradient_checkpointing": False,  # memory is not short; recomputation only slows CPU steps
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "dataloader_num_workers": 0,
            "log_completions": False,
        },
    }


def side_figures(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Per-step means of one run's step records, the warm-up step (the first) left out (pure).

    Records carry ``step_seconds``, ``generation_seconds``, ``tool_seconds``, ``update_seconds``
    (``push_seconds``: the part of it spent pushing weights to the engines),
    ``rollouts``, ``rows`` (rows the update trained on: kuberl drops groups whose rewards all
    tie, TRL trains every row), ``tokens`` (trained, model-written tokens) and ``reward_mean``.

    At equal work: ``rows_per_s`` (trained rows over step seconds) and ``update_s_per_row``
    (update seconds over trained rows), both over the timed steps together.
    """
    warm = steps[1:] if len(steps) > 1 else steps
    n = max(1, len(warm))

    def mean(key: str) -> float:
        vals = [float(r.get(key, 0.0)) for r in warm]
        return sum(vals) / n if vals else math.nan

    step_s = mean("step_seconds")
    upd_s = sum(float(r.get("update_seconds", 0.0)) for r in warm)
    rows = sum(float(r.get("rows", 0)) for r in warm)
    return {
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s if step_s > 0 else math.nan,
        "generation_s": mean("generation_seconds"),
        "tool_s": mean("tool_seconds"),
        "update_s": mean("update_seconds"),
        "push_s": mean("push_seconds"),  # TRL generates with the model it trains: none
        "samples_per_s": sum(float(r.get("rollouts", 0)) for r in warm) / max(1e-9, step_s * n),
        "trainer_tok_per_s": sum(float(r.get("tokens", 0.0)) for r in warm) / upd_s
        if upd_s > 0
        else math.nan,
        "rows_per_s": rows / max(1e-9, step_s * n) if warm else math.nan,
        "update_s_per_row": upd_s / rows if rows > 0 else math.nan,
    }


def full_step_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[float, int]:
    """Their step seconds over ours, summed over the timed steps (the first left out) in which both
    sides trained the same number of rows (all of them, on TRL's side), and how many such steps
    (pure): the speed-up at equal work with nothing dropped."""
    pairs = [
        (a, b)
        for a, b in zip(ours[1:], theirs[1:], strict=False)
        if float(a.get("rows", 0)) == float(b.get("rows", 0)) > 0
    ]
    if not pairs:
        return math.nan, 0
    return sum(b["step_seconds"] for _, b in pairs) / sum(a["step_seconds"] for a, _ in pairs), len(pairs)


def kuberl_steps(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kuberl's RL step records in the common shape (pure).

    Generation is the wait for the step's rollouts, tool calls included: they run concurrently
    with other rollouts' generation, so ``tool_seconds`` (summed over calls) overlaps it. Update
    is everything else of the step: weight push, pi_old recomputation and the optimizer step.
    """
    out = []
    for r in metrics:
        if r.get("type") != "rl":
            continue
        roll = float(r.get("rollout_seconds", 0.0))
        out.append(
            {
                "step": r["step"],
                "step_seconds": r["step_seconds"],
                "generation_seconds": roll,
                "tool_seconds": float(r.get("tool_seconds", 0.0)),
                "update_seconds": r["step_seconds"] - roll,
                "push_seconds": float(r.get("sync_seconds", 0.0)),  # part of update_seconds
                "rollouts": r.get("rollouts", 0),
                "rows": 0.0 if r.get("skipped") else float(r.get("rollouts_kept", r.get("rollouts", 0))),
                "tokens": 0.0 if r.get("skipped") else float(r.get("tokens", 0.0)),
                "reward_mean": r.get("reward_mean", math.nan),
            }
        )
    return out


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "n/a"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}" if len(xs) > 1 else f"{m:.3f}"


# -- subprocess sides ------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def child_kuberl(manifest: Path, out: Path) -> int:
    """In the child: run kuberl in-process so that RUSAGE_SELF is the trainer's own peak."""
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.trainer.local import run_job

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


def run_child(args: list[str], log: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    with log.open("w") as f:
        code = subprocess.run(
            [sys.executable, "-P", str(Path(__file__).resolve()), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, KUBERL_NO_RAY="1", TRL_EXPERIMENTAL_SILENCE="1"),
        ).returncode
    return code, time.monotonic() - t0


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


def child_eval(manifest: Path, folder: Path, out: Path) -> int:
    """Held-out accuracy of an HF folder exactly as kuberl's in-run evaluation computes it
    (TrainerRun._evaluate_on: the 256 eval problems, one sample at the run's temperature, the
    same seed, kuberl's rollout loop on a local vLLM server of ``folder``, sandbox verify)."""
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
    with (
        running_sandbox(workers=pool.workers_per_pod, limits=pool.limits) as sandbox,
        running_vllm(local_vllm_config(job, folder.resolve()), log_path=out / "vllm-eval.log") as url,
    ):
        make_tokenizer = functools.partial(BPETokenizer.from_str, tok.to_str())
        worker = RolloutWorker(None, make_tokenizer, sandbox, fleet=FleetSource(urls=(url,), engine="vllm"))
        try:
            groups = worker.rollouts(
                BatchRequest(
                    [template.render_prompt(p.question, spec.rollout.prompt_template) for p in probs],
                    [p.answer for p in probs],
                    1,
                    temperature=spec.rollout.temperature,
                    seed=spec.seed * 7919 + 17,
                    max_turns=spec.stage_max_turns(stage),
                    max_response_tokens=spec.stage_max_response_tokens(stage),
                )
            )
        finally:
            worker.close()
    acc = sum(g[0].reward for g in groups) / len(groups)
    (out / "eval.json").write_text(json.dumps({"accuracy": acc, "model": str(folder)}))
    return 0


# -- the orchestrating parent ------------------------------------------------------------------


def load_base() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(MANIFEST.read_text())


def prepare(out: Path) -> tuple[Path, float]:
    """kuberl's SFT stage of the real-model example, once; returns (HF folder, held-out accuracy)."""
    import yaml

    from kuberl.trainer.policy import model_dir as resolve

    folder = out / "sft-model"
    run = out / "sft-run"
    if not (folder / "config.json").exists():
        m = load_base()
        m["spec"]["stages"] = [s for s in m["spec"]["stages"] if s["type"] == "sft"]
        m["metadata"]["name"] = "peers-sft"
        path = out / "sft.yaml"
        path.write_text(yaml.safe_dump(m, sort_keys=False))
        code, wall = run_child(["--child", "kuberl", str(path), str(run)], out / "sft.log")
        if code:
            raise SystemExit(f"the SFT run failed ({code}): see {out / 'sft.log'}")
        print(f"SFT (kuberl, {m['spec']['stages'][0]['steps']} steps) in {wall:.0f} s")
        from kuberl.api.job import AgenticRLJob
        from kuberl.api.loader import find_one, load_manifests

        job = find_one(load_manifests(str(path)), AgenticRLJob)
        export_checkpoint(run, resolve(job, run), folder)
    evals = [r for r in _read_jsonl(run / "metrics.jsonl") if r.get("type") == "eval"]
    return folder, evals[-1]["accuracy"] if evals else math.nan


def run_side(kind: str, manifest: Path, out: Path, settings: Path | None = None) -> dict[str, Any]:
    """One side's run in its own subprocess; its step records and summary.

    ``out`` starts empty: a kuberl run finds an earlier run's checkpoints there and resumes it,
    so a second invocation with the same ``--out`` would report the first one's steps."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if kind == "trl":
        args = ["--child", "trl", str(settings), str(out), str(manifest)]
    else:
        args = ["--child", "kuberl", str(manifest), str(out)]
    code, wall = run_child(args, out.parent / f"{out.name}.log")
    if code:
        raise SystemExit(f"{kind} run failed ({code}): see {out.parent / (out.name + '.log')}")
    summary = json.loads((out / "summary.json").read_text())
    if kind == "trl":
        steps = _read_jsonl(out / "steps.jsonl")
        ev_out = out / "eval"
        code, _ = run_child(
            ["--child", "eval", str(manifest), summary["final_model"], str(ev_out)], out / "eval.log"
        )
        acc = json.loads((ev_out / "eval.json").read_text())["accuracy"] if code == 0 else math.nan
    else:
        metrics = _read_jsonl(out / "metrics.jsonl")
        steps = kuberl_steps(metrics)
        evals = [r for r in metrics if r.get("type") == "eval"]
        acc = evals[-1]["accuracy"] if evals else math.nan
    return {"steps": steps, "summary": summary, "wall": wall, "heldout": acc, **side_figures(steps)}


def report(results: dict[str, list[dict[str, Any]]], sft_acc: float, load: tuple, load_end: tuple) -> None:
    keys = [
        ("step_s", "step s (mean of steps 2..N)"),
        ("generation_s", "  generation s (tools inside)"),
        ("tool_s", "  tool calls s (sum of calls)"),
        ("update_s", "  update s (+push, +pi_old)"),
        ("push_s", "    of it weight push s"),
        ("steps_per_s", "RL steps/s"),
        ("samples_per_s", "samples/s"),
        ("trainer_tok_per_s", "trainer tok/s (trained tokens / update s)"),
        ("rows_per_s", "trained rows/s (equal work)"),
        ("update_s_per_row", "update s per trained row"),
        ("peak_rss_mb", "peak RSS MB (trainer process)"),
        ("peak_rss_children_mb", "peak RSS MB (largest child: vLLM server)"),
        ("heldout", "held-out accuracy after N steps"),
        ("reward_first", "train reward step 1"),
        ("reward_last", "train reward step N"),
    ]
    for runs in results.values():
        for r in runs:
            r["peak_rss_mb"] = r["summary"]["peak_rss_mb"]
            r["peak_rss_children_mb"] = r["summary"].get("peak_rss_children_mb", math.nan)
            r["reward_first"] = r["steps"][0].get("reward_mean", math.nan) if r["steps"] else math.nan
            r["reward_last"] = r["steps"][-1].get("reward_mean", math.nan) if r["steps"] else math.nan
    names = list(results)
    print(
        f"\nload average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at start, "
        f"{load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} at the end; held-out after SFT {sft_acc:.3f}"
    )
    print(f"{'':44s}" + "".join(f"{n:>22s}" for n in names))
    for k, label in keys:
        print(f"{label:44s}" + "".join(f"{spread([r[k] for r in results[n]]):>22s}" for n in names))
    for n in names:
        if not n.startswith("kuberl") or "trl" not in results:
            continue
        for k, label in (
            ("steps_per_s", "RL steps/s"),
            ("generation_s", "generation s"),
            ("update_s", "update s"),
            ("samples_per_s", "samples/s"),
            ("rows_per_s", "trained rows/s (equal work)"),
            ("update_s_per_row", "update s per trained row"),
        ):
            ours = sum(r[k] for r in results[n]) / len(results[n])
            theirs = sum(r[k] for r in results["trl"]) / len(results["trl"])
            print(f"{n}/trl {label}: {ours / theirs:.2f}x")
        pairs = [full_step_ratio(a["steps"], b["steps"]) for a, b in zip(results[n], results["trl"], strict=False)]
        both = [(x, k) for x, k in pairs if k]
        if both:
            mean = sum(x * k for x, k in both) / sum(k for _, k in both)
            print(f"{n}/trl speed-up on steps where both trained every row: {mean:.2f}x "
                  f"({sum(k for _, k in both)} steps over {len(both)} seeds)")
    print("reward curves (mean over seeds, per step):")
    for n in names:
        curve = [
            sum(r["steps"][i].get("reward_mean", math.nan) for r in results[n]) / len(results[n])
            for i in range(min(len(r["steps"]) for r in results[n]))
        ]
        print(f"  {n:12s} " + " ".join(f"{x:.3f}" for x in curve))


def heldout_file(out: Path, n: int) -> Path:
    """The first ``n`` of kuberl's builtin held-out problems as a jsonl (a smaller eval, same stream)."""
    from kuberl.trainer import data as data_mod
    from kuberl.trainer.problems import EVAL_SIZE

    probs = data_mod.load_problems("builtin:arith", EVAL_SIZE, data_mod.EVAL_SEED_OFFSET)[:n]
    path = out / f"heldout-{n}.jsonl"
    path.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in probs))
    return path


def save(out: Path, results: dict, sft_acc: float, load: tuple) -> None:
    """After every side: a run cut short still reports what finished (``--report``)."""
    doc = {"results": results, "sft_acc": sft_acc, "load": load, "load_now": os.getloadavg()}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        # a terminated child leaves through its context managers (sandbox, vLLM server)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        kind, *rest = argv[1:]
        if kind == "kuberl":
            return child_kuberl(Path(rest[0]), Path(rest[1]))
        if kind == "trl":
            return child_trl(Path(rest[0]), Path(rest[1]), Path(rest[2]))
        return child_eval(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--kuberl-engines", nargs="+", default=["vllm", "local"], choices=["vllm", "local"])
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--heldout", type=int, default=128, help="held-out problems evaluated after RL")
    ap.add_argument("--out", default="/tmp/kuberl-peers")
    ap.add_argument(
        "--precision", choices=["float32", "bf16"], default=None,
        help="both sides' update: kuberl's trainer.precision, TRL's bf16 (default: the example's)",
    )  # fmt: skip
    ap.add_argument("--report", action="store_true", help="only print the table of --out's results.json")
    args = ap.parse_args(argv)
    import yaml

    out = Path(args.out)
    if args.report:
        doc = json.loads((out / "results.json").read_text())
        report(doc["results"], doc["sft_acc"], tuple(doc["load"]), tuple(doc["load_now"]))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    folder, sft_acc = prepare(out)
    held = str(heldout_file(out, args.heldout).resolve())
    results: dict[str, list[dict[str, Any]]] = {}
    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests

    def manifest(seed: int, engine: str, name: str) -> Path:
        m = rl_manifest(
            load_base(),
            str(folder.resolve()),
            steps=args.steps,
            seed=seed,
            engine=engine,
            prompts=args.prompts,
            group=args.group,
            heldout=held,
            precision=args.precision,
        )
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(m, sort_keys=False))
        return path

    def done(name: str, label: str, r: dict[str, Any]) -> None:
        results.setdefault(label, []).append(r)
        save(out, results, sft_acc, load)
        print(f"{name}: step {r['step_s']:.1f} s, held-out {r['heldout']:.3f}", flush=True)

    for seed in args.seeds:
        if not args.no_trl:  # first: the side whose failure would waste the others' time
            path = manifest(seed, "vllm", f"trl-s{seed}")
            job = find_one(load_manifests(str(path)), AgenticRLJob)
            settings = out / f"trl-s{seed}.json"
            threads = job.spec.trainer.threads or 2
            settings.write_text(json.dumps(trl_settings(job, str(folder.resolve()), "", threads)))
            done(f"trl-s{seed}", "trl", run_side("trl", path, out / f"trl-s{seed}", settings))
        for engine in args.kuberl_engines:
            name = f"kuberl-{engine}-s{seed}"
            done(name, f"kuberl-{engine}", run_side("kuberl", manifest(seed, engine, name), out / name))
    report(results, sft_acc, load, os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
