"""The fleet's KV cache against the batch a job generates on it (warnings).

An engine holds its weights and, in the rest of ``memFractionStatic`` of its accelerators, the
KV cache: 2 x layers x kv_heads x head_dim x dtype bytes per token of every running sequence
(``models.Attention``). A rollout of an RL stage grows to its prompt plus ``maxResponseTokens``.
Two things go wrong where the model's shape is known:

* one engine's cache cannot hold even one rollout at full length: vLLM refuses to start (its
  max_model_len does not fit the KV cache) and SGLang cuts or stalls the longest rollouts;
* the fleet's caches together hold only a small share of the rollouts in flight: generation runs
  in many waves one after another, and each RL step takes many times what the batch was sized for.
"""

from __future__ import annotations

from kuberl.api import AgenticRLJob
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.operator.validate.models import (
    ACCELERATOR_MEMORY_GB,
    ENGINE_DTYPE_BYTES,
    model_attention,
    model_parameters,
)

PROMPT_TOKENS = {"rstar2": 1024, "compact": 256}
"""A rollout's prompt by template: rStar2's system prompt with the tool's JSON schema and a
problem, or the compact template's problem alone."""
KV_WAVES = 16
"""Full-length rollouts in flight per rollout the fleet's KV cache holds, above which a step
generates in that many waves. Rollouts average well under their budget and finish at different
times, so a few waves are what a well-sized batch costs (the paper's recipe at its fleet's
maxReplicas: about 8); 16 is a step several times slower than the batch was meant to take."""


def _engine_kv_tokens(fleet: RolloutFleetSpec, model: str, memory_gb: float) -> tuple[float, int] | None:
    """(tokens one engine's KV cache holds, KV bytes per token), or None where unknown."""
    attention, params = model_attention(model), model_parameters(model)
    if attention is None or params is None:
        return None
    dtype = ENGINE_DTYPE_BYTES[fleet.engine.dtype]
    tp = fleet.engine.tensor_parallel
    free = tp * fleet.engine.mem_fraction_static * memory_gb * 1e9 - dtype * params
    per_token = attention.kv_bytes_per_token(dtype)
    if free <= 0:
        return None  # no room at all: advisories.engine_memory_warnings says so
    return free / per_token, per_token


def context_warnings(job: AgenticRLJob, fleet: RolloutFleetSpec, where: str) -> list[str]:
    """An ``engine.contextLength`` above a stage's response budget (what the schema and the
    webhook require) but without room for the prompt too: the longest rollouts of the stage get
    HTTP 400 from SGLang (prompt + max_new_tokens past the context) or are cut short."""
    ctx = fleet.engine.context_length
    if ctx is None:
        return []
    prompt = PROMPT_TOKENS[job.spec.rollout.prompt_template]
    out = []
    for stage in job.spec.stages:
        budget = job.spec.stage_max_response_tokens(stage)
        if stage.type == "rl" and budget < ctx < budget + prompt:
            out.append(
                f"{where}engine.contextLength: {ctx} leaves stage '{stage.name}' {ctx - budget} tokens for the "
                f"prompt beside its {budget} maxResponseTokens, under the {job.spec.rollout.prompt_template} "
                f"template's ~{prompt}: its longest rollouts get HTTP 400 (prompt + max_new_tokens past the "
                f"context) or are cut short; raise contextLength to {budget + prompt} or more"
            )
    return out


def kv_cache_warnings(job: AgenticRLJob, fleet: RolloutFleetSpec, where: str, model: str, rollouts: int) -> list[str]:
    """The fleet's KV cache against ``rollouts`` in flight of ``job``'s longest RL stage."""
    memory = ACCELERATOR_MEMORY_GB.get(fleet.accelerator.profile)
    rl = [s for s in job.spec.stages if s.type == "rl"]
    if memory is None or not rl or rollouts <= 0:
        return []
    held = _engine_kv_tokens(fleet, model, memory)
    engines = fleet.autoscaling.max_replicas if fleet.autoscaling is not None else fleet.replicas
    if held is None or engines <= 0:
        return []
    tokens, per_token = held
    prompt = PROMPT_TOKENS[job.spec.rollout.prompt_template]
    budget = max(job.spec.stage_max_response_tokens(s) for s in rl)
    seq = prompt + budget
    tp = fleet.engine.tensor_parallel
    cache = (
        f"{model}'s KV cache takes {per_token / 1024:.0f} KiB per token, and an engine's "
        f"{tp} x {memory} GB {fleet.accelerator.profile} at memFractionStatic "
        f"{fleet.engine.mem_fraction_static:g} leaves it room for about {tokens:,.0f} tokens after the weights"
    )
    if tokens < seq:
        return [
            f"{where}engine: {cache}, fewer than one rollout at full length ({prompt} prompt + {budget} "
            "maxResponseTokens): vLLM refuses to start and SGLang cuts or stalls the longest rollouts; raise "
            "engine.tensorParallel or memFractionStatic, or lower maxResponseTokens"
        ]
    waves = rollouts * seq / (tokens * engines)
    if waves <= KV_WAVES:
        return []
    which = "autoscaling.maxReplicas" if fleet.autoscaling is not None else "replicas"
    return [
        f"{where}engine: {cache}; the fleet ({which} {engines}) holds about {tokens * engines / seq:,.0f} of the "
        f"{rollouts} rollouts in flight at full length ({prompt} prompt + {budget} maxResponseTokens), so "
        f"each RL step generates in about {waves:.0f} waves one after another: far slower than the batch "
        "is meant to take; raise the fleet's replicas (or autoscaling.maxReplicas), or lower "
        "algorithm.batchPrompts or maxResponseTokens"
    ]
