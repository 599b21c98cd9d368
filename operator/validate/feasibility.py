"""Settings the schema admits but under which a run cannot learn, cannot start or wastes its
accelerators: one rule set for `kuberl validate` (``checks``) and the admission webhook
(``admission``), so `kubectl apply` refuses what validate refuses, with the same words.

* learning: GRPO's advantage is a reward minus its group's mean; a setting that makes every
  rollout of a group alike (greedy or near-greedy decoding) or every reward tie (a response budget
  that cuts each rollout before its answer) gives every advantage zero, and a learning rate under
  float32's spacing changes no weight, so nothing is learned;
* starting: a builtin model sent to inference servers, a cuda trainer on cpu pods;
* topology: one engine runs per pod (``--tp``), so a pod with more accelerators than
  ``engine.tensorParallel`` leaves the rest idle for the whole run;
* documents read together: a job and the fleet it rolls out on (inline, in the same file or
  live) must agree on the engine and the model, the fleet needs ``weightSync`` for policy
  updates to reach its engines, and a fleet or sandbox pool held at zero replicas (no
  autoscaling to grow it) never serves the job. The trainer refuses or waits at start, hours
  of queueing later.

Each function returns messages that begin with the full field path; ``[]`` means nothing wrong.
"""

from __future__ import annotations

from kuberl.api import AgenticRLJob, Resource, RolloutFleet
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec

NEAR_GREEDY_TEMPERATURE = 0.1
"""At or below it, logits are scaled by 10 or more: a gap of 1 nat between the top two tokens
becomes e^-10, so a group's rollouts are (near-)identical, as with temperature 0."""
NEAR_GREEDY_TOP_P = 0.1
"""At or below it, the nucleus is the top token alone whenever that token is 10 % likely, which
is nearly every token of an LLM's answer: sampling is greedy in effect."""
MIN_LEARNING_RATE = 1e-10
"""An AdamW step moves each weight by about the learning rate; below this it is under half of
float32's spacing for every weight above 0.002 in magnitude (2.3e-10 there; LLM weights are
typically ~0.02), so float32 rounds the update away and the weights never change."""
MIN_ANSWER_TOKENS = 16
"""Tokens of the shortest rollout without tools: an ``<answer>`` block with a short reasoning."""


def _rl_stages(job: AgenticRLJob) -> list[int]:
    return [i for i, s in enumerate(job.spec.stages) if s.type == "rl"]


def learning_rate_problems(job: AgenticRLJob) -> list[str]:
    """Learning rates whose updates float32 rounds away: the stages train nothing."""
    spec = job.spec
    rates = [(f"spec.stages[{i}].learningRate", s.learning_rate, [s.name]) for i, s in enumerate(spec.stages) if s.learning_rate]
    shared = [s.name for s in spec.stages if not s.learning_rate]
    if shared:
        rates.append(("spec.algorithm.learningRate", spec.algorithm.learning_rate, shared))
    return [
        f"{where}: {lr:g} for stage{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} moves each "
        f"weight by about {lr:g} per AdamW step, under half of float32's spacing for any weight above 0.002 "
        "in magnitude: the update rounds away and the policy never changes; use 1e-6 (the paper's) or at "
        "least 1e-9"
        for where, lr, names in rates
        if lr < MIN_LEARNING_RATE
    ]


def learning_problems(job: AgenticRLJob) -> list[str]:
    """Algorithm, rollout and stage settings that make every advantage zero or a step empty."""
    spec = job.spec
    rl = _rl_stages(job)
    if not rl:
        return []
    problems = []
    a = spec.algorithm
    if spec.rollout.temperature == 0:
        problems.append(
            "spec.rollout.temperature: 0 is greedy decoding, so all "
            f"{a.rollouts_per_prompt} rollouts of a group are the same and get the same reward: every "
            "GRPO advantage is zero and the RL stages learn nothing; sample (the paper uses 1.0)"
        )
    if 0 < spec.rollout.temperature <= NEAR_GREEDY_TEMPERATURE:
        problems.append(
            f"spec.rollout.temperature: {spec.rollout.temperature:g} is near-greedy decoding (logits x "
            f"{1 / spec.rollout.temperature:g}), so the {a.rollouts_per_prompt} rollouts of a group come out "
            "(nearly) the same and tie on reward: GRPO's advantages are zero and the RL stages learn "
            "nothing; sample (the paper uses 1.0)"
        )
    if spec.rollout.top_p <= NEAR_GREEDY_TOP_P:
        problems.append(
            f"spec.rollout.topP: {spec.rollout.top_p:g} keeps only the top token whenever it is "
            f"{spec.rollout.top_p:.0%} likely, which is nearly always: sampling is greedy in effect, the "
            f"{a.rollouts_per_prompt} rollouts of a group tie on reward and every GRPO advantage is zero; "
            "use topP 1.0 (the paper's) or at least 0.9"
        )
    if a.name == "grpo-roc" and a.rollouts_per_prompt <= a.group_size:
        problems.append(
            f"spec.algorithm.oversample: {a.oversample:g} x groupSize {a.group_size} draws only "
            f"{a.rollouts_per_prompt} rollouts, no more than the group keeps, so Resample-on-Correct has "
            "nothing to choose from; raise oversample (the paper uses 2) or set name: grpo"
        )
    for i in rl:
        stage = spec.stages[i]
        if stage.batch_size is not None and a.mini_batches > stage.batch_size:
            problems.append(
                f"spec.stages[{i}].batchSize: {stage.batch_size} prompts cannot fill "
                f"spec.algorithm.miniBatches ({a.mini_batches}) optimizer steps: some steps would have no "
                "rollouts; raise the stage's batchSize or lower miniBatches"
            )
        problems += _stage_budget_problems(job, i)
    return problems


def _stage_budget_problems(job: AgenticRLJob, i: int) -> list[str]:
    """An RL stage whose response budget cuts every rollout before its answer."""
    spec, stage = job.spec, job.spec.stages[i]
    budget = spec.stage_max_response_tokens(stage)
    if budget >= MIN_ANSWER_TOKENS:
        return []
    field = f"spec.stages[{i}].maxResponseTokens" if stage.max_response_tokens else "spec.rollout.maxResponseTokens"
    return [
        f"{field}: {budget} tokens for stage '{stage.name}' cannot hold an <answer> block after any reasoning "
        f"(at least {MIN_ANSWER_TOKENS} tokens): every rollout is cut before its answer, all rewards tie at 0 "
        f"and every GRPO advantage is zero; raise it to {MIN_ANSWER_TOKENS} or more (the paper uses 8192)"
    ]


def topology_problems(fleet: RolloutFleetSpec, where: str) -> list[str]:
    """Accelerators no engine uses: one engine per pod, on ``engine.tensorParallel`` of them."""
    tp, count = fleet.engine.tensor_parallel, fleet.accelerator.count
    if fleet.accelerator.profile == "cpu":
        return []
    if tp & (tp - 1):  # not a power of two
        return [
            f"{where}engine.tensorParallel: {tp} GPUs cannot split a model's attention heads evenly "
            "(common models have 32, 40 or 64 heads over 4 or 8 KV heads), so the engine refuses the "
            "model at start and the fleet's GPUs idle; use a power of two (1, 2, 4, 8, 16)"
        ]
    if tp >= count:
        return []
    return [
        f"{where}engine.tensorParallel: {tp} uses {tp} of each pod's {count} accelerators "
        f"({where}accelerator.count), so {count - tp} GPUs idle in every pod for the whole run (one "
        f"engine runs per pod); set accelerator.count: {tp}, or tensorParallel to {count}"
    ]


def fleet_problems(job: AgenticRLJob, fleet: RolloutFleetSpec, where: str, inline: bool) -> list[str]:
    """Contradictions between ``job`` and the fleet it rolls out on (inline or referenced).

    ``where`` names the fleet for the message (``spec.rollout.fleet.`` or ``spec.rollout.fleetRef:
    RolloutFleet x ``). A missing ``weightSync`` is refused for every fleet that exists only on a
    cluster; an inline cpu fleet is also what `kuberl run` serves on its own machine, where the
    updates reach the local server it starts, so it may go without.
    """
    problems = []
    engine = job.spec.rollout.engine
    if engine in ("sglang", "vllm") and fleet.engine.type != engine:
        problems.append(
            f"spec.rollout.engine is {engine} but {where}engine.type is {fleet.engine.type}: the trainer "
            "refuses to start against engines of another type; make them the same"
        )
    if fleet.weight_sync is None and (not inline or fleet.accelerator.profile != "cpu"):
        problems.append(
            f"{where}weightSync is not set, so policy updates never reach the engines: every rollout "
            "would come from the initial model and the trainer refuses to start; give the fleet "
            "weightSync (a ReadWriteMany PVC the trainer writes and the engines load)"
        )
    if fleet.replicas == 0 and fleet.autoscaling is None:
        problems.append(
            f"{where}replicas is 0 and the fleet has no autoscaling, so no engine ever runs: the job's "
            "rollouts wait forever and no RL step completes; set replicas to 1 or more, or give the fleet "
            "autoscaling (minReplicas >= 1)"
        )
    trained, served = job.spec.model.base, fleet.model.uri if fleet.model is not None else None
    if served is not None and _model_name(served) != _model_name(trained):
        problems.append(
            f"{where}model.uri is {served} but spec.model.base is {trained}: the engines sample from another "
            "model than the trainer updates, so the importance ratios compare two different policies and a "
            "weight push of one into the other fails; serve the job's model"
        )
    return problems


def _model_name(uri: str) -> str:
    """A model's name wherever it is stored: ``Qwen/Qwen3-14B`` and ``s3://b/qwen3-14b/`` agree."""
    return uri.rstrip("/").rsplit("/", 1)[-1].lower()


def pool_problems(job: AgenticRLJob, pool: SandboxPoolSpec, where: str) -> list[str]:
    """A sandbox pool that never runs a worker behind a job whose rollouts call tools."""
    if not job.spec.rollout.tools or not _rl_stages(job) or pool.replicas or pool.autoscaling is not None:
        return []
    return [
        f"{where}replicas is 0 and the pool has no autoscaling, so no sandbox worker ever runs: every "
        f"python tool call (spec.rollout.tools) of every rollout fails or waits, and the multi-turn rollouts "
        "learn nothing from tools; set replicas to 1 or more, or give the pool autoscaling"
    ]


def builtin_model_problems(job: AgenticRLJob) -> list[str]:
    """A builtin model (``builtin:tiny-gpt``) sent to inference servers, which serve Hugging Face
    models only: the trainer refuses it at start. ``kuberl run`` serves an inline cpu fleet's
    job on its local engine, so only a fleet that exists on a cluster alone counts."""
    spec = job.spec
    base, engine, fleet = spec.model.base, spec.rollout.engine, spec.rollout.fleet
    if not base.startswith("builtin:"):
        return []
    if engine in ("sglang", "vllm"):
        why = f"spec.rollout.engine is {engine}"
    elif engine == "auto" and spec.rollout.fleet_ref:
        why = f"spec.rollout.fleetRef rolls out on RolloutFleet {spec.rollout.fleet_ref}"
    elif engine == "auto" and fleet is not None and fleet.accelerator.profile != "cpu":
        why = f"spec.rollout.fleet is a {fleet.accelerator.profile} fleet"
    else:
        return []
    return [
        f"spec.model.base: {base} runs on the local engine only, but {why}: inference servers (SGLang, "
        "vLLM) serve Hugging Face models, so the engines cannot load it and the trainer refuses to start; "
        "set spec.rollout.engine: local, or train a Hugging Face model"
    ]


def trainer_problems(job: AgenticRLJob) -> list[str]:
    """A trainer told to compute on a device its pods are not given."""
    t = job.spec.trainer
    if t.device != "cuda" or t.accelerator.profile != "cpu":
        return []
    return [
        "spec.trainer.device: cuda but spec.trainer.accelerator.profile is cpu: the trainer pods get no GPU, "
        "so the trainer stops at start (no CUDA device is available); set device: auto (or cpu), or a GPU "
        "profile (mi300x, h100)"
    ]


def partial_rollout_problems(job: AgenticRLJob) -> list[str]:
    """``algorithm.partialRollouts`` where it can do nothing: a synchronous run pushes while
    nothing generates, and SGLang's client cannot keep a generation across a push."""
    spec = job.spec
    if not spec.algorithm.partial_rollouts or not _rl_stages(job):
        return []
    problems = []
    if spec.algorithm.async_level == 0:
        problems.append(
            "spec.algorithm.partialRollouts: true has no effect at asyncLevel 0 (each step pushes its "
            "weights before its batch generates, so no generation is in flight at a push); set asyncLevel "
            "to 1 or 2, or leave partialRollouts off"
        )
    if spec.rollout.engine == "sglang":
        problems.append(
            "spec.algorithm.partialRollouts: true needs the local engine or vLLM (pause?mode=keep and "
            "per-token weight versions); spec.rollout.engine is sglang, whose pushes wait for the "
            "generations in flight; use engine vllm or leave partialRollouts off"
        )
    return problems


def resource_problems(resource: Resource) -> list[str]:
    """The rules of this module that one resource decides alone (its inline fleet included)."""
    if isinstance(resource, RolloutFleet):
        return topology_problems(resource.spec, "spec.")
    if not isinstance(resource, AgenticRLJob):
        return []
    problems = learning_problems(resource) + learning_rate_problems(resource) + partial_rollout_problems(resource)
    problems += trainer_problems(resource) + builtin_model_problems(resource)
    if resource.spec.sandbox.pool is not None:
        problems += pool_problems(resource, resource.spec.sandbox.pool, "spec.sandbox.pool.")
    fleet = resource.spec.rollout.fleet
    if fleet is not None and resource.spec.rollout.engine != "local":
        problems += topology_problems(fleet, "spec.rollout.fleet.")
        problems += fleet_problems(resource, fleet, "spec.rollout.fleet.", inline=True)
    return problems

