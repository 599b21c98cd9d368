"""Seeded workload of one RL step at the paper's stage-1 settings, and the trainer's costs.

Stage 1 of rStar2-Agent (paper section 4): 512 prompts per step, 2G = 32 rollouts each
(16,384 rollouts), up to T = 10 assistant turns, 8K response tokens (turns plus tool
responses). Responses average ~1K tokens early in stage 1 and ~4K at its end (paper fig. 8);
the default here is the middle of that range. Turns continue with a tool call with
probability ``continue_prob``; the default gives ~2.75 tool calls per rollout, i.e. the
paper's ~45K calls per step.

Tool-call durations are a mix of classes, each a lognormal CPU time on one core:

* ``trivial`` and ``sympy``: measured by bench/sandbox_throughput.py on this project's
  sandbox (bench/README.md: 265 trivial calls/s and 137 sympy calls/s on 2 workers, i.e. 7.6
  and 14.6 ms of a core per call; unloaded p99/p50 of 1.35 and 2.1 give the spreads). kuberl's
  own rollouts (quickstart, SmolLM2 runs) only ever call arithmetic snippets, which are the
  trivial class.
* ``heavy`` (numeric search, brute force) and ``timeout`` (runs into the pool's deadline):
  not measurable on kuberl's small models; their shares are assumptions for a 14B model's
  math code, kept as parameters so their effect can be seen.

``STRESS_TOOL_MIX`` is the other end: 40 % of calls run numeric work of ~0.4 s, which makes
the mean execution time ~0.19 s, two thirds of the paper's 0.3 s end-to-end mean, with an
execution-only p99 just under 1 s: about the heaviest mix that can still meet the goal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ToolClass:
    name: str
    share: float
    median_s: float  # CPU seconds of one call on one core
    sigma: float  # lognormal spread; 0 = always median_s (a timeout is the pool's deadline)


DEFAULT_TOOL_MIX: tuple[ToolClass, ...] = (
    ToolClass("trivial", 0.55, 0.0076, 0.13),
    ToolClass("sympy", 0.40, 0.0146, 0.32),
    ToolClass("heavy", 0.047, 0.25, 1.0),
    ToolClass("timeout", 0.003, math.inf, 0.0),
)

STRESS_TOOL_MIX: tuple[ToolClass, ...] = (
    ToolClass("trivial", 0.30, 0.0076, 0.13),
    ToolClass("sympy", 0.299, 0.0146, 0.32),
    ToolClass("heavy", 0.40, 0.40, 0.4),
    ToolClass("timeout", 0.001, math.inf, 0.0),
)
TOOL_MIXES = {"measured": DEFAULT_TOOL_MIX, "stress": STRESS_TOOL_MIX}


@dataclass(frozen=True)
class WorkloadSpec:
    prompts: int = 512
    rollouts_per_prompt: int = 32  # 2G
    max_turns: int = 10
    max_response_tokens: int = 8192
    prompt_range: tuple[int, int] = (80, 400)
    turn_tokens_median: float = 420.0
    turn_tokens_sigma: float = 0.9
    continue_prob: float = 0.755
    tool_tokens_median: float = 60.0
    tool_tokens_sigma: float = 0.8
    tool_timeout_s: float = 10.0  # SandboxPool spec.limits.timeoutSeconds
    tool_mix: tuple[ToolClass, ...] = field(default=DEFAULT_TOOL_MIX)

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.rollouts_per_prompt < 1 or self.max_turns < 1:
            raise ValueError("prompts, rollouts_per_prompt and max_turns must be >= 1")
        if not 0 <= self.continue_prob < 1:
            raise ValueError(f"continue_prob must be in [0, 1), got {self.continue_prob}")
        total = sum(c.share for c in self.tool_mix)
        if not self.tool_mix or abs(total - 1.0) > 1e-6 or any(c.share < 0 for c in self.tool_mix):
            raise ValueError(f"tool_mix shares must be >= 0 and sum to 1, got {total:g}")

    @property
    def rollouts(self) -> int:
        return self.prompts * self.rollouts_per_prompt


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout: decode tokens per assistant turn; after each turn but the last, one tool
    call (its CPU seconds on one core) whose response adds ``tool_tokens`` to the context."""

    prompt: int
    turns: tuple[int, ...]
    tool_costs: tuple[float, ...]
    tool_tokens: tuple[int, ...]

    @property
    def response_tokens(self) -> int:
        return sum(self.turns) + sum(self.tool_tokens)


def sample_tool_costs(
    mix: tuple[ToolClass, ...], n: int, timeout_s: float, rng: np.random.Generator
) -> np.ndarray:
    """``n`` call durations (seconds of one core) from the class mix, capped at the deadline."""
    shares = np.array([c.share for c in mix])
    kinds = rng.choice(len(mix), size=n, p=shares / shares.sum())
    out = np.empty(n)
    for i, c in enumerate(mix):
        idx = np.flatnonzero(kinds == i)
        if math.isinf(c.median_s):
            out[idx] = timeout_s
        else:
            out[idx] = c.median_s * np.exp(c.sigma * rng.standard_normal(idx.size))
    return np.minimum(out, timeout_s)


def make_plans(spec: WorkloadSpec, seed: int) -> list[RolloutPlan]:
    """The step's rollouts; each response (turns + tool responses) fits ``max_response_tokens``."""
    rng = np.random.default_rng(seed)
    costs = iter(sample_tool_costs(spec.tool_mix, spec.rollouts * spec.max_turns, spec.tool_timeout_s, rng))
    plans = []
    log_turn, log_tool = math.log(spec.turn_tokens_median), math.log(spec.tool_tokens_median)
    for _ in range(spec.rollouts):
        prompt = int(rng.integers(spec.prompt_range[0], spec.prompt_range[1] + 1))
        budget = spec.max_response_tokens
        turns: list[int] = []
        tool_costs: list[float] = []
        tool_tokens: list[int] = []
        while True:
            want = max(8, int(rng.lognormal(log_turn, spec.turn_tokens_sigma)))
            turns.append(min(want, budget))
            budget -= turns[-1]
            if len(turns) >= spec.max_turns or budget <= 1 or rng.random() >= spec.continue_prob:
                break
            resp = min(max(4, int(rng.lognormal(log_tool, spec.tool_tokens_sigma))), budget - 1)
            tool_tokens.append(resp)
            tool_costs.append(float(next(costs)))
            budget -= resp
        plans.append(RolloutPlan(prompt, tuple(turns), tuple(tool_costs), tuple(tool_tokens)))
    return plans


# A tool call carries its modelled duration inside its code, so it travels through the real
# client and server unchanged and the simulated worker reads it back.
_CALL_PREFIX = "# kuberl-sim cost_s="


def encode_call(cost_s: float) -> str:
    return f"{_CALL_PREFIX}{cost_s!r}\n"


def decode_cost(code: str) -> float:
    if not code.startswith(_CALL_PREFIX):
        raise ValueError(f"not a simulated tool call: {code[:40]!r}")
    return float(code[len(_CALL_PREFIX) :].split("\n", 1)[0])


@dataclass(frozen=True)
class TrainerModel:
    """Update and weight-sync time of one step (assumptions, not measurements; see docs/cluster.md).

    Update: pi_old recompute (2 FLOPs/param/token) plus forward and backward (6) over the
    ``kept`` rollouts of each prompt (G = 16 of 2G = 32), at ``mfu`` of the GPUs' peak.
    Weight sync: the trainer writes the bf16 policy to the shared volume and every engine reads
    it back, each at ``sync_gb_per_s``, plus the engines' reload.
    """

    params: float = 14.8e9  # Qwen3-14B
    gpus: int = 64
    peak_flops: float = 1.307e15  # MI300X dense bf16
    mfu: float = 0.35
    kept_per_prompt: int = 16
    bytes_per_param: int = 2
    sync_gb_per_s: float = 2.0
    reload_s: float = 5.0

    def update_seconds(self, trained_tokens: float) -> float:
        return 8.0 * self.params * trained_tokens / (self.gpus * self.peak_flops * self.mfu)

    def sync_seconds(self) -> float:
        return 2 * self.params * self.bytes_per_param / (self.sync_gb_per_s * 1e9) + self.reload_s


def trained_tokens(plans: list[RolloutPlan], spec: WorkloadSpec, kept_per_prompt: int) -> float:
    """Tokens the update processes: the kept share of every rollout's prompt + response."""
    total = sum(p.prompt + p.response_tokens for p in plans)
    return total * kept_per_prompt / spec.rollouts_per_prompt
