"""The step record: one line of metrics.jsonl, for an SFT step, an RL step or an eval.

Every reader (the gauges, the trackers, the progress lines, the run report, ``kuberl status``,
the run summary) reads it by attribute, so a renamed figure is an AttributeError where it is
read rather than a silently empty curve. Its persisted form is the flat JSON object of
metrics.jsonl: :meth:`StepRecord.to_json` writes it and :meth:`StepRecord.from_json` reads it
back, with a clear error for a missing identity field; figures a newer kuberl added are skipped.

Figures that come in families are maps here and flat keys on disk: ``staleness_<age>``,
``tool_calls_<outcome>``, ``tool_latency_<quantile>``, ``length_gap_t<target>`` and
``length_adherence_t<target>``. A figure a step did not measure is None (absent on disk).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

RecordType = Literal["sft", "rl", "eval"]

IDENTITY = ("time", "job", "type", "stage", "step", "stage_step", "label")
REQUIRED = ("type", "step")


@dataclass
class StepRecord:
    type: RecordType
    step: int  # the global step (an eval: the global step it followed)
    stage: str | None = None
    stage_step: int | None = None  # steps done in the stage, this one included (sft, rl)
    label: str | None = None  # an eval: the stage it followed
    job: str | None = None  # stamped by the sink as it writes the record
    time: float | None = None  # unix time the sink wrote the record
    # -- every step
    lr: float | None = None
    step_seconds: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    # -- sft
    token_acc: float | None = None
    # -- eval
    accuracy: float | None = None
    # -- rl: the run
    algorithm: str | None = None
    async_level: int | None = None
    # -- rl: the batch (grpo.prepare_batch)
    reward_mean: float | None = None
    reward_kept_mean: float | None = None
    tool_error_ratio_positive: float | None = None  # eval too
    tool_error_ratio_positive_kept: float | None = None
    response_clip_ratio: float | None = None
    response_length: float | None = None
    response_tokens: float | None = None
    tool_calls_mean: float | None = None
    tool_seconds: float | None = None
    turns_mean: float | None = None
    groups: float | None = None
    groups_dropped_zero_adv: float | None = None
    rollouts: float | None = None
    rollouts_aborted: float | None = None
    rollouts_handed_off: float | None = None
    rollouts_kept: float | None = None
    rollouts_stale: float | None = None
    staleness_mean: float | None = None
    staleness_max: float | None = None
    staleness: dict[int, float] = field(default_factory=dict)  # rollouts by versions behind
    # -- rl and eval: thinking budgets (algorithm.lengthReward)
    length_penalty_mean: float | None = None
    length_gap_mean: float | None = None
    length_adherence: float | None = None
    length_gap_by_target: dict[int, float] = field(default_factory=dict)
    length_adherence_by_target: dict[int, float] = field(default_factory=dict)
    # -- rl: the update (grpo.rl_update)
    clip_low: float | None = None
    clip_high: float | None = None
    cap_frac: float | None = None
    approx_kl: float | None = None
    ratio_mean: float | None = None
    ratio_max: float | None = None
    tis_mean: float | None = None
    tis_capped: float | None = None
    tokens: float | None = None
    opt_steps: float | None = None
    skipped: float | None = None
    rollout_logprob_gap: float | None = None
    engine_logprob_gap: dict[str, float] = field(default_factory=dict)  # per engine (spot check)
    # -- rl: where the time went
    rollout_seconds: float | None = None
    update_seconds: float | None = None
    pi_old_seconds: float | None = None
    spot_check_seconds: float | None = None
    optimizer_seconds: float | None = None
    sync_seconds: float | None = None
    push_wait_seconds: float | None = None
    # -- rl: the rollout side since the last step (Orchestrator.figures)
    tool_calls: dict[str, float] = field(default_factory=dict)  # calls by sandbox outcome
    tool_latency: dict[str, float] = field(default_factory=dict)  # seconds by quantile (p50, p95, max)
    engines_in_service: float | None = None
    kv_cache_utilization: float | None = None
    engine_busy_seconds: float | None = None
    engine_version_mismatches: float | None = None
    engine_repushes: float | None = None
    engine_reconnects: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object of metrics.jsonl (unmeasured figures left out)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in IDENTITY if getattr(self, k) is not None}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in IDENTITY:
                continue
            if f.name in _FAMILY_PREFIX:
                out.update({f"{_FAMILY_PREFIX[f.name]}{k}": v for k, v in value.items()})
            elif f.name == "engine_logprob_gap":
                if value:
                    out[f.name] = dict(value)
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StepRecord:
        """A record from its metrics.jsonl object; ValueError naming a missing identity field or
        an unknown record type. Keys that are no figure of this record are skipped: a newer
        kuberl's metrics.jsonl (figures added since) still reads back, for `kuberl status` and
        the report of an old run, with the figures this version knows."""
        if not isinstance(obj, dict):
            raise ValueError(f"a step record is a JSON object, not {type(obj).__name__}")
        missing = [k for k in REQUIRED if obj.get(k) is None]
        if missing:
            raise ValueError(f"step record without {', '.join(map(repr, missing))}: {sorted(obj)}")
        if obj["type"] not in ("sft", "rl", "eval"):
            raise ValueError(f"step record of unknown type {obj['type']!r} (sft, rl or eval)")
        return cls(**figure_fields(obj, known_only=True))


_FAMILY_PREFIX = {
    "staleness": "staleness_",
    "tool_calls": "tool_calls_",
    "tool_latency": "tool_latency_",
    "length_gap_by_target": "length_gap_t",
    "length_adherence_by_target": "length_adherence_t",
}
_INT_KEYED = {"staleness", "length_gap_by_target", "length_adherence_by_target"}
_SCALARS = {
    f.name
    for f in dataclasses.fields(StepRecord)
    if f.name not in _FAMILY_PREFIX and f.name != "engine_logprob_gap"
}


def figure_fields(flat: dict[str, Any], known_only: bool = False) -> dict[str, Any]:
    """Keyword arguments of :class:`StepRecord` from flat figure names (``reward_mean``,
    ``staleness_1``, ``tool_calls_stdout``...); None values are left out. ValueError for a
    name that is no figure of the record (a writer's typo), unless ``known_only``: then such
    names are skipped (a record written by a newer kuberl)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if value is None:
            continue
        if key in _SCALARS:
            out[key] = value
        elif key == "engine_logprob_gap":
            out[key] = dict(value)
        else:
            try:
                name, sub = _family_of(key)
            except ValueError:
                if known_only:
                    continue
                raise
            out.setdefault(name, {})[sub] = value
    return out


def _family_of(key: str) -> tuple[str, int | str]:
    for name, prefix in _FAMILY_PREFIX.items():
        if not key.startswith(prefix) or len(key) == len(prefix):
            continue
        sub = key[len(prefix) :]
        if name not in _INT_KEYED:
            return name, sub
        if sub.isdigit():
            return name, int(sub)
    raise ValueError(f"{key!r} is no figure of a step record (kuberl.trainer.step_record.StepRecord)")
