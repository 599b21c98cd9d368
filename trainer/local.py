"""``kuberl run FILE``: run an AgenticRLJob on this machine (the embedded default).

Ray is the execution engine: the driver (this process) holds the trainable model and runs
the update; the rollout side - LocalEngine + Scheduler + sandbox client, which also computes
rewards through the sandbox's verifier - is a Ray actor (``rollout.client.RayClient``). By
default a local Ray instance is started; with ``RAY_ADDRESS`` set the same code joins that
cluster. ``KUBERL_NO_RAY=1`` runs the worker in-process (``InProcessClient``: the same worker
minus Ray) for debugging and for the fast end-to-end test.

The sandbox is the real one (``kuberl.sandbox.service.local.running_sandbox``) started as a subprocess
with the job's inline pool limits, unless ``KUBERL_SANDBOX_URL`` points at a running service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import ManifestError, find_one, load_manifests
from kuberl.rollout.client import InProcessClient, RayClient
from kuberl.rollout.discovery import parse_url_list
from kuberl.rollout.fleet import FleetSource
from kuberl.rollout.http_engine import EngineError
from kuberl.rollout.vllm_server import SHM_BACKEND, VLLMServerConfig, running_vllm, vllm_python
from kuberl.rollout.worker import RolloutWorker
from kuberl.trainer.checkpoint import CheckpointStore
from kuberl.trainer.data import build_sft_traces
from kuberl.trainer.distributed import DistContext, load_from_rank0, shard_policy
from kuberl.trainer.hf import meta_hf_policy, policy_from_config
from kuberl.trainer.metrics import MetricsSink, NullSink
from kuberl.trainer.policy import (
    BUILTIN_MODEL,
    build_policy,
    build_tokenizer,
    check_chat_template,
    is_builtin,
    model_dir,
    same_architecture,
)
from kuberl.trainer.precision import bf16_warning, cpu_flags
from kuberl.trainer.progress import LogProgress, step_figures, use_plain
from kuberl.trainer.shm_weights import SharedMemorySlots, shm_root
from kuberl.trainer.stage_host import RunResult
from kuberl.trainer.stages import Pipeline, seed_everything
from kuberl.trainer.step_record import StepRecord
from kuberl.trainer.tokenizer import BPETokenizer
from kuberl.trainer.tracking import check_installed, open_trackers
from kuberl.trainer.weight_sync import DiskWeights, DiskWeightSync


def _device(job: AgenticRLJob) -> torch.device:
    d = job.spec.trainer.device
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        raise ManifestError("trainer.device is cuda but no CUDA device is available")
    return torch.device(d)


LOCAL_VLLM = FleetSource(engine="vllm")
"""``rollout_target``'s answer for ``spec.rollout.engine: vllm`` with no engines named: run_job
starts a local vLLM server (``rollout.vllm_server``) for the run and rolls out on it."""
LOCAL_VLLM_RECONNECT_S = 600.0  # a vLLM restart on a CPU: model load plus start-up, with room


def rollout_target(job: AgenticRLJob, engines: FleetSource | None) -> FleetSource | None:
    """Where rollouts run: the fleet named by ``--engines`` or the environment, a local vLLM
    server (:data:`LOCAL_VLLM`), or None for the in-process LocalEngine (``spec.rollout.engine``:
    auto picks the fleet when one is named)."""
    choice = job.spec.rollout.engine
    fleet = engines or FleetSource.from_env()
    if choice == "local":
        if engines is not None:
            raise ManifestError(
                "--engines conflicts with spec.rollout.engine: local; set it to auto, sglang or vllm"
            )
        return None
    if fleet is not None and is_builtin(job):
        raise ManifestError(
            f"{BUILTIN_MODEL} runs on the local engine only (inference servers serve Hugging Face models); "
            "set spec.rollout.engine: local or use an HF model"
        )
    if choice == "sglang" and fleet is None:
        raise ManifestError(
            "spec.rollout.engine is sglang but no engines are named: pass --engines URL[,URL...] or run "
            "in a trainer pod (KUBERL_ROLLOUT_FLEET)"
        )
    if choice == "vllm" and fleet is None:
        if is_builtin(job):
            raise ManifestError(
                f"spec.rollout.engine is vllm but the model is {BUILTIN_MODEL}, which vLLM cannot serve; "
                "use an HF model (e.g. kuberl models prepare smollm2-135m-instruct DIR) or engine: local"
            )
        return LOCAL_VLLM
    if fleet is not None and choice in ("sglang", "vllm") and fleet.engine != choice:
        if engines is None and os.environ.get("KUBERL_ROLLOUT_ENGINE"):
            raise ManifestError(
                f"spec.rollout.engine is {choice} but the fleet's engines are {fleet.engine} "
                "(KUBERL_ROLLOUT_ENGINE); make spec.rollout.engine match the RolloutFleet's spec.engine.type"
            )
        fleet = dataclasses.replace(fleet, engine=choice)
    return fleet


def engine_dtype(job: AgenticRLJob) -> str:
    """The engines' dtype: the inline fleet's ``engine.dtype``, else $KUBERL_ROLLOUT_DTYPE (the
    operator sets it from a referenced fleet), else auto (the model's own)."""
    fleet = job.spec.rollout.fleet
    if fleet is not None and fleet.engine.dtype != "auto":
        return fleet.engine.dtype
    return os.environ.get("KUBERL_ROLLOUT_DTYPE", "").strip() or "auto"


def local_vllm_config(job: AgenticRLJob, model: Path) -> VLLMServerConfig:
    """The local server for a job: its inline fleet's context length, extra args and dtype; the
    context defaults to the job's longest response budget plus room for the prompt."""
    fleet = job.spec.rollout.fleet
    longest = max(
        [job.spec.rollout.max_response_tokens] + [s.max_response_tokens or 0 for s in job.spec.stages]
    )
    context = (fleet.engine.context_length if fleet and fleet.engine.context_length else None) or max(
        2048, longest + 1024
    )
    extra = list(fleet.engine.extra_args) if fleet else []
    dtype = engine_dtype(job)
    return VLLMServerConfig(
        model=str(model), served_name="policy", max_model_len=context, extra_args=extra, dtype=dtype,
        weight_transfer=SHM_BACKEND if shared_memory_pushes() else None,
    )  # fmt: skip


def shared_memory_pushes(env: dict[str, str] | None = None) -> bool:
    """Whether a local vLLM server takes the trainer's weights from shared memory (the default;
    ``KUBERL_VLLM_SHM=0`` makes every version a checkpoint folder it reloads, as a fleet's do)."""
    value = (os.environ if env is None else env).get("KUBERL_VLLM_SHM", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", ""):
        raise ManifestError(f"KUBERL_VLLM_SHM={value!r}: use 1 (shared memory, the default) or 0 (folders)")
    return value not in ("0", "false", "no")


def weights_dir(out: Path, explicit: str | None) -> Path:
    """The folder shared with the fleet's engines (``--weights-dir`` or $KUBERL_WEIGHTS_DIR)."""
    where = explicit or os.environ.get("KUBERL_WEIGHTS_DIR")
    if not where:
        raise ManifestError(
            "rollouts on a fleet need a folder the engines can read for weight updates: "
            "give the RolloutFleet spec.weightSync (a ReadWriteMany PVC; the operator mounts it), "
            "or pass --weights-dir on a shared filesystem"
        )
    return Path(where)


SANDBOX_READY_TIMEOUT_S = 600.0


@contextlib.contextmanager
def _sandbox(job: AgenticRLJob):
    url = os.environ.get("KUBERL_SANDBOX_URL")
    if url:
        # a trainer pod starts beside its pool's pods, which warm their workers before Ready
        from kuberl.sandbox.service.client import SandboxError, wait_ready

        try:
            waited = wait_ready(url, SANDBOX_READY_TIMEOUT_S, say=lambda line: print(line, file=sys.stderr, flush=True))
        except SandboxError as err:
            raise ManifestError(str(err)) from err
        if waited >= 1:
            print(f"the sandbox service at {url} is ready after {waited:.0f} s", file=sys.stderr, flush=True)
        yield url
        return
    try:
        from kuberl.sandbox.service.local import running_sandbox
    except ImportError as err:
        raise ManifestError(
            f"the local sandbox service is not available ({err}); start one and set KUBERL_SANDBOX_URL"
        ) from err

    pool = job.spec.sandbox.pool
    workers = pool.workers_per_pod if pool is not None else 2
    limits = pool.limits if pool is not None else None
    with running_sandbox(workers=workers, limits=limits) as base_url:
        yield base_url


def run_job(
    job: AgenticRLJob,
    out_dir: str | Path,
    *,
    algorithm: str | None = None,
    max_minutes: float | None = None,
    use_ray: bool | None = None,
    executor_factory=None,
    engine_factory=None,
    engines: FleetSource | None = None,
    weights_path: str | None = None,
    quiet: bool = False,
) -> RunResult:
    """Run every stage of ``job``; returns the history and eval accuracies.

    A checkpoint under the job's ``checkpoint.uri`` is resumed, with the tokenizer stored in it
    (the model's embeddings are indexed by that vocabulary). ``executor_factory`` and
    ``engine_factory`` replace the sandbox client and the LocalEngine (see ``RolloutWorker``).
    ``engines`` (else the environment, see :func:`rollout_target`) puts the rollouts on an
    SGLang fleet, which loads each new policy version from ``weights_path``.

    Under torchrun (``WORLD_SIZE`` > 1) every rank runs this: the policy is FSDP-sharded
    over the ranks and rank 0 alone has the sandbox, the rollout worker, the checkpoint writes,
    the metrics and the console (see :mod:`kuberl.trainer.distributed`).
    """
    t_start = time.time()
    spec = job.spec
    check_installed(job)
    algo = algorithm or spec.algorithm.name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = DistContext.from_env()
    main = ctx.is_main
    if use_ray is None:
        use_ray = os.environ.get("KUBERL_NO_RAY", "") in ("", "0")
    if spec.trainer.threads:
        torch.set_num_threads(spec.trainer.threads)
    device = _device(job)
    check_world_size(job, ctx.world_size)
    ctx.init(device.type)
    device = ctx.device(device.type)
    servers = contextlib.ExitStack()  # a local vLLM server lives as long as the run
    try:
        seed_everything(spec.seed)
        uri = spec.checkpoint.uri
        if not uri.startswith("s3://") and out_dir is not None and not Path(uri).is_absolute():
            uri = str(out / "checkpoints")
        store = CheckpointStore(uri, keep=spec.checkpoint.keep)
        fleet = rollout_target(job, engines)
        shm = False  # a local vLLM server on this host takes raw weights from shared memory
        if fleet is LOCAL_VLLM:
            if ctx.world_size > 1:
                raise ManifestError("a local vLLM server serves one trainer process; run without torchrun")
            try:
                vllm_python()
            except RuntimeError as err:
                raise ManifestError(f"spec.rollout.engine is vllm: {err}") from err
            served = model_dir(job, out).resolve()
            check_chat_template(served, spec.rollout.prompt_template)
            url = servers.enter_context(
                running_vllm(local_vllm_config(job, served), log_path=out / "vllm-server.log", keep_running=True)
            )
            # the run restarts its server when it dies (as a kubelet would a pod): rollouts and
            # pushes wait for it, and its weight labels say when it needs this version again
            fleet = FleetSource(urls=(url,), engine="vllm", reconnect_s=LOCAL_VLLM_RECONNECT_S)
            weights_path = weights_path or str(out / "weights")
            shm = shared_memory_pushes()
        shared = weights_dir(out, weights_path).resolve() / job.metadata.name if fleet is not None else None
        payload = store.load() if main else None
        for name in ("events.jsonl", "metrics.jsonl"):
            if payload is not None and not (out / name).exists():
                # a restarted pod's run folder is new: continue the run's events and step records,
                # kept beside the checkpoints, rather than replace them with this pod's alone
                store.get_file(name, out / name)
        # Rank 0 settles the tokenizer (trained, cached or from the checkpoint) and fetches an
        # HF model into the cache before the other ranks read them.
        tok_json = None
        if main:
            tok = build_tokenizer(job, out, None if payload is None else payload["tokenizer"])
            if payload is not None:
                tok.save(out / "tokenizer.json")  # what this run folder's artifacts were made with
            tok_json = tok.to_str()
            if not is_builtin(job):
                model_dir(job, out)
        tok = BPETokenizer.from_str(ctx.broadcast(tok_json))
        # An HF model on several ranks: rank 0 alone fetches and reads it (kept on the CPU until
        # sharded); the others build its architecture on the meta device from rank 0's config
        # and receive their shards.
        from_rank0 = ctx.enabled and not is_builtin(job)
        model = build_policy(job, tok, out) if main or not from_rank0 else None
        if from_rank0:
            hf = ctx.broadcast((model.hf.config.to_dict(), model.config.path) if main else None)
            model = model if main else meta_hf_policy(*hf)
        else:
            model = model.to(device)
        if payload is not None and not same_architecture(payload.get("model_config"), model.config.to_dict()):
            raise ManifestError(
                f"the checkpoint in {store.uri} is of a model with config {payload['model_config']}, "
                f"but the job builds {model.config.to_dict()}; point checkpoint.uri elsewhere to start afresh"
            )
        n_params = model.num_params()
        full = dict(model.state_dict()) if from_rank0 and main else None
        shard_policy(model, ctx, device.type)
        if from_rank0:
            load_from_rank0(model, full, ctx, device)
            del full
        result = _run_pipeline(
            job, out, ctx, model, tok, store, payload, fleet, shared, n_params, shm=shm,
            algorithm=algo, t_start=t_start, max_minutes=max_minutes, use_ray=use_ray,
            executor_factory=executor_factory, engine_factory=engine_factory, quiet=quiet or not main, device=device,
        )  # fmt: skip
        ctx.leave_together()  # see DistContext.close
    finally:
        servers.close()
        ctx.close()
    return result


def check_world_size(job: AgenticRLJob, world: int) -> None:
    """Every rank needs at least one example of every step (FSDP forwards are collective)."""
    if world <= 1:
        return
    for stage in job.spec.stages:
        size = stage.batch_size or (32 if stage.type == "sft" else job.spec.algorithm.batch_prompts)
        if stage.type == "sft" and size < world:
            raise ManifestError(
                f"stage '{stage.name}': batchSize {size} is smaller than the {world} trainer processes"
            )


def _run_pipeline(
    job, out, ctx, model, tok, store, payload, fleet, shared, n_params, *, shm, algorithm, t_start, max_minutes,
    use_ray, executor_factory, engine_factory, quiet, device,
) -> RunResult:  # fmt: skip
    spec = job.spec
    main = ctx.is_main
    console, progress = _ui(quiet)
    listeners: list[Any] = []
    if main and not quiet and progress is None:
        listeners.append(LogProgress([(s.name, s.type, s.steps) for s in spec.stages]))
    if main:
        listeners.extend(open_trackers(job, out, store, resume=payload is not None))
    sink = MetricsSink(job.metadata.name, out, listeners) if main else NullSink()
    sink.describe_run([{"name": s.name, "type": s.type, "steps": s.steps} for s in spec.stages])
    tasks: dict[str, Any] = {}

    def on_progress(stage: str, step: int, total: int, rec: StepRecord) -> None:
        if progress is None:
            return
        if stage not in tasks:
            tasks[stage] = progress.add_task(stage, total=total, info="")
        progress.update(tasks[stage], completed=step, info=_brief(rec))

    with contextlib.ExitStack() as stack:
        stack.callback(sink.close)  # last out: trackers see the final records and events
        client = None
        if main:
            sandbox_url = None
            if executor_factory is None:
                sandbox_url = stack.enter_context(_sandbox(job))
            # the worker builds its own policy and tokenizer (in the Ray actor's process)
            make_policy = None if fleet else functools.partial(policy_from_config, model.config.to_dict())
            wargs = (make_policy, functools.partial(BPETokenizer.from_str, tok.to_str()), sandbox_url)
            wkw = {
                "device": str(device),
                "threads": spec.trainer.threads,
                "max_batch": 512,
                "max_total_tokens": 1 << 20,
                "executor_factory": executor_factory,
                "engine_factory": engine_factory,
                "fleet": fleet,
                "scheduler_policy": os.environ.get("KUBERL_SCHEDULER_POLICY", "kv-aware"),
                "sft_builder": build_sft_traces,
                "partial_rollouts": spec.algorithm.partial_rollouts,
                "batches_in_flight": max(1, spec.algorithm.async_level),
            }
            use_gpu = device.type == "cuda" and not fleet
            client = (
                RayClient(wargs, wkw, use_gpu) if use_ray else InProcessClient(RolloutWorker(*wargs, **wkw))
            )
            stack.callback(client.close)
        weights = None
        if fleet is not None:
            slots = None
            root = shm_root(job.metadata.name, 4 * n_params) if shm and main else None  # room for float32
            if root is not None:
                slots = SharedMemorySlots(root)
                stack.callback(slots.close)
            weights = DiskWeights(
                client, DiskWeightSync(shared), model_dir(job, out), ctx, engine_dtype(job), slots=slots
            )
        deadline = t_start + 60 * max_minutes if max_minutes else None
        pipe = Pipeline(
            job,
            model,
            tok,
            client,
            store,
            sink,
            algorithm=algorithm,
            device=device,
            deadline=deadline,
            on_progress=on_progress,
            weights=weights,
            ctx=ctx,
        )
        resumed = pipe.resume(payload) if ctx.broadcast(payload is not None) else False
        payload = None  # the model and optimizer hold it now
        if resumed and console is not None:
            console.print(f"resumed from {store.uri} at global step {pipe.state.global_step}")
        slow_bf16 = bf16_warning(job.spec.trainer.precision, device, cpu_flags())
        if slow_bf16 and ctx.rank == 0:
            print(slow_bf16, file=sys.stderr, flush=True)
        if console is not None:
            ranks = f", {ctx.world_size} FSDP ranks" if ctx.enabled else ""
            console.print(
                f"[bold]kuberl run[/bold] {job.metadata.name}: {algorithm}, {n_params / 1e6:.2f}M params, "
                f"vocab {tok.vocab_size}, device {device}{ranks}, {'ray' if use_ray else 'in-process'} rollout "
                f"worker, rollouts on {fleet.describe() if fleet else 'the local engine'}"
            )
        if progress is not None:
            stack.enter_context(progress)
        result = pipe.run()
    result.evals["wall_seconds"] = time.time() - t_start
    if main:
        _write_report(out, console, store)
    if console is not None:
        console.print(summary_table(result, algorithm))
    return result


def _write_report(out: Path, console, store: CheckpointStore | None = None) -> None:
    """report.html beside metrics.jsonl, and beside the checkpoints (a trainer pod's run folder
    dies with the pod); a run that trained is not failed by its report."""
    from kuberl.trainer.report import write_report

    try:
        path = write_report(out)
        kept = store.put_file(path, "report.html") if store is not None else None
    except Exception as err:  # noqa: BLE001 - the checkpoints and metrics are what matter
        print(f"warning: could not write the run report: {err}", file=sys.stderr)
        return
    if console is not None:
        console.print(
            f"report: {path}" + (f" (kept at {kept})" if kept and not kept.startswith(str(out)) else "")
        )


def _ui(quiet: bool):
    """The console and, on a terminal, rich's live progress bars; with stdout not a terminal (a log
    file, a pod's log) the bars would only show at the end, so :class:`LogProgress` writes lines."""
    if quiet:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if use_plain(sys.stdout):
        return console, None
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    )
    return console, progress


def _brief(rec: StepRecord) -> str:
    secs = f" {rec.step_seconds:.1f}s" if rec.step_seconds is not None else ""
    return step_figures(rec) + secs


def _mean(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def summarize(result: RunResult) -> dict[str, float]:
    """Headline numbers: SFT vs final sampled accuracy, tool-error ratio in positives, reward, lengths."""
    rl = [h for h in result.history if h.type == "rl"]
    sft_stages = [h.stage for h in result.history if h.type == "sft"]
    rl_stages = [h.stage for h in rl]
    k = max(1, min(5, len(rl) // 4 or 1))
    return {
        "sft_accuracy": result.evals.get(sft_stages[-1], math.nan) if sft_stages else math.nan,
        "final_accuracy": result.evals.get(rl_stages[-1], math.nan) if rl_stages else math.nan,
        "tool_error_ratio_positive_first": _mean([h.tool_error_ratio_positive for h in rl[:k]]),
        "tool_error_ratio_positive_last": _mean([h.tool_error_ratio_positive for h in rl[-k:]]),
        "reward_first": _mean([h.reward_mean for h in rl[:k]]),
        "reward_last": _mean([h.reward_mean for h in rl[-k:]]),
        "response_length_first": _mean([h.response_length for h in rl[:k]]),
        "response_length_last": _mean([h.response_length for h in rl[-k:]]),
        "rl_steps": float(len(rl)),
        "rl_step_seconds": _mean([h.step_seconds for h in rl]),
        "wall_seconds": result.evals.get("wall_seconds", math.nan),
    }


def summary_table(result: RunResult, algo: str):
    from rich.table import Table

    s = summarize(result)
    t = Table(title=f"kuberl run summary ({algo})")
    t.add_column("metric")
    t.add_column("start of RL", justify="right")
    t.add_column("end of RL", justify="right")

    def f(x: float, pct: bool = False) -> str:
        if x is None or math.isnan(x):
            return "-"
        return f"{100 * x:.1f}%" if pct else f"{x:.3f}"

    t.add_row(
        "sampled accuracy (held-out, T=1.0)",
        f(s["sft_accuracy"], True) + " (SFT)",
        f(s["final_accuracy"], True),
    )
    t.add_row("reward mean (train rollouts)", f(s["reward_first"]), f(s["reward_last"]))
    t.add_row(
        "tool-error ratio in positives",
        f(s["tool_error_ratio_positive_first"]),
        f(s["tool_error_ratio_positive_last"]),
    )
    t.add_row("response length (tokens)", f(s["response_length_first"]), f(s["response_length_last"]))
    t.add_row("RL steps / mean step time (s)", f"{s['rl_steps']:.0f}", f(s["rl_step_seconds"]))
    t.add_row("wall time (s)", "", f"{s['wall_seconds']:.0f}")
    return t


SIGTERM_EXIT = 128 + 15


def run_file(
    path: str,
    out_dir: str | None = None,
    ablation: str | None = None,
    max_minutes: float | None = None,
    engines: str | None = None,
    weights_dir: str | None = None,
) -> int:
    """Entry point of ``kuberl run``; returns the process exit code."""
    try:
        job = find_one(load_manifests(path), AgenticRLJob)
    except (ManifestError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = out_dir or str(Path("runs") / job.metadata.name)
    try:
        fleet = FleetSource(urls=tuple(parse_url_list(engines))) if engines else None
        result = run_job(
            job, out, algorithm=ablation, max_minutes=max_minutes, engines=fleet, weights_path=weights_dir
        )
    except (ManifestError, ValueError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result.interrupted:
        # Not 0: a trainer pod that ends suspended must not count as a completed rank.
        print(f"stopped by SIGTERM after global step {result.history[-1].step if result.history else 0}; "
              "the checkpoint there is where the run resumes", file=sys.stderr)
        return SIGTERM_EXIT
    if result.stopped_early:
        print(stop_reason(result, max_minutes), file=sys.stderr)
    return 0 if not result.stopped_early or result.history else 1


def stop_reason(result: RunResult, max_minutes: float | None) -> str:
    """Why a run ended before its last stage, and how to go on (``--max-minutes`` stops SFT too)."""
    last = result.history[-1] if result.history else None
    where = f"in stage {last.stage} after global step {last.step}" if last else "before the first step"
    limit = f" ({max_minutes:g} min)" if max_minutes else ""
    return (
        f"stopped {where}: the --max-minutes limit{limit} was reached; run the same command again to "
        "resume from the last checkpoint"
    )
