"""Training data: the ``builtin:arith`` task, jsonl loading, and SFT tool-use traces.

``builtin:arith`` is integer arithmetic a ~1M-parameter model cannot do in its head but can
solve by calling the Python tool and copying the printed result into
``<answer>\\boxed{...}</answer>``: products of two 2-3 digit numbers, some with an added
third term. What RL can improve after a short SFT is exactly what the paper targets: copying
the right numbers into the code and the answer, a clean tool-call format and fewer tool errors.

SFT traces are non-reasoning (paper section 4.1): tool-call format and instruction following.
They are built from the template functions the rollout loop uses and tokenized segment by
segment exactly as the loop does (prompt, each assistant turn ending in <|im_end|>, each
rendered tool response), so the SFT token layout is the RL token layout. A fraction of traces
first make a tool error (a SyntaxError or a NameError) and then fix it; the tool responses of
those traces are the real sandbox's, so the policy starts with a tool-error ratio among its
correct rollouts that RoC can reduce.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kuberl.rollout import template

EVAL_SEED_OFFSET = 1_000_003  # the held-out eval stream is a different seed of the same generator


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    expr: str = ""  # the Python expression that solves it (builtin tasks; used for SFT traces)


def arith_problem(rng: random.Random) -> Problem:
    a = rng.randint(10, 999)
    b = rng.randint(10, 999)
    if rng.random() < 0.3:
        c = rng.randint(10, 999)
        expr = f"{a}*{b}+{c}"
    else:
        expr = f"{a}*{b}"
    return Problem(question=f"{expr}=?", answer=str(eval(expr)), expr=expr)  # noqa: S307 - digits and * + only


def arith_problems(n: int, seed: int) -> list[Problem]:
    """``n`` problems, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [arith_problem(rng) for _ in range(n)]


def _text_lines(source: str | Path):
    """Lines of a local file or an ``s3://bucket/key`` object (endpoint from AWS_ENDPOINT_URL*)."""
    src = str(source)
    if not src.startswith("s3://"):
        with open(src, encoding="utf-8") as f:
            yield from f
        return
    import os

    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = src[len("s3://") :].partition("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    try:
        body = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=key)["Body"]
    except (BotoCoreError, ClientError) as err:
        raise ValueError(f"{src}: {err}") from err
    for raw in body.iter_lines(keepends=True):
        yield raw.decode("utf-8")


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a jsonl file or s3:// object with one {"question": ..., "answer": ...} per line."""
    out: list[Problem] = []
    for lineno, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
        if not isinstance(obj, dict) or "question" not in obj or "answer" not in obj:
            raise ValueError(f'{path}:{lineno}: expected {{"question": ..., "answer": ...}}')
        out.append(Problem(str(obj["question"]), str(obj["answer"])))
    if not out:
        raise ValueError(f"{path}: no problems")
    return out


def load_problems(source: str, n: int, seed: int) -> list[Problem]:
    """``builtin:arith`` (``n`` generated problems) or a jsonl path or s3:// object (all of it)."""
    if source == "builtin:arith":
        return arith_problems(n, seed)
    if source.startswith("builtin:"):
        raise ValueError(f"unknown builtin dataset {source!r}; available: builtin:arith")
    return load_jsonl(source)


# -- SFT traces -------------------------------------------------------------------------------


def trace_plan(p: Problem, rng: random.Random, error_fraction: float) -> list[str]:
    """The codes the trace calls, in order (an erroring one first for ``error_fraction``)."""
    good = f"print({p.expr})"
    if rng.random() >= error_fraction:
        return [good]
    bad = rng.choice([f"print({p.expr}", "print(result)", f"print({p.expr}))"])
    return [bad, good]


def answer_turn(answer: str) -> str:
    return f"<answer>\\boxed{{{answer}}}</answer>{template.IM_END}"


def trace_segments(
    p: Problem, codes: Sequence[str], responses: Sequence[str], style: str = "compact"
) -> list[tuple[str, int]]:
    """(text, trainable) segments of one trace in rollout layout: prompt, turns, tool responses."""
    segs: list[tuple[str, int]] = [(template.render_prompt(p.question, style), 0)]
    for code, resp in zip(codes, responses, strict=True):
        segs.append((template.render_tool_call(code) + template.IM_END, 1))
        segs.append((template.render_tool_responses([resp]), 0))
    segs.append((answer_turn(p.answer), 1))
    return segs


def tokenize_segments(tokenizer, segs: Sequence[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens), each segment encoded on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in segs:
        t = tokenizer.encode(text)
        ids += t
        mask += [trainable] * len(t)
    return ids, mask


async def build_sft_traces(
    problems: Sequence[Problem], executor, *, seed: int, error_fraction: float, style: str = "compact"
) -> list[list[tuple[str, int]]]:
    """Segments of one SFT trace per problem; tool responses come from ``executor`` (the sandbox)."""
    rng = random.Random(seed)
    plans = [trace_plan(p, rng, error_fraction) for p in problems]
    if any(not p.expr for p in problems):
        raise ValueError("SFT traces need problems with a solving expression (builtin:arith)")
    codes = sorted({c for plan in plans for c in plan})
    if hasattr(executor, "execute_batch"):
        results = await executor.execute_batch([(c, "") for c in codes])
    else:
        results = await asyncio.gather(*(executor.execute(c, "") for c in codes))
    text = {c: r.to_tool_response() for c, r in zip(codes, results, strict=True)}
    return [
        trace_segments(p, plan, [text[c] for c in plan], style)
        for p, plan in zip(problems, plans, strict=True)
    ]


def messages_segments(messages: Sequence[dict], style: str) -> list[tuple[str, int]]:
    """(text, trainable) segments of a chat trace in the rollout layout.

    ``messages``: a first ``user`` message (the problem), then ``assistant`` turns (trained on,
    each closed by ``<|im_end|>``) and ``tool`` messages (context: consecutive ones form one
    tool-response block, as the rollout loop writes them). Assistant turns contain tool calls
    in the ``<tool_call>`` format the loop parses.
    """
    if not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    first = messages[0]
    if first.get("role") != "user" or not isinstance(first.get("content"), str):
        raise ValueError("a trace starts with a user message (the problem) with string content")
    segs: list[tuple[str, int]] = [(template.render_prompt(first["content"], style), 0)]
    tools: list[str] = []
    last = "user"
    for m in messages[1:]:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message content must be a string, got {type(content).__name__}")
        if role == "tool":
            if last == "user":
                raise ValueError(
                    "a tool message answers an assistant turn; the first reply is the assistant's"
                )
            tools.append(content)
        elif role == "assistant":
            if last == "assistant":  # the loop always puts a tool response between model turns
                raise ValueError("two assistant messages in a row; a tool message goes between them")
            if tools:
                segs.append((template.render_tool_responses(tools), 0))
                tools = []
            segs.append((content + template.IM_END, 1))
        else:
            raise ValueError(f"after the first message, roles are assistant or tool; got {role!r}")
        last = role
    if tools or len(segs) == 1:
        raise ValueError("a trace ends with an assistant turn")
    return segs


def load_sft_traces(source: str, style: str) -> list[list[tuple[str, int]]]:
    """Segments of every trace in a jsonl file or s3:// object of ``{"messages": [...]}`` lines
    (non-reasoning SFT data for a real model: tool-call format and instruction following)."""
    out: list[list[tuple[str, int]]] = []
    for lineno, line in enumerate(_text_lines(source), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
                raise ValueError('expected {"messages": [{"role": ..., "content": ...}, ...]}')
            out.append(messages_segments(obj["messages"], style))
        except (json.JSONDecodeError, ValueError) as err:
            raise ValueError(f"{source}:{lineno}: {err}") from None
    if not out:
        raise ValueError(f"{source}: no SFT traces")
    return out


def tokenizer_corpus(n: int, seed: int) -> list[str]:
    """Representative text for training the BPE: prompts, tool calls, outputs, tracebacks, answers."""
    rng = random.Random(seed)
    out = []
    for p in arith_problems(n, seed):
        plan = trace_plan(p, rng, 0.3)
        resp = [
            f"{p.answer}\n"
            if c == f"print({p.expr})"
            else 'Traceback (most recent call last):\n  File "<stdin>", line 1\nSyntaxError: invalid syntax\n'
            "NameError: name 'result' is not defined\n"
            for c in plan
        ]
        out.append("".join(t for t, _ in trace_segments(p, plan, resp)))
    return out
