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

An engine that fails a request (an HTTP error, a dead server) ends only that rollout, with
finish_reason "abort" and the error recorded; the other rollouts of the step go on, and the
trainer drops aborted rollouts before selecting the group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kuberl.rollout import template
from kuberl.rollout.engine import GenerateRequest, derive_seed
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
    engine: str | None = None  # the engine that generated it (a rollout keeps one engine)
    tool_seconds: float = 0.0  # wall time this rollout waited for its tool calls (sandbox round trips)

    @property
    def min_version(self) -> int | None:
        """The oldest policy version that wrote a turn (None if an engine reported none)."""
        known = [v for v in self.versions if v is not None]
        return min(known) if known and len(known) == len(self.versions) else None

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
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
    prompt_ids = list(tokenizer.encode(prompt_text))
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    texts: list[str] = []
    turns = tool_calls = tool_errors = format_errors = answer_tags = 0
    answer: str | None = None
    error: str | None = None
    versions: list[int | None] = []
    engine_name: str | None = None
    truncated = False
    finish = "max_turns"
    tool_seconds = 0.0
    async with scheduler.session(len(prompt_ids), max_response_tokens) as engine:
        engine_name = engine.name
        while turns < max_turns:
            budget = max_response_tokens - len(response)
            if budget <= 0:
                truncated, finish = True, "length"
                break
            try:
                out = await engine.generate(
                    GenerateRequest(
                        input_ids=prompt_ids + response,
                        max_new_tokens=budget,
                        temperature=temperature,
                        top_p=top_p,
                        stop_token_ids=(tokenizer.eos_id,),
                        seed=None if seed is None else derive_seed(seed, turns),
                    )
                )
            except Exception as err:  # one failed request must not cancel the whole step
                error, finish = f"{engine.name}: {type(err).__name__}: {err}", "abort"
                log.warning("rollout aborted after %d turns: %s", turns, error)
                break
            turns += 1
            versions.append(out.weight_version)
            response += out.output_ids
            mask += [1] * len(out.output_ids)
            logprobs += out.output_logprobs
            turn_text = tokenizer.decode(out.output_ids)
            texts.append(turn_text)
            if out.finish_reason == "abort":
                finish = "abort"
                break
            calls = template.parse_tool_calls(turn_text)
            bad = sum(isinstance(c, template.ToolCallError) for c in calls)
            format_errors += bad + int(template.has_unclosed_tool_call(turn_text))
            answer_tags += turn_text.count("<answer>")
            if "<answer>" in turn_text:
                answer = template.extract_answer(turn_text)
            if out.finish_reason == "length":
                truncated, finish = True, "length"
                break
            if "<answer>" in turn_text:
                finish = "answer"
                break
            if not calls:
                finish = "no_tool_call"
                break
            if turns >= max_turns:
                finish = "max_turns"  # the last turn's calls would have no turn to use them
                break
            t_tool = time.perf_counter()
            results, errors = await _run_calls(executor, calls)
            tool_seconds += time.perf_counter() - t_tool
            tool_calls += len(calls)
            tool_errors += errors
            tool_text = template.render_tool_responses(results)
            tool_ids = list(tokenizer.encode(tool_text))
            room = max_response_tokens - len(response)
            if len(tool_ids) >= room:
                # Cut what does not fit; with no room left for another turn the rollout ends.
                tool_ids = tool_ids[:room]
                tool_text = tokenizer.decode(tool_ids)
                truncated, finish = True, "length"
            response += tool_ids
            mask += [0] * len(tool_ids)
            logprobs += [0.0] * len(tool_ids)
            texts.append(tool_text)
            if truncated:
                break
    return Trajectory(
        prompt_ids=prompt_ids,
        response_ids=response,
        loss_mask=mask,
        logprobs=logprobs,
        turns=turns,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        format_errors=format_errors,
        answer=answer,
        truncated=truncated,
        finish_reason=finish,
        text="".join(texts),
        answer_tags=answer_tags,
        error=error,
        versions=versions,
        engine=engine_name,
        tool_seconds=tool_seconds,
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
