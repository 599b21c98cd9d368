"""Test doubles for the trainer: in-process sandboxes (execute + verify) and a scripted policy engine."""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import traceback
from dataclasses import dataclass

from kuberl.rollout import template
from kuberl.rollout.engine import GENERATED_TOKENS, Engine, EngineLoad, GenerateOutput, GenerateRequest
from kuberl.trainer.data import answer_turn


@dataclass
class FakeResult:
    outcome: str
    output: str

    @property
    def is_error(self) -> bool:
        return self.outcome == "error"

    def to_tool_response(self) -> str:
        return self.output


class FakeSandbox:
    """exec() with captured stdout; verify = exact string match. Only for trusted test code."""

    def __init__(self) -> None:
        self.calls = 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def execute(self, code: str, stdin: str = "") -> FakeResult:
        self.calls += 1
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, "<stdin>", "exec"), {})  # noqa: S102 - test double
        except Exception:
            return FakeResult("error", traceback.format_exc(limit=0))
        out = buf.getvalue()
        return FakeResult("stdout" if out else "no_stdout", out)

    async def execute_batch(self, calls):
        return [await self.execute(c, s) for c, s in calls]

    async def verify(self, prediction: str, gold: str) -> bool:
        return prediction.strip() == gold.strip()

    async def verify_batch(self, pairs):
        return [await self.verify(p, g) for p, g in pairs]


class CoinVerifySandbox(FakeSandbox):
    """Verify = a fixed coin flip per predicted answer (a hash bit), whatever the gold answer.

    A barely trained policy almost never computes the right product, but it does write
    answers; with this verifier about half of them earn reward 1, deterministically, so GRPO
    groups have non-zero advantages and RL steps really update the model.
    """

    async def verify(self, prediction: str, gold: str) -> bool:
        return hashlib.sha256(prediction.strip().encode()).digest()[0] % 2 == 0


class ScriptedArithEngine(Engine):
    """A policy with a known tool-error ratio among its correct rollouts, for ``engine_factory``.

    It reads the ``builtin:arith`` question out of the prompt and the tool responses out of the
    conversation so far, and writes turns in the SFT traces' exact format. First turns cycle
    through four rollout kinds, in arrival order:

    0. ``print(result)`` (a NameError in the real sandbox), then the right code, then its output
       as the answer: correct, 2 tool calls, 1 error;
    1. the right code, then its output as the answer: correct, 1 call, 0 errors;
    2, 3. ``\\boxed{-1}`` at once: wrong, no tool call.

    So with a multiple of 4 rollouts per step, the tool-error ratio in positives is exactly 1/3.
    """

    ERROR_RATIO_POSITIVE = 1 / 3

    def __init__(self, tokenizer, name: str = "scripted-0"):
        self.tok = tokenizer
        self.name = name
        self.first_turns = 0
        self.weight_updates = 0
        self.generated_tokens = 0
        self._tokens_metric = GENERATED_TOKENS.labels(
            engine=name
        )  # served at 0 from the start, as LocalEngine's

    def set_weights(self, state_dict, version=None) -> None:
        self.weight_updates += 1  # the script is the policy: weights do not change what it writes
        self.weight_version = version

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        req.validate()
        text = self.tok.decode(req.input_ids)
        question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)
        if question is None:
            raise ValueError(f"{self.name}: no user question in the prompt: {text[:200]!r}")
        # the question's own line (a thinking budget's instruction may follow it)
        expr = question.group(1).strip().splitlines()[0].removesuffix("=?")
        responses = re.findall(r"<tool_response>(.*?)</tool_response>", text, re.S)
        if not responses:
            kind = self.first_turns % 4
            self.first_turns += 1
            if kind == 0:
                turn = template.render_tool_call("print(result)") + template.IM_END
            elif kind == 1:
                turn = template.render_tool_call(f"print({expr})") + template.IM_END
            else:
                turn = answer_turn("-1")
        elif not responses[-1].strip().isdigit():  # the tool failed: call it right this time
            turn = template.render_tool_call(f"print({expr})") + template.IM_END
        else:
            turn = answer_turn(responses[-1].strip())
        ids = self.tok.encode(turn)
        finish = "stop"
        if len(ids) > req.max_new_tokens:
            ids, finish = ids[: req.max_new_tokens], "length"
        self.generated_tokens += len(ids)
        self._tokens_metric.inc(len(ids))
        return GenerateOutput(ids, [-1.0] * len(ids), finish, getattr(self, "weight_version", None))

    async def max_total_tokens(self) -> int:
        return 1 << 20

    async def health(self) -> bool:
        return True

    async def load_metrics(self) -> EngineLoad:
        return EngineLoad(0.0, 0, 0)
