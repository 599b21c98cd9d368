"""AgenticRLJob: one GRPO-RoC training run (rStar2-Agent sections 2.2 and 4).

Defaults are the paper's: G=16 kept out of 2G=32 oversampled rollouts, clip-higher
0.2/0.28, no KL, no entropy bonus, token-mean loss, lr 1e-6 with 20 warm-up steps,
temperature 1.0, a non-reasoning SFT stage and then RL stages at 8K -> 12K -> 12K with an
offline difficulty filter (8 rollouts, drop all-correct) and an optimizer reset in stage 3.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kuberl.api.common import (
    NAME_PATTERN,
    RESOURCE_NAME_PATTERN,
    SUBDOMAIN_PATTERN,
    AcceleratorSpec,
    FieldError,
    KubeModel,
    Quantity,
    Resource,
    ResourceRequirements,
    ResourceStatus,
)
from kuberl.api.pod_template import PodTemplateOverride
from kuberl.api.rollout_fleet import ModelRef, RolloutFleetSpec
from kuberl.api.sandbox_pool import SandboxPoolSpec
from kuberl.api.tracking import TrackingSpec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's label: the LocalQueue a job waits in (its Workload is admitted, held or preempted there)."""
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""Kueue's label: the WorkloadPriorityClass of a queued job."""

DEFAULT_TRAINER_IMAGES: dict[str, str] = {
    "mi300x": "ghcr.io/kuberl/trainer:0.1.0-rocm",
    "h100": "ghcr.io/kuberl/trainer:0.1.0-cuda",
    "cpu": "ghcr.io/kuberl/trainer:0.1.0-cpu",
}


class ModelSpec(KubeModel):
    base: str = Field(
        min_length=1, description="HF repo id, s3:// or path, or builtin:tiny-gpt for local runs."
    )
    tokenizer: str | None = Field(None, description="Tokenizer source; defaults to model.base.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Architecture overrides for builtin models (e.g. nLayer, nEmbd).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class DataSpec(KubeModel):
    train: str = Field(min_length=1, description="Training prompts: jsonl path/URI, or builtin:arith.")
    eval: list[str] = Field(default_factory=list)
    seed: int = 0


class ClipSpec(KubeModel):
    low: float = Field(0.2, gt=0, lt=1, description="epsilon_low of the clipped ratio.")
    high: float = Field(0.28, gt=0, lt=10, description="epsilon_high (clip-higher, DAPO).")
    negative_ratio_cap: float | None = Field(
        None, gt=1, description="INTELLECT-2 delta: cap on the ratio for negative advantages (e.g. 4)."
    )

    @model_validator(mode="after")
    def _order(self) -> ClipSpec:
        if self.high < self.low:
            raise ValueError(f"clip.high ({self.high}) must be >= clip.low ({self.low})")
        if self.negative_ratio_cap is not None and self.negative_ratio_cap <= 1 + self.high:
            raise ValueError(
                f"clip.negativeRatioCap ({self.negative_ratio_cap}) must exceed 1 + clip.high ({1 + self.high})"
            )
        return self


MAX_ASYNC_LEVEL = 4
"""INTELLECT-2 (fig. 7) matched the synchronous reward curve up to four steps of delay."""
DEFAULT_TIS_CAP = 2.0
"""verl's default TIS cap: enough to undo typical staleness, small enough to bound the variance."""


class LengthRewardSpec(KubeModel):
    """A thinking budget per problem (INTELLECT-2 section 3.1.2, after L1): the prompt asks for
    l_target tokens and the reward becomes r_task - alpha * |l_target - l_y|."""

    targets: list[Annotated[int, Field(ge=1)]] = Field(
        ...,
        min_length=1,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "Target lengths l_target in tokens; each problem draws one uniformly. Every target must be "
            "below the response budget (maxResponseTokens) of every RL stage."
        ),
    )
    alpha: float = Field(
        0.0003,
        ge=0,
        le=1,
        description="Weight of |l_target - l_y| subtracted from the task reward (INTELLECT-2: 0.0003).",
    )
    instruction: str = Field(
        "Think for {target} tokens before giving a response.",
        min_length=1,
        max_length=1024,
        description="The budget's words in the prompt; {target} becomes the drawn target length.",
    )
    position: Literal["before", "after"] = Field(
        "after",
        description="Where the instruction goes: before or after the problem's text in the prompt template.",
    )
    count_tool_tokens: bool = Field(
        False,
        description=(
            "Whether tool-response tokens count toward l_y. Off (as INTELLECT-2 and L1, where every "
            "response token is the model's): l_y is the tokens the model wrote."
        ),
    )

    @model_validator(mode="after")
    def _instruction(self) -> LengthRewardSpec:
        try:
            self.instruction.format(target=1)
        except (KeyError, IndexError, ValueError) as err:
            raise FieldError(
                ("instruction",),
                f"instruction {self.instruction!r} is not a template with only {{target}} to fill in "
                f"({type(err).__name__}: {err}); write literal braces as {{{{ and }}}}",
            ) from None
        if "{target}" not in self.instruction:
            raise FieldError(("instruction",), f"instruction {self.instruction!r} must contain {{target}}")
        if len(set(self.targets)) != len(self.targets):
            raise FieldError(("targets",), f"targets {self.targets} name a length twice")
        return self


class AlgorithmSpec(KubeModel):
    name: Literal["grpo-roc", "grpo"] = Field("grpo-roc", description="grpo disables Resample-on-Correct.")
    group_size: int = Field(16, ge=2, le=1024, description="G: rollouts kept per prompt.")
    # No schema default: it depends on name (2 for grpo-roc, 1 for grpo), and a CRD default would
    # make the API server fill in 2 for a grpo job, which the CEL rule below then rejects.
    oversample: float | None = Field(
        None,
        ge=1,
        le=8,
        description="RoC draws oversample*G rollouts and keeps G; default 2 (grpo-roc), "
        "1 (grpo, which keeps all).",
    )
    clip: ClipSpec = Field(default_factory=ClipSpec)
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    learning_rate: float = Field(1e-6, gt=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    batch_prompts: int = Field(512, ge=1, description="Prompts per RL step.")
    ppo_epochs: int = Field(1, ge=1, le=16)
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per RL step.")
    filter_zero_advantage: bool = Field(True, description="Drop groups whose rewards are all equal.")
    async_level: int = Field(
        0,
        ge=0,
        le=MAX_ASYNC_LEVEL,
        description=(
            "k: rollouts trained at step n come from a policy at most k versions old; the next k "
            "batches generate while step n trains, together on engines with paged KV caches (vLLM, "
            "SGLang), whose throughput grows with the rows they decode at once (INTELLECT-2 used 2). "
            "The local engine pads every row to the longest and gains nothing per row from more rows, "
            "so there the batches ahead generate in turn and, when generation is the longer side, 2 "
            "runs only one version ahead, as 1 does (bench/README.md). 0: synchronous, as rStar2-Agent."
        ),
    )
    tis_cap: float | None = Field(
        None,
        ge=0,
        description=(
            "Truncated importance sampling cap C: tokens weigh min(pi_old/mu, C), mu the engine that "
            "sampled them. Default 2 when asyncLevel > 0, off at 0; 0 turns it off."
        ),
    )
    partial_rollouts: bool = Field(
        False,
        description=(
            "At a weight push, generations in flight (local engine, vLLM) stop at a token boundary and "
            "go on under the new weights from their tokens so far instead of finishing on the old ones; "
            "each token carries the version that sampled it (TIS weighs every token by min(pi_old/mu, C) with mu from the version that sampled it; "
            "staleness counts the oldest token). Needs asyncLevel > 0 (a synchronous run pushes while "
            "nothing generates) and a local or vllm engine. Off by default: every running row's KV is "
            "recomputed at each push (on a long-tailed CPU mix it cost 15 % of the steps/hour: bench/README.md)."
        ),
    )
    length_reward: LengthRewardSpec | None = Field(
        None, description="Thinking budgets: a target length in each prompt and a length term in the reward."
    )

    @property
    def effective_tis_cap(self) -> float | None:
        """The cap the loss applies (None: no correction; see ``tis_cap``)."""
        if self.tis_cap is None:
            return DEFAULT_TIS_CAP if self.async_level > 0 else None
        return self.tis_cap or None

    @model_validator(mode="after")
    def _oversample(self) -> AlgorithmSpec:
        if self.oversample is None:
            # object.__setattr__: validate_assignment would re-enter this validator.
            object.__setattr__(self, "oversample", 1.0 if self.name == "grpo" else 2.0)
        elif self.name == "grpo" and self.oversample != 1:
            # Plain GRPO keeps everything it samples; silently dropping the user's value would
            # hide that the manifest asks for something this algorithm does not do.
            raise ValueError(
                f"algorithm.oversample ({self.oversample:g}) needs name: grpo-roc; plain grpo keeps every "
                "rollout it samples, so drop oversample or set it to 1"
            )
        if self.mini_batches > self.batch_prompts:
            raise ValueError(
                f"algorithm.miniBatches ({self.mini_batches}) must be <= algorithm.batchPrompts ({self.batch_prompts})"
            )
        return self

    @property
    def rollouts_per_prompt(self) -> int:
        return max(self.group_size, round(self.group_size * (self.oversample or 1.0)))


class InlineFleetSpec(RolloutFleetSpec):
    """A fleet owned by the job; its model defaults to the job's model.base."""

    model: ModelRef | None = None  # type: ignore[assignment]


class RolloutSpec(KubeModel):
    fleet_ref: str | None = Field(
        None,
        pattern=RESOURCE_NAME_PATTERN,
        max_length=63,
        description="Name of a RolloutFleet in the job's namespace.",
    )
    fleet: InlineFleetSpec | None = Field(None, description="Inline fleet, created and owned by the job.")
    engine: Literal["auto", "sglang", "vllm", "local"] = Field(
        "auto",
        description=(
            "auto: local in-process engine for `kuberl run`, the fleet's engine on a cluster; vllm: "
            "`kuberl run` starts a local vLLM server unless --engines names one."
        ),
    )
    temperature: float = Field(1.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    max_turns: int = Field(10, ge=1, le=100, description="T: max assistant turns per rollout.")
    max_response_tokens: int = Field(8192, ge=1)
    tools: list[Literal["python"]] = Field(default_factory=lambda: ["python"])
    spot_check_tolerance: float | None = Field(
        0.15,
        gt=0,
        description=(
            "Flag an engine whose sampling log-probs of the trained rollouts differ from the trainer's "
            "by more than this mean (nats/token): it serves other weights than were pushed. The default "
            "is several times a correct bf16 server's mismatch; null turns the check off."
        ),
    )
    spot_check_rollouts: int = Field(
        8,
        ge=0,
        le=1024,
        description=(
            "Rollouts per RL step rescored for the spot check, spread over the engines that no fresh "
            "trained rollout already measures (their gap comes from the update); 0: off."
        ),
    )
    prompt_template: Literal["rstar2", "compact"] = Field(
        "rstar2", description="compact drops the long system prompt (tiny local models)."
    )

    @model_validator(mode="after")
    def _one_fleet(self) -> RolloutSpec:
        if self.fleet_ref and self.fleet is not None:
            raise ValueError("rollout.fleetRef and rollout.fleet are mutually exclusive; set one")
        if self.fleet is not None and self.engine in ("sglang", "vllm"):
            # One name for the server on both sides: an inline fleet takes the job's engine
            # unless it names another, which is a contradiction to fix in the manifest.
            if "type" in self.fleet.engine.model_fields_set and self.fleet.engine.type != self.engine:
                raise ValueError(
                    f"rollout.engine is {self.engine} but rollout.fleet.engine.type is "
                    f"{self.fleet.engine.type}; make them the same (or drop one)"
                )
            self.fleet.engine.type = self.engine
        return self


class SandboxRef(KubeModel):
    pool_ref: str | None = Field(
        None,
        pattern=RESOURCE_NAME_PATTERN,
        max_length=63,
        description="Name of a SandboxPool in the job's namespace.",
    )
    pool: SandboxPoolSpec | None = Field(None, description="Inline pool, created and owned by the job.")

    @model_validator(mode="after")
    def _one_pool(self) -> SandboxRef:
        if self.pool_ref and self.pool is not None:
            raise ValueError("sandbox.poolRef and sandbox.pool are mutually exclusive; set one")
        return self


class DifficultyFilter(KubeModel):
    rollouts: int = Field(8, ge=1, le=256, description="k: rollouts per problem with the current policy.")
    drop_if_all_correct: bool = Field(True, description="Drop problems solved k/k.")


class StageSpec(KubeModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=63)
    type: Literal["sft", "rl"]
    # minimum only in the schema (the CRD's check); _check words the message for `kuberl validate`.
    steps: int = Field(
        description="Optimizer steps (sft) or RL steps (rl); must be > 0.", json_schema_extra={"minimum": 1}
    )
    max_response_tokens: int | None = Field(None, ge=1)
    max_turns: int | None = Field(None, ge=1, le=100)
    data: str | None = Field(None, description="Overrides data.train for this stage.")
    difficulty_filter: DifficultyFilter | None = None
    reset_optimizer: bool = False
    learning_rate: float | None = Field(None, gt=0, le=1)
    batch_size: int | None = Field(None, ge=1, description="Examples (sft) or prompts (rl) per step.")

    @model_validator(mode="after")
    def _check(self) -> StageSpec:
        if self.steps <= 0:
            raise FieldError(("steps",), f"stage '{self.name}': steps must be > 0 (got {self.steps})")
        if self.type == "sft" and self.difficulty_filter is not None:
            raise ValueError(f"stage '{self.name}': difficultyFilter applies to rl stages only")
        return self


MAX_STAGES = 32
"""Bounds the list so the API server's CEL cost estimate for rules over stages stays small."""


def paper_stages() -> list[StageSpec]:
    return [
        StageSpec(name="sft", type="sft", steps=400, learning_rate=5e-6, batch_size=128),
        StageSpec(name="stage-1", type="rl", steps=300, max_response_tokens=8192, max_turns=10),
        StageSpec(name="stage-2", type="rl", steps=85, max_response_tokens=12288, max_turns=10),
        StageSpec(
            name="stage-3",
            type="rl",
            steps=125,
            max_response_tokens=12288,
            max_turns=15,
            difficulty_filter=DifficultyFilter(rollouts=8, drop_if_all_correct=True),
            reset_optimizer=True,
        ),
    ]


Precision = Literal["float32", "bf16"]  # trainer.precision (kuberl.trainer.precision)


class TrainerSpec(KubeModel):
    replicas: int = Field(
        1, ge=1, le=1024, description="Trainer pods (torch.distributed world = replicas x count)."
    )
    accelerator: AcceleratorSpec = Field(default_factory=lambda: AcceleratorSpec(profile="mi300x", count=8))
    image: str | None = None
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Defaults: 8 CPUs and 32Gi + /dev/shm of memory per accelerator (see operator/render/sizing.py).",
    )
    model_cache_size: Quantity = Field(
        "100Gi",
        description="Bound of the /models cache (downloaded weights), also requested as ephemeral-storage.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description=(
            "Times the operator restarts a failed trainer (all its pods, resuming from the last "
            "checkpoint) before the job is Failed. Evictions and preemptions are not counted."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Torch device for local runs.")
    pod_template: PodTemplateOverride | None = Field(
        None,
        description="PodTemplateSpec merged over the rendered trainer pods (env, secrets, scheduling, ...).",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (local runs).")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "About how many tokens one forward/backward of the RL update takes (rollouts are not "
            "split): bounds the update's activation memory, which grows with the tokens of a forward; "
            "the gradient is the same. Default: up to 64 rollouts per forward."
        ),
    )

    precision: Precision = Field(
        "float32",
        description=(
            "What the trainer's forwards and backwards compute in: float32, or bf16 autocast over "
            "float32 weights, gradients and optimizer state (matmuls in bf16, softmaxes, log-probs and "
            "the loss in float32). bf16 is faster where the hardware has bf16 matmuls (CPUs with "
            "AVX512-BF16 or AMX, accelerators); FSDP on accelerators always computes in bf16."
        ),
    )

    @property
    def resolved_image(self) -> str:
        return self.image or DEFAULT_TRAINER_IMAGES[self.accelerator.profile]


class CheckpointSpec(KubeModel):
    """Where a run's checkpoints live, so that a restarted trainer resumes instead of starting over.

    On a cluster a relative ``uri`` (the default) is kept on a PersistentVolumeClaim
    ``<job>-checkpoints`` that the operator creates and the job owns: it outlives the trainer's
    pods, their replacement after a spec change and their restarts, and goes with the job.
    ``s3://`` needs credentials in the trainer pods (``trainer.podTemplate`` env/envFrom); an
    absolute path must be a volume the pod template mounts.
    """

    uri: str = Field(
        "runs/checkpoints",
        min_length=1,
        description="s3://bucket/prefix, or a path; relative: on the job's checkpoint volume on a cluster.",
    )
    every_steps: int = Field(50, ge=1)
    keep: int = Field(3, ge=1)
    volume_size: Quantity = Field("100Gi", description="Size of the checkpoint volume (relative uri only).")
    storage_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=SUBDOMAIN_PATTERN,
        description="StorageClass of the checkpoint volume; the cluster default when unset.",
    )

    @property
    def on_volume(self) -> bool:
        """Whether the operator keeps these checkpoints on the job's own volume."""
        return not self.uri.startswith("s3://") and not self.uri.startswith("/")


class AgenticRLJobSpec(KubeModel):
    model: ModelSpec
    data: DataSpec
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    sandbox: SandboxRef = Field(default_factory=SandboxRef)
    stages: list[StageSpec] = Field(
        default_factory=paper_stages,
        min_length=1,
        max_length=MAX_STAGES,
        # A list-map keyed by name: the API server itself rejects duplicate stage names.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    tracking: TrackingSpec | None = Field(
        None,
        description="Experiment trackers (W&B, MLflow, TensorBoard) the trainer logs to, besides /metrics.",
    )
    seed: int = 0
    suspend: bool = False

    @model_validator(mode="after")
    def _stages(self) -> AgenticRLJobSpec:
        names = [s.name for s in self.stages]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise FieldError(
                    ("stages", i, "name"),
                    f"{name!r} is already the name of stages[{names.index(name)}]; stage names must be unique",
                )
        lr = self.algorithm.length_reward
        if lr is not None:
            for i, stage in enumerate(self.stages):
                budget = self.stage_max_response_tokens(stage)
                if stage.type == "rl" and max(lr.targets) >= budget:
                    raise FieldError(
                        ("algorithm", "lengthReward", "targets"),
                        f"target {max(lr.targets)} is not below stages[{i}] ('{stage.name}')'s response budget "
                        f"({budget} tokens): a rollout is cut there, so it could never reach the target",
                    )
        too_long = self.response_budgets_over_context()
        if too_long:
            ctx = self.rollout.fleet.engine.context_length  # type: ignore[union-attr]
            raise FieldError(
                too_long[0][0],
                f"maxResponseTokens must be < rollout.fleet.engine.contextLength ({ctx}), since SGLang "
                f"rejects a request whose prompt + response reach it: {'; '.join(t for _, t in too_long)}",
            )
        return self

    def response_budgets_over_context(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Response budgets an inline fleet with ``engine.contextLength`` cannot serve: (field
        path under spec, what it says).

        SGLang answers HTTP 400 to a request whose input + max_new_tokens reach the context
        length, so such a budget fails long rollouts mid-run, after the job has started.
        """
        fleet = self.rollout.fleet
        ctx = fleet.engine.context_length if fleet is not None else None
        if ctx is None:
            return []
        over = []
        if self.rollout.max_response_tokens >= ctx:
            over.append(
                (
                    ("rollout", "maxResponseTokens"),
                    f"rollout.maxResponseTokens is {self.rollout.max_response_tokens}",
                )
            )
        for i, stage in enumerate(self.stages):
            if (
                stage.type == "rl"
                and stage.max_response_tokens is not None
                and stage.max_response_tokens >= ctx
            ):
                over.append(
                    (
                        ("stages", i, "maxResponseTokens"),
                        f"stage '{stage.name}' has {stage.max_response_tokens}",
                    )
                )
        return over

    def stage_max_turns(self, stage: StageSpec) -> int:
        return stage.max_turns or self.rollout.max_turns

    def stage_max_response_tokens(self, stage: StageSpec) -> int:
        return stage.max_response_tokens or self.rollout.max_response_tokens


class JobSummary(KubeModel):
    reward_mean: float | None = None
    pass_rate: float | None = None
    tool_error_ratio: float | None = None


class AgenticRLJobStatus(ResourceStatus):
    restarts: int | None = Field(None, description="Failed trainers restarted so far (trainer.maxRestarts).")
    stage: str | None = None
    step: int | None = None
    last_checkpoint: str | None = None
    summary: JobSummary | None = None
    start_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    completion_time: str | None = Field(None, json_schema_extra={"format": "date-time"})


class AgenticRLJob(Resource):
    """A GRPO-RoC agentic RL training run: SFT then RL stages, rollouts on a fleet, tools in a pool."""

    KIND: ClassVar[str] = "AgenticRLJob"
    PLURAL: ClassVar[str] = "agenticrljobs"
    SHORT_NAMES: ClassVar[tuple[str, ...]] = ("arj",)

    kind: Literal["AgenticRLJob"] = "AgenticRLJob"
    spec: AgenticRLJobSpec
    status: AgenticRLJobStatus | None = None

    @model_validator(mode="after")
    def _hostnames_fit(self) -> AgenticRLJob:
        """Trainer pods are named ``<name>-trainer-<index>`` as DNS hostnames (63 characters)."""
        last = f"{self.metadata.name}-trainer-{self.spec.trainer.replicas - 1}"
        if len(last) > 63:
            room = 63 - len(last) + len(self.metadata.name)
            raise ValueError(
                f"metadata.name: at most {room} characters with trainer.replicas "
                f"{self.spec.trainer.replicas}: the trainer pods' hostnames <name>-trainer-<index> "
                f"must fit 63 ({last!r} has {len(last)})"
            )
        return self
