"""Settings the schema admits but under which a run cannot learn, cannot start or wastes its
accelerators: one rule set for `kuberl validate` (``checks``) and the admission webhook
(``admission``), so `kubectl apply` refuses what validate refuses, with the same words.

* learning: GRPO's advantage is a reward minus its group's mean; a setting that makes every
  rollout of a group alike (greedy decoding) gives every advantage zero, so nothing is learned;
* topology: one engine runs per pod (``--tp``), so a pod with more accelerators than
  ``engine.tensorParallel`` leaves the rest idle for the whole run;
* documents read together: a job and the fleet it rolls out on (inline, in the same file or
  live) must agree on the engine, and the fleet needs ``weightSync`` for policy updates to
  reach its engines. The trainer refuses both at start, hours of queueing later.

Each function returns messages that begin with the full field path; ``[]`` means nothing wrong.
"""

from __future__ import annotations

from kuberl.api import AgenticRLJob, Resource, RolloutFleet
from kuberl.api.rollout_fleet import RolloutFleetSpec


def _rl_stages(job: AgenticRLJob) -> list[int]:
    return [i for i, s in enumerate(job.spec.stages) if s.type == "rl"]


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
    return problems


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
    return problems


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
    problems = learning_problems(resource) + partial_rollout_problems(resource)
    fleet = resource.spec.rollout.fleet
    if fleet is not None and resource.spec.rollout.engine != "local":
        problems += topology_problems(fleet, "spec.rollout.fleet.")
        problems += fleet_problems(resource, fleet, "spec.rollout.fleet.", inline=True)
    return problems

