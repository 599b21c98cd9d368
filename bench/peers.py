"""Benchmark: kuberl vs Hugging Face TRL's GRPOTrainer on the same real model, data, tool and reward.

One invocation runs, on this machine, RL through kuberl and through TRL 1.16
(``pip install -e '.[bench]'``), each side in its own subprocess so that its peak RSS is its own:

- model: SmolLM2-135M-Instruct (``kuberl:smollm2-135m-instruct``) after kuberl's short SFT on
  tool-call traces (examples/smollm2-cpu.yaml's SFT stage, run once here and exported as an HF
  folder both sides start from: the raw model does not call tools);
- prompts: the pool kuberl draws for the RL stage (``builtin:arith``), in the same order;
- tool: kuberl's Python sandbox (one service per side, same limits), through each framework's
  own tool-calling path (kuberl's rollout loop; TRL's ``tools=`` loop, with a chat template that
  renders kuberl's compact ChatML format and TRL's Qwen response parser for ``<tool_call>``);
- reward: 1 when the sandbox's math-verify accepts the final ``<answer>`` (both sides).

``--setup users`` (the default): time to accuracy, each trainer as its users run it.

- kuberl: the example's RL stage as written (GRPO-RoC, G = 4 kept of 8 sampled, 4 prompts a
  step, micro-batches), on its vLLM server, at ``--async-level`` (1: bench/README.md's
  asynchronous RL) and ``--precision`` (bf16 by default: 1.53x the float32 update on this
  AVX512-BF16 CPU, bench/logs/update-bf16-2026-11-28.log; the server samples in float32);
  :func:`user_manifest`.
- TRL: GRPOTrainer with the same model, prompts, tool, reward, group size, prompts a step,
  learning rate, temperature and token limits, its own defaults elsewhere (its AdamW and linear
  decay over the example's 40 steps, of which the first ``--steps`` run); :func:`trl_user_settings`.
  Generation through transformers ``model.generate`` in float32, its fastest path that runs
  here (bench/peers_trl_gen.py: its default bf16 autocasts generation, 3.7x slower on this CPU).
- Held-out accuracy (the same ``--heldout`` problems) at every step's wall-clock: both sides
  save the policy after every step and, after the run, one evaluator (``peers_children.child_eval``:
  kuberl's rollout loop, one sample at the run's temperature and seed, on a vLLM server that
  reloads each saved policy in place) scores them all. Why saving, not evaluating inside the
  run: one evaluator for both sides (TRL's own generate would score differently), nothing
  evaluated on either training clock, and at ~0.5 GB a policy it costs TRL a save that is
  taken off its clock and kuberl nothing (it writes every version for its vLLM server anyway;
  those folders are hard-linked as they appear). Step 0, the shared SFT start, is scored once.
  Then: TRL's final accuracy, kuberl's time to reach it, the two at equal wall-clock, and a PNG.

``--setup equal``: the equal-work comparison (plain GRPO at P prompts x G samples on both sides,
every training setting mapped one to one by :func:`trl_settings`; rows/s and steps/s).

    python bench/peers.py [--steps 8] [--seeds 0 1 2] [--heldout 64] [--eval-every 1] [--out DIR]
                          [--setup users|equal] [--async-level 1] [--precision float32|bf16]
                          [--kuberl-engines vllm local] (equal) [--plot bench/peers-time-to-accuracy.png]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import peers_children  # noqa: E402  (bench/ is not a package: its siblings are on sys.path)
from peers_report import (  # noqa: E402,F401  (the figures live there; tests reach them here)
    full_step_ratio,
    kuberl_steps,
    report,
    report_curves,
    side_figures,
    spread,
)

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


def user_manifest(
    base: dict[str, Any],
    model_dir: str,
    *,
    steps: int,
    seed: int,
    heldout: str,
    async_level: int,
    precision: str,
) -> dict[str, Any]:
    """The kuberl side as its users run it: ``base``'s RL stage with its settings as written
    (GRPO-RoC, group, oversampling, batch, micro-batches), ``steps`` of it from ``model_dir``, at
    ``async_level`` and ``precision`` (what bench/README.md recommends), evaluated on ``heldout``
    (pure). No checkpoint is written inside the measured steps."""
    m = copy.deepcopy(base)
    spec = m["spec"]
    rl = [s for s in spec["stages"] if s["type"] == "rl"]
    if not rl:
        raise ValueError("the base manifest has no rl stage to compare")
    spec["stages"] = [dict(rl[0], steps=steps)]
    spec["model"] = {"base": model_dir}
    spec["seed"] = seed
    spec["data"]["eval"] = [heldout]
    spec["algorithm"]["asyncLevel"] = async_level
    spec.setdefault("trainer", {})["precision"] = precision
    spec["checkpoint"] = dict(spec.get("checkpoint", {}), everySteps=max(steps + 1, 1))
    m["metadata"]["name"] = f"peers-users-s{seed}"
    return m


def trl_user_settings(job, model_dir: str, threads: int, horizon: int) -> dict[str, Any]:
    """TRL GRPOTrainer as its users would run the same job (pure): the same model, prompts (kuberl's
    pool, in its order), group size, prompts per step, learning rate, temperature and token
    limits; TRL's own defaults elsewhere (its AdamW, its linear decay over ``horizon`` steps, the
    manifest's stage length as written, of which the first ``stage.steps`` run), float32 (its
    fastest generation here: its default bf16 autocasts ``generate``), gradient checkpointing
    off (recomputing only slows a CPU step) and the batch taken one group per forward
    (gradient accumulation), as kuberl's example bounds its update's memory.
    """
    spec = job.spec
    a = spec.algorithm
    idx, stage = next((i, s) for i, s in enumerate(spec.stages) if s.type == "rl")
    if horizon < stage.steps:
        raise ValueError(f"the schedule's horizon ({horizon} steps) must cover the {stage.steps} steps run")
    batch = stage.batch_size or a.batch_prompts
    lr = stage.learning_rate or a.learning_rate
    return {
        "model": model_dir,
        "sandbox_url": "",
        "threads": threads,
        "data": stage.data or spec.data.train,
        "pool_size": stage.steps * batch,
        "pool_seed": spec.data.seed + 1000 * (idx + 1),
        "learning_rate": lr,
        "kuberl_optimizer": False,
        "stop_after": stage.steps,
        "save_policies": True,
        "grpo_config": {
            "max_steps": horizon,
            # batch prompts x G rows an optimizer step, one group per forward: the memory bound
            # kuberl's example sets (microBatchTokens 1024 ~ 4 rows), the same gradient
            "per_device_train_batch_size": a.group_size,
            "gradient_accumulation_steps": batch,
            "num_generations": a.group_size,
            "learning_rate": lr,
            "max_completion_length": spec.stage_max_response_tokens(stage),
            "max_tool_calling_iterations": spec.stage_max_turns(stage) - 1,
            "temperature": spec.rollout.temperature,
            "top_p": spec.rollout.top_p,
            "shuffle_dataset": False,  # kuberl walks its pool in order
            "seed": spec.seed,
            "use_cpu": True,
            # TRL's bf16 (its default) autocasts generation too: every decoded token recasts the
            # weights, 3.7x slower here (bench/peers_trl_gen.py); float32 is its fastest path
            "bf16": False,
            "gradient_checkpointing": False,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "log_completions": False,
        },
    }


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


def kuberl_clock(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """step -> training wall-clock at its end, from the start of the first RL step (pure): the
    records' write times, so that whatever runs between steps counts; the first step's own
    ``step_seconds`` places the start. Records without times: the sum of step seconds."""
    rl = [r for r in metrics if r.get("type") == "rl"]
    if not rl:
        return {}
    if all(r.get("time") is not None for r in rl):
        start = float(rl[0]["time"]) - float(rl[0]["step_seconds"])
        return {int(r["step"]): float(r["time"]) - start for r in rl}
    return trl_clock(rl)


def trl_clock(steps: list[dict[str, Any]]) -> dict[int, float]:
    """step -> the running sum of step seconds (pure): TRL's records time each step from the end
    of the previous one (or ``train()``'s start), the policy saves left out."""
    clock, total = {}, 0.0
    for r in steps:
        total += float(r["step_seconds"])
        clock[int(r["step"])] = total
    return clock


def policy_step(name: str) -> int:
    """The step a saved policy folder holds: kuberl's pushed versions are ``vNNNNNNNN`` (the
    global step), TRL's saves ``step-NNNN`` (pure)."""
    digits = name[1:] if name.startswith("v") else name.removeprefix("step-")
    if not digits.isdigit():
        raise ValueError(f"{name!r} is not a saved policy folder (vNNNNNNNN or step-NNNN)")
    return int(digits)


def eval_steps(steps: list[int], every: int) -> list[int]:
    """The steps whose policies are scored: every ``every``-th and always the last (pure)."""
    if every < 1:
        raise ValueError(f"--eval-every must be >= 1, got {every}")
    trained = sorted(s for s in steps if s > 0)
    return [s for s in trained if s % every == 0 or s == trained[-1]]


# -- subprocess sides ------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


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
        peers_children.export_checkpoint(run, resolve(job, run), folder)
    evals = [r for r in _read_jsonl(run / "metrics.jsonl") if r.get("type") == "eval"]
    return folder, evals[-1]["accuracy"] if evals else math.nan


def run_side_child(
    kind: str, manifest: Path, out: Path, settings: Path | None, *extra: str
) -> tuple[dict[str, Any], float]:
    """One side's training child (``extra``: kuberl's further arguments): its summary and wall time."""
    if kind == "trl":
        args = ["--child", "trl", str(settings), str(out), str(manifest)]
    else:
        args = ["--child", "kuberl", str(manifest), str(out), *extra]
    code, wall = run_child(args, out.parent / f"{out.name}.log")
    if code:
        raise SystemExit(f"{kind} run failed ({code}): see {out.parent / (out.name + '.log')}")
    return json.loads((out / "summary.json").read_text()), wall


def run_side(kind: str, manifest: Path, out: Path, settings: Path | None = None) -> dict[str, Any]:
    """One side's run in its own subprocess; its step records and summary.

    ``out`` starts empty: a kuberl run finds an earlier run's checkpoints there and resumes it,
    so a second invocation with the same ``--out`` would report the first one's steps."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    summary, wall = run_side_child(kind, manifest, out, settings)
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


def run_timed_side(
    kind: str, manifest: Path, out: Path, base: Path, every: int, settings: Path | None = None,
    score_base: bool = False,
) -> dict[str, Any]:
    """One side's run, saving its policy after every step, then the evaluator scoring the policies
    of :func:`eval_steps` (and, with ``score_base``, the shared start) on one vLLM server; the
    saved policies are deleted after. Returns the run's step records, clock, accuracies by step
    and summary."""  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    policies = out / "policies"
    summary, wall = run_side_child(kind, manifest, out, settings, str(policies))
    if kind == "trl":
        steps = _read_jsonl(out / "steps.jsonl")
        clock = trl_clock(steps)
    else:
        metrics = _read_jsonl(out / "metrics.jsonl")
        steps, clock = kuberl_steps(metrics), kuberl_clock(metrics)
    saved = {policy_step(d.name): d for d in policies.iterdir() if d.is_dir()} if policies.is_dir() else {}
    chosen = [saved[s] for s in eval_steps([s for s in saved if s in clock], every)]
    items = (["base"] if score_base else []) + [str(d) for d in chosen]
    code, ev_wall = run_child(["--child", "eval", str(manifest), str(base), str(out / "eval"), *items], out / "eval.log")
    if code:
        raise SystemExit(f"the evaluation of {kind}'s policies failed ({code}): see {out / 'eval.log'}")
    ev = json.loads((out / "eval" / "eval.json").read_text())
    shutil.rmtree(policies, ignore_errors=True)  # ~0.5 GB a policy
    for bulky in ("checkpoints", "weights", "trl"):  # kuberl's ~1.5 GB checkpoints and versions, TRL's output
        shutil.rmtree(out / bulky, ignore_errors=True)
    shutil.rmtree(out / "final-model", ignore_errors=True)  # TRL's last policy, saved twice
    accs = {policy_step(Path(k).name): v for k, v in ev["accuracies"].items() if k != "base"}
    return {
        "steps": steps, "summary": summary, "wall": wall, "clock": clock, "evals": accs,
        "base_acc": ev["accuracies"].get("base"), "eval_wall": ev_wall,
        "eval_s_per_policy": sum(ev["seconds"].values()) / max(1, len(ev["seconds"])),
        "heldout": accs[max(accs)] if accs else math.nan, **side_figures(steps),
    }  # fmt: skip


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


def run_users(args: argparse.Namespace, out: Path, folder: Path, held: str, sft_acc: float, load: tuple) -> None:
    """Time to accuracy: per seed, TRL and kuberl back to back (alternating which goes first, so
    that a load trend weighs on both alike), each policy scored after its run; then the curves."""
    import yaml

    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests

    base = load_base()
    written = next(s for s in base["spec"]["stages"] if s["type"] == "rl")["steps"]
    results: dict[str, list[dict[str, Any]]] = {"trl": [], "kuberl": []}
    start_acc: float | None = None
    sides = ("trl", "kuberl")
    if args.no_trl:  # kuberl's side again beside TRL's runs already in --out (same seeds, same start)
        prior = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
        results["trl"] = prior.get("results", {}).get("trl", [])
        if len(results["trl"]) != len(args.seeds):
            raise SystemExit(
                f"--no-trl keeps TRL's runs from {out / 'results.json'}: it holds {len(results['trl'])} "
                f"of them, the seeds {args.seeds} need {len(args.seeds)}; run both sides there first"
            )
        start_acc, sides = prior["start_acc"], ("kuberl",)
    for i, seed in enumerate(args.seeds):
        m = user_manifest(
            base, str(folder.resolve()), steps=args.steps, seed=seed, heldout=held,
            async_level=args.async_level, precision=args.precision or "bf16",
        )  # fmt: skip
        path = out / f"users-s{seed}.yaml"
        path.write_text(yaml.safe_dump(m, sort_keys=False))
        job = find_one(load_manifests(str(path)), AgenticRLJob)
        settings = out / f"trl-s{seed}.json"
        threads = job.spec.trainer.threads or 2
        settings.write_text(json.dumps(trl_user_settings(job, str(folder.resolve()), threads, max(written, args.steps))))
        for side in sides if i % 2 == 0 else sides[::-1]:
            r = run_timed_side(
                side, path, out / f"{side}-s{seed}", folder, args.eval_every,
                settings if side == "trl" else None, score_base=start_acc is None,
            )  # fmt: skip
            if start_acc is None:
                start_acc = r["base_acc"]
            results[side].append(r)
            doc = {"results": results, "sft_acc": sft_acc, "start_acc": start_acc, "load": load}
            (out / "results.json").write_text(json.dumps({**doc, "load_now": os.getloadavg()}, indent=1, default=str))
            ev = ", ".join(f"{s}:{a:.3f}" for s, a in sorted(r["evals"].items()))
            print(
                f"{side}-s{seed}: {len(r['steps'])} steps in {max(r['clock'].values()):.0f} s of training clock "
                f"(run {r['wall']:.0f} s), held-out by step {ev}; eval {r['eval_wall']:.0f} s "
                f"({r['eval_s_per_policy']:.1f} s a policy), load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    report(results, sft_acc, load, os.getloadavg())
    report_curves(results, start_acc if start_acc is not None else sft_acc, Path(args.plot))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        # a terminated child leaves through its context managers (sandbox, vLLM server)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return peers_children.child_main(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--kuberl-engines", nargs="+", default=["vllm", "local"], choices=["vllm", "local"])
    ap.add_argument(
        "--no-trl", action="store_true",
        help="kuberl's side only (--setup users: beside the TRL runs already in --out's results.json)",
    )
    ap.add_argument("--heldout", type=int, default=128, help="held-out problems evaluated after RL")
    ap.add_argument("--out", default="/tmp/kuberl-peers")
    ap.add_argument(
        "--precision", choices=["float32", "bf16"], default=None,
        help="both sides' update: kuberl's trainer.precision, TRL's bf16 (default: the example's)",
    )  # fmt: skip
    ap.add_argument("--report", action="store_true", help="only print the table of --out's results.json")
    ap.add_argument(
        "--setup", choices=["users", "equal"], default="users",
        help="users: each trainer as its users run it, held-out accuracy against wall-clock at every "
        "step (time to accuracy); equal: plain GRPO at equal batch on both sides (equal work)",
    )  # fmt: skip
    ap.add_argument("--async-level", type=int, default=1, help="kuberl's asyncLevel (--setup users)")
    ap.add_argument("--eval-every", type=int, default=1, help="score every k-th step's policy (--setup users)")
    ap.add_argument("--plot", default=str(REPO / "bench" / "peers-time-to-accuracy.png"))
    args = ap.parse_args(argv)
    import yaml

    out = Path(args.out)
    if args.report:
        doc = json.loads((out / "results.json").read_text())
        report(doc["results"], doc["sft_acc"], tuple(doc["load"]), tuple(doc["load_now"]))
        if "start_acc" in doc:
            report_curves(doc["results"], doc["start_acc"], Path(args.plot))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    folder, sft_acc = prepare(out)
    held = str(heldout_file(out, args.heldout).resolve())
    results: dict[str, list[dict[str, Any]]] = {}
    if args.setup == "users":
        run_users(args, out, folder, held, sft_acc, load)
        return 0
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
