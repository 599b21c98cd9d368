"""The real loop on LocalEngine with a policy that actually calls the Python tool.

An untrained GPT never writes a valid tool call, so the policy here is a scripted language model
that honours the GPT forward contract (KV cache, left padding, attention_mask): it reads its
whole context back from its "KV cache" and greedily writes a tool call that computes the
question, then an answer built from the tool response it was given. Everything between the
policy and the sandbox is the production code: LocalEngine's continuous batching, the loop's
parsing, tool execution, token accounting, and (when the sandbox is installed) a real sandbox
subprocess over HTTP.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kuberl.rollout import template
from kuberl.rollout.local_engine import LocalEngine
from kuberl.rollout.loop import rollout_group
from kuberl.rollout.scheduler import Scheduler
from tests.rollout_helpers import ByteTokenizer, FakeExecutor, single_torch_thread

TOK = ByteTokenizer()
START = TOK.special[template.IM_START]
ASSISTANT = TOK.encode("assistant\n")
QUESTIONS = {"6*7": "42", "2**10": "1024", "sum(range(5))": "10"}


_one_thread = pytest.fixture(autouse=True, scope="module")(single_torch_thread)


class ToolUsingLM(nn.Module):
    """Scripted policy: turn 1 calls the tool with ``print(<question>)``, turn 2 answers."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(block_size=1024)
        self.anchor = nn.Parameter(torch.zeros(1))  # a parameter, so state_dict/deepcopy behave

    def _target(self, ids: list[int]) -> list[int]:
        text = TOK.decode(ids)
        response = re.search(r"<tool_response>(.*?)</tool_response>", text, re.S)
        if response:
            return TOK.encode(f"<answer>\\boxed{{{response.group(1).strip()}}}</answer>{template.IM_END}")
        question = re.search(r"user\n(.*?)<\|im_end\|>", text, re.S).group(1)
        return TOK.encode(template.render_tool_call(f"print({question})") + template.IM_END)

    def _next(self, ids: list[int]) -> int:
        turn_start = max(i for i, t in enumerate(ids) if t == START) + 1 + len(ASSISTANT)
        produced = ids[turn_start:]
        target = self._target(ids)
        return target[len(produced)] if len(produced) < len(target) else TOK.eos_id

    def forward(self, input_ids, past=None, attention_mask=None):
        B, T = input_ids.shape
        prev = past[0][1][:, 0, :, 0].long() if past else input_ids.new_zeros(B, 0)
        ids = torch.cat([prev, input_ids], dim=1)
        mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
        logits = torch.zeros(B, T, TOK.vocab_size)
        for b in range(B):  # only the last position is ever sampled from
            real = ids[b][mask[b].bool()].tolist()
            logits[b, T - 1, self._next(real)] = 30.0
        cache = ids.float()[:, None, :, None]  # the "KV cache" remembers the token ids
        return logits, [(torch.zeros_like(cache), cache)]


def _prompts() -> list[str]:
    return [template.render_prompt(q, style="compact") for q in QUESTIONS]


async def _check(executor) -> None:
    engine = LocalEngine(ToolUsingLM(), max_batch=8, seed=0)
    sched = Scheduler([engine])
    groups = await rollout_group(
        sched, TOK, executor, _prompts(), 2, max_turns=4, max_response_tokens=400, temperature=0.0
    )
    for (question, expected), group in zip(QUESTIONS.items(), groups, strict=True):
        for traj in group:
            assert traj.answer == expected, traj.response_text
            assert (traj.turns, traj.tool_calls, traj.tool_errors, traj.format_errors) == (2, 1, 0, 0)
            assert traj.finish_reason == "answer" and not traj.truncated
            assert f"print({question})" in traj.response_text
            call_tokens = len(TOK.encode(template.render_tool_call(f"print({question})") + template.IM_END))
            tool_tokens = traj.loss_mask.count(0)
            assert traj.loss_mask[:call_tokens] == [1] * call_tokens
            assert traj.loss_mask[call_tokens : call_tokens + tool_tokens] == [0] * tool_tokens
            assert TOK.decode(traj.response_ids) == traj.response_text
    assert engine.steps > 0 and sched.snapshot()[0]["inflight"] == 0


class PythonExecutor(FakeExecutor):
    """Evaluates the single print() expression the scripted policy writes (no real sandbox)."""

    async def execute(self, code: str, stdin: str = ""):
        result = await super().execute(code, stdin)
        expr = re.fullmatch(r"print\((.*)\)", code).group(1)
        result.output = f"{eval(expr, {'__builtins__': {'sum': sum, 'range': range}})}\n"  # noqa: S307
        return result


async def test_tool_using_policy_on_local_engine_with_an_in_process_executor():
    await _check(PythonExecutor())


async def test_tool_using_policy_on_local_engine_with_the_real_sandbox():
    local = pytest.importorskip("kuberl.sandbox.service.local", reason="sandbox component not installed yet")
    client_mod = pytest.importorskip("kuberl.sandbox.service.client")
    with local.running_sandbox(workers=2) as url:
        async with client_mod.SandboxClient(url) as client:
            await _check(client)
