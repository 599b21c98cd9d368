"""The multi-turn tool-calling rollout loop (paper section 2.1, fig. 2).

One rollout: encode the prompt once; per turn, let the engine continue the exact token ids
so far until ``<|im_end|>``; decode the turn, parse its ``<tool_call>`` blocks; stop at a
final answer, a turn without tool calls, ``max_turns`` or the response budget; otherwise send
the turn's valid calls to the tool executor concurrently (right away, while other rollouts keep
generating), render the results with :func:`template.render_tool_responses`, encode them and
append them with loss mask 0. Invalid calls are answered with their parse error, as in the
paper. Token ids are never re-tokenized, so the trainer sees exactly what the policy sampled.

The response budget ``max_response_tokens`` counts every response token, including tool
responses; tool-response tokens that do not fit are cut and the rollout is marked truncated.

An engine that fails a request (an HTTP error), or a sandbox that cannot run a turn's calls
(unreachable, no answer in time: the platform failed, not the policy), ends only that rollout,
with finish_reason "abort" and the error recorded; the other rollouts of the step go on, and the trainer drops
aborted rollouts before selecting the group. An engine that goes away (unreachable: a replica
removed from the fleet, a dead server) or drains between two turns hands its rollouts back:
each goes on from the turn it was at on another engine, with the tokens it has so far.

Partial rollouts (``Engine.partial_rollouts``): a generation the engine aborted mid-turn (a
restart, a pause that aborts) goes on from the tokens it had, as a request whose input holds
them and whose draws continue where they stopped (``GenerateRequest.first_draw``), on the same
engine or, after a move, the next; every response token keeps the policy version that sampled
it (``Trajectory.token_versions``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kuberl.rollout import template
from kuberl.rollout.engine import Engine, GenerateOutput, GenerateRequest, derive_seed
from kuberl.rollout.http_engine import EngineUnreachable
from kuberl.rollout.scheduler import Scheduler

log = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    eos_id: int  # id of <|im_end|>

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ToolResult(Protocol):
    @property
    def is_error(self) -> bool: ...

    def to_tool_response(self) -> str: ...


@runtime_checkable
class ToolExecutor(Protocol):
    """What the loop needs from a sandbox; ``kuberl.sandbox.service.client.SandboxClient`` fits."""

    async def execute(self, code: str, stdin: str = "") -> ToolResult: ...


@dataclass(frozen=True)
class BatchRequest:
    """One step's rollouts: ``n`` per prompt, each scored against its gold answer; ``seed``
    derives every rollout's own seed (see :func:`rollout_group`); ``length_targets``: the
    thinking budget each prompt asks for (the length reward), one per prompt."""

    prompts: list[str]
    golds: list[str]
    n: int
    max_turns: int
    max_response_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    length_targets: list[int] | None = None


@dataclass
class Trajectory:
    """One rollout. ``loss_mask``/``logprobs`` align with ``response_ids``.

    ``finish_reason``: "answer" (an <answer> block was written), "no_tool_call" (a turn ended
    without calling a tool), "max_turns", "length" (response budget or context exhausted) or
    "abort" (the engine dropped or failed the request; ``error`` says why when it failed).
    ``answer_tags`` counts "<answer>" in the model's own turns only: tool output that happens to
    print the tag is not the model's formatting (RoC's p_format, paper eq. 5).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: int
    tool_calls: int
    tool_errors: int
    format_errors: int
    answer: str | None
    truncated: bool
    finish_reason: str
    text: str = field(default="", repr=False)
    answer_tags: int = 0
    error: str | None = None
    versions: list[int | None] = field(default_factory=list)  # policy version of each model turn
    engine: str | None = None  # the engine that generated its last turn
    tool_seconds: float = 0.0  # wall time this rollout waited for its tool calls (sandbox round trips)
    handoffs: int = 0  # times it moved to another engine (its engine went away mid-rollout)
    # aligned with response_ids: the policy version that sampled each model token (None for tool
    # tokens and where the engine reported none); empty for trajectories built without it
    token_versions: list[int | None] = field(default_factory=list)
    resumed: int = 0  # generations continued from their tokens after the engine aborted them

    @property
    def min_version(self) -> int | None:
        """The oldest policy version that wrote a turn or a token (None if an engine reported none)."""
        known = [v for v in self.versions if v is not None]
        if not known or len(known) != len(self.versions):
            return None
        sampled = [v for v, m in zip(self.token_versions, self.loss_mask, strict=False) if m and v is not None]
        return min(known + sampled)

    @property
    def response_text(self) -> str:
        """The decoded response: assistant turns and the rendered tool responses, in order."""
        return self.text


async def _run_calls(executor: ToolExecutor, calls: list) -> tuple[list[str], int]:
    """Tool-response texts for one turn's calls (in order) and how many of them were errors."""

    async def one(call) -> tuple[str, bool]:
        if isinstance(call, template.ToolCallError):
            return call.message, True
        result = await executor.execute(call.code, call.stdin)
        return result.to_tool_response(), bool(result.is_error)

    done = await asyncio.gather(*(one(c) for c in calls))
    return [text for text, _ in done], sum(err for _, err in done)


MAX_HANDOFFS = 3  # moves of one rollout to another engine; a rollout that loses every engine ends


@dataclass
class _Progress:
    """What one rollout has so far: it survives a move to another engine."""

    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    token_versions: list[int | None] = field(default_factory=list)
    partial: GenerateOutput | None = None  # the interrupted generation of the current turn
    resumed: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    format_errors: int = 0
    answer_tags: int = 0
    answer: str | None = None
    error: str | None = None
    truncated: bool = False
    finish: str = "max_turns"
    tool_seconds: float = 0.0
    engine: str | None = None
    handoffs: int = 0


async def _turns(
    engine: Engine,
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    executor: ToolExecutor,
    p: _Progress,
    *,
    max_turns: int,
    max_response_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
) -> bool:
    """Run turns of ``p`` on ``engine`` until the rollout ends (True) or has to move (False):
    the engine went unreachable, or it is draining at a turn boundary while another engine
    takes rollouts (a replica being removed only finishes the turn it is generating)."""
    while p.turns < max_turns:
        budget = max_response_tokens - len(p.response)
        if budget <= 0:
            p.truncated, p.finish = True, "length"
            return True
        if p.turns and not scheduler.in_service(engine.name) and scheduler.others_in_service(engine.name):
            return False
        try:
            out = await _generate_turn(engine, tokenizer, p, budget, temperature, top_p, seed)
        except EngineUnreachable as err:
            p.error = f"{engine.name}: {type(err).__name__}: {err}"
            if scheduler.in_service(engine.name):
                scheduler.drain_engine(engine.name, failed=True)  # discovery brings it back as new
            return False
        except Exception as err:  # one failed request must not cancel the whole step
            p.error, p.finish = f"{engine.name}: {type(err).__name__}: {err}", "abort"
            log.warning("rollout aborted after %d turns: %s", p.turns, p.error)
            return True
        p.error = None
        p.engine = engine.name
        p.turns += 1
        p.versions.append(out.weight_version)
        p.response += out.output_ids
        p.mask += [1] * len(out.output_ids)
        p.logprobs += out.output_logprobs
        p.token_versions += out.versions()
        turn_text = tokenizer.decode(out.output_ids)
        p.texts.append(turn_text)
        if out.finish_reason == "abort":
            p.finish = "abort"
            return True
        calls = template.parse_tool_calls(turn_text)
        bad = sum(isinstance(c, template.ToolCallError) for c in calls)
        p.format_errors += bad + int(template.has_unclosed_tool_call(turn_text))
        p.answer_tags += turn_text.count("<answer>")
        if "<answer>" in turn_text:
            p.answer = template.extract_answer(turn_text)
        if out.finish_reason == "length":
            p.truncated, p.finish = True, "length"
            return True
        if "<answer>" in turn_text:
            p.finish = "answer"
            return True
        if not calls:
            p.finish = "no_tool_call"
            return True
        if p.turns >= max_turns:
            p.finish = "max_turns"  # the last turn's calls would have no turn to use them
            return True
        t_tool = time.perf_counter()
        try:
            results, errors = await _run_calls(executor, calls)
        except Exception as err:  # the sandbox itself failed (unreachable, no answer in time)
            p.tool_seconds += time.perf_counter() - t_tool
            p.error, p.finish = f"tool executor: {type(err).__name__}: {err}", "abort"
            log.warning("rollout aborted after %d turns: %s", p.turns, p.error)
            return True
        p.tool_seconds += time.perf_counter() - t_tool
        p.tool_calls += len(calls)
        p.tool_errors += errors
        tool_text = template.render_tool_responses(results)
        tool_ids = list(tokenizer.encode(tool_text))
        room = max_response_tokens - len(p.response)
        if len(tool_ids) >= room:
            # Cut what does not fit; with no room left for another turn the rollout ends.
            tool_ids = tool_ids[:room]
            tool_text = tokenizer.decode(tool_ids)
            p.truncated, p.finish = True, "length"
        p.response += tool_ids
        p.mask += [0] * len(tool_ids)
        p.logprobs += [0.0] * len(tool_ids)
        p.token_versions += [None] * len(tool_ids)
        p.texts.append(tool_text)
        if p.truncated:
            return True
    p.finish = "max_turns"
    return True


async def _generate_turn(
    engine: Engine,
    tokenizer: Tokenizer,
    p: _Progress,
    budget: int,
    temperature: float,
    top_p: float,
    seed: int | None,
) -> GenerateOutput:
    """The engine's generation of turn ``p.turns``. With partial rollouts, a generation the
    engine aborts goes on from its tokens so far (at most :data:`MAX_HANDOFFS` times a rollout);
    they wait in ``p.partial`` while the rollout moves, should the engine go away meanwhile."""
    while True:
        done = p.partial
        have = done.output_ids if done is not None else []
        if have and len(have) >= budget:
            out = GenerateOutput([], [], "length")
        else:
            out = await engine.generate(
                GenerateRequest(
                    input_ids=p.prompt_ids + p.response + have,
                    max_new_tokens=budget - len(have),
                    temperature=temperature,
                    top_p=top_p,
                    stop_token_ids=(tokenizer.eos_id,),
                    seed=None if seed is None else derive_seed(seed, p.turns),
                    first_draw=len(have),
                )
            )
        if done is not None:
            out = _joined(done, out)
        resumable = getattr(engine, "partial_rollouts", False) and bool(out.output_ids) and p.resumed < MAX_HANDOFFS
        if out.finish_reason != "abort" or not resumable:
            p.partial = None
            return out
        p.partial = out
        p.resumed += 1
        log.info("generation aborted after %d tokens of turn %d: goes on from them", len(out.output_ids), p.turns)


def _joined(first: GenerateOutput, then: GenerateOutput) -> GenerateOutput:
    """One turn's generation from an interrupted one and its continuation; its version is the
    oldest token's, as staleness counts."""
    versions = first.versions() + then.versions()
    known = [v for v in versions if v is not None]
    return GenerateOutput(
        first.output_ids + then.output_ids,
        first.output_logprobs + then.output_logprobs,
        then.finish_reason,
        min(known) if known else None,
        versions,
    )


async def rollout_one(
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    executor: ToolExecutor,
    prompt_text: str,
    *,
    max_turns: int,
    max_response_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Trajectory:
    """Run one multi-turn rollout of ``prompt_text`` (already rendered with the template).

    With ``seed``, turn t samples with ``derive_seed(seed, t)``: the rollout is reproducible.
    A rollout whose engine goes away (unreachable, or draining between turns) moves to another
    engine with its tokens so far and goes on from the turn it was at, at most
    :data:`MAX_HANDOFFS` times; without a next engine it ends as "abort" naming the last error.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
    p = _Progress(prompt_ids=list(tokenizer.encode(prompt_text)))
    while True:
        async with scheduler.session(len(p.prompt_ids), max_response_tokens) as engine:
            p.engine = p.engine or engine.name
            done = await _turns(
                engine, scheduler, tokenizer, executor, p, max_turns=max_turns,
                max_response_tokens=max_response_tokens, temperature=temperature, top_p=top_p, seed=seed,
            )  # fmt: skip
        if done:
            break
        if p.handoffs >= MAX_HANDOFFS or not any(not st.draining for st in scheduler.stats):
            p.finish = "abort"
            log.warning("rollout aborted after %d turns and %d moves: %s", p.turns, p.handoffs, p.error)
            break
        p.handoffs += 1
        log.info("rollout moves to another engine after %d turns (%s)", p.turns, p.error or "its engine drains")
    return Trajectory(
        prompt_ids=p.prompt_ids,
        response_ids=p.response,
        loss_mask=p.mask,
        logprobs=p.logprobs,
        turns=p.turns,
        tool_calls=p.tool_calls,
        tool_errors=p.tool_errors,
        format_errors=p.format_errors,
        answer=p.answer,
        truncated=p.truncated,
        finish_reason=p.finish,
        text="".join(p.texts),
        answer_tags=p.answer_tags,
        error=p.error,
        versions=p.versions,
        engine=p.engine,
        tool_seconds=p.tool_seconds,
        handoffs=p.handoffs,
        token_versions=p.token_versions,
        resumed=p.resumed,
    )


async def rollout_group(
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    executor: ToolExecutor,
    prompts: list[str],
    n: int,
    seed: int | None = None,
    **kwargs,
) -> list[list[Trajectory]]:
    """``n`` rollouts of every prompt, all concurrently; result[i][j] is rollout j of prompt i.

    The scheduler decides how many run at once (KV capacity). A failed engine request aborts
    only its rollout (see :class:`Trajectory`); any other failure cancels the rest.
    With ``seed``, rollout (i, j) gets ``derive_seed(seed, i, j)``, independent of timing.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not prompts:
        return []
    scheduler.start_batch(len(prompts) * n)
    seeds = [
        [None if seed is None else derive_seed(seed, i, j) for j in range(n)] for i in range(len(prompts))
    ]
    async with asyncio.TaskGroup() as tg:
        tasks = [
            [tg.create_task(rollout_one(scheduler, tokenizer, executor, p, seed=s, **kwargs)) for s in row]
            for p, row in zip(prompts, seeds, strict=True)
        ]
    return [[t.result() for t in row] for row in tasks]
