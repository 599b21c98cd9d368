"""The multi-turn loop: exact token ids across turns, loss mask, stop rules, budget truncation."""

import json

import pytest
import torch

from kuberl.rollout import template
from kuberl.rollout.http_engine import EngineUnreachable
from kuberl.rollout.local_engine import LocalEngine
from kuberl.rollout.loop import Tokenizer, ToolExecutor, Trajectory, rollout_group, rollout_one
from kuberl.rollout.scheduler import Scheduler
from kuberl.rollout.sglang_engine import SGLangError
from kuberl.trainer.model import GPT, GPTConfig
from tests.rollout_helpers import ByteTokenizer, FakeExecutor, FakeResult, ScriptedEngine, single_torch_thread

TOK = ByteTokenizer()
END = template.IM_END
PROMPT = template.render_prompt("What is 6*7?", style="compact")


_one_thread = pytest.fixture(autouse=True, scope="module")(single_torch_thread)


def _check_alignment(traj: Trajectory) -> None:
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)


async def _run(turns: list[str], executor=None, **kw) -> tuple[Trajectory, ScriptedEngine]:
    engine = ScriptedEngine(TOK, turns)
    kw.setdefault("max_turns", 5)
    kw.setdefault("max_response_tokens", 4000)
    traj = await rollout_one(Scheduler([engine]), TOK, executor or FakeExecutor(), PROMPT, **kw)
    _check_alignment(traj)
    return traj, engine


def test_protocols_match_the_test_doubles():
    assert isinstance(TOK, Tokenizer)
    assert isinstance(FakeExecutor(), ToolExecutor)


async def test_tool_turn_then_answer_keeps_exact_ids_and_masks_tool_tokens():
    call1 = template.render_tool_call("print(6*7)")
    call2 = template.render_tool_call("raise ValueError")
    turn1 = f"<reason>compute</reason>{call1}{call2}{END}"
    turn2 = f"<reason>ok</reason><answer>\\boxed{{42}}</answer>{END}"
    executor = FakeExecutor(delay=0.01)
    traj, engine = await _run([turn1, turn2], executor)
    assert traj.turns == 2 and traj.finish_reason == "answer" and traj.answer == "42"
    assert traj.tool_calls == 2 and traj.tool_errors == 1 and traj.format_errors == 0
    assert executor.max_concurrent == 2, "a turn's calls run concurrently"
    assert traj.tool_seconds >= 0.01, "the turn waited for its 10 ms calls"
    assert not traj.truncated
    tool_text = template.render_tool_responses(
        ["len=10", "Traceback (most recent call last):\nValueError: boom"]
    )
    t1, t2, tt = TOK.encode(turn1), TOK.encode(turn2), TOK.encode(tool_text)
    assert traj.prompt_ids == TOK.encode(PROMPT)
    assert traj.response_ids == t1 + tt + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(tt) + [1] * len(t2)
    assert traj.logprobs[: len(t1)] == [-0.5] * len(t1)
    assert traj.response_text == turn1 + tool_text + turn2
    # The second turn continued exactly the ids so far: prompt + turn 1 + tool response.
    assert engine.requests[1].input_ids == traj.prompt_ids + t1 + tt
    assert engine.requests[1].stop_token_ids == (TOK.eos_id,)
    assert engine.requests[1].max_new_tokens == 4000 - len(t1) - len(tt)


async def test_invalid_json_becomes_the_tool_response_and_counts_as_format_error():
    bad = f'<tool_call>{{"name": "{template.TOOL_NAME}", "arguments": {{"code": "1"</tool_call>{END}'
    traj, _ = await _run([bad, f"no tools{END}"])
    assert traj.format_errors == 1 and traj.tool_errors == 1 and traj.tool_calls == 1
    assert "<tool_response>Error: invalid tool call JSON" in traj.response_text
    assert traj.finish_reason == "no_tool_call" and traj.turns == 2 and traj.answer is None


async def test_max_turns_stops_without_running_the_last_calls():
    call = template.render_tool_call("print(1)") + END
    executor = FakeExecutor()
    traj, _ = await _run([call], executor, max_turns=3)
    assert traj.turns == 3 and traj.finish_reason == "max_turns"
    assert traj.tool_calls == 2 and len(executor.calls) == 2
    assert traj.response_ids[-1] == TOK.eos_id and traj.loss_mask[-1] == 1


async def test_a_rollout_without_tool_calls_waited_for_none():
    traj, _ = await _run([f"<answer>\\boxed{{42}}</answer>{END}"], FakeExecutor(delay=0.05))
    assert traj.tool_calls == 0 and traj.tool_seconds == 0.0


async def test_generation_hitting_the_budget_is_truncated():
    traj, _ = await _run(["x" * 100 + END], max_response_tokens=30)
    assert traj.truncated and traj.finish_reason == "length" and len(traj.response_ids) == 30


async def test_tool_response_overflowing_the_budget_is_cut():
    turn = template.render_tool_call("print(1)") + END
    n = len(TOK.encode(turn))
    traj, engine = await _run([turn, "never" + END], max_response_tokens=n + 10)
    assert traj.truncated and traj.finish_reason == "length"
    assert len(traj.response_ids) == n + 10 and traj.loss_mask == [1] * n + [0] * 10
    assert len(engine.requests) == 1, "no room left for another turn"


async def test_unclosed_tool_call_is_a_format_error():
    traj, _ = await _run([f'<tool_call>{{"name": "x"{END}'])
    assert traj.format_errors == 1 and traj.finish_reason == "no_tool_call" and traj.tool_calls == 0


async def test_rollout_group_runs_everything_concurrently_through_the_scheduler():
    engine = ScriptedEngine(TOK, [f"<answer>1</answer>{END}"], capacity=10_000)
    sched = Scheduler([engine])
    groups = await rollout_group(
        sched, TOK, FakeExecutor(), [PROMPT, PROMPT + "x"], 3, max_turns=2, max_response_tokens=100
    )
    assert [len(g) for g in groups] == [3, 3]
    assert groups[1][0].prompt_ids == TOK.encode(PROMPT + "x")
    assert sched.snapshot()[0]["sessions_total"] == 6 and sched.snapshot()[0]["reserved"] == 0
    with pytest.raises(ValueError, match="max_turns"):
        await rollout_one(sched, TOK, FakeExecutor(), PROMPT, max_turns=0, max_response_tokens=10)


class FlakyEngine(ScriptedEngine):
    """Fails every ``fail_every``-th request, as a dead or erroring server would."""

    def __init__(self, turns: list[str], fail_every: int):
        super().__init__(TOK, turns, capacity=10_000)
        self.fail_every = fail_every

    async def generate(self, req):
        if (len(self.requests) + 1) % self.fail_every == 0:
            self.requests.append(req)
            raise SGLangError("POST http://sgl-0/generate -> HTTP 503: overloaded")
        return await super().generate(req)


async def test_an_engine_failure_aborts_only_its_rollout():
    call = template.render_tool_call("print(1)") + END
    engine = FlakyEngine([call], fail_every=4)
    sched = Scheduler([engine])
    groups = await rollout_group(
        sched, TOK, FakeExecutor(), [PROMPT], 4, max_turns=2, max_response_tokens=400
    )
    trajs = groups[0]
    aborted = [t for t in trajs if t.finish_reason == "abort"]
    assert len(trajs) == 4 and len(aborted) >= 1, "the other rollouts of the step carried on"
    assert all("HTTP 503: overloaded" in t.error for t in aborted)
    assert all(t.error is None and t.finish_reason == "max_turns" for t in trajs if t not in aborted)
    for t in trajs:
        _check_alignment(t)
    assert sched.snapshot()[0]["reserved"] == 0 and sched.snapshot()[0]["inflight"] == 0


class AnswerPrintingExecutor(FakeExecutor):
    async def execute(self, code: str, stdin: str = ""):
        await super().execute(code, stdin)
        return FakeResult("<answer>from the tool</answer>")


async def test_answer_tags_count_the_models_turns_only():
    call = template.render_tool_call("print(1)") + END
    final = f"<answer>\\boxed{{1}}</answer>{END}"
    traj, _ = await _run([call, final], AnswerPrintingExecutor())
    assert traj.response_text.count("<answer>") == 2, "the tool's output carries a tag too"
    assert traj.answer_tags == 1 and traj.finish_reason == "answer" and traj.answer == "1"


async def test_loop_on_local_engine_end_to_end():
    """A real GPT on LocalEngine: ids handed to the engine are exactly prompt + response so far."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32))
    # Bias the untrained model towards emitting <|im_end|> quickly so turns end by "stop".
    with torch.no_grad():
        model.wte.weight[TOK.eos_id] += 0.5 * model.wte.weight[TOK.OFFSET + ord("a")]
    engine = LocalEngine(model, max_batch=16, seed=0)
    sched = Scheduler([engine])
    groups = await rollout_group(
        sched, TOK, FakeExecutor(), [PROMPT] * 4, 4, max_turns=3, max_response_tokens=64, temperature=1.0
    )
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 16
    for t in trajs:
        _check_alignment(t)
        assert 1 <= len(t.response_ids) <= 64 and t.turns >= 1
        assert t.truncated == (t.finish_reason == "length")
        assert all(m == 1 for m in t.loss_mask)  # random text never forms a valid tool call
    assert engine.steps < sum(len(t.response_ids) for t in trajs) / 2, "rollouts share decode steps"
    assert json.loads(json.dumps(sched.snapshot()))[0]["sessions_total"] == 16


class HandEngine(ScriptedEngine):
    """Answers from a turn script shared with other engines (whichever engine answers takes the
    next turn); from its request ``fail_from`` on it is unreachable, as a removed replica."""

    def __init__(self, name: str, script: list[str], *, capacity: int, fail_from: int | None = None):
        super().__init__(TOK, [], name=name, capacity=capacity)
        self.script = script
        self.fail_from = fail_from

    async def generate(self, req):
        if self.fail_from is not None and len(self.requests) >= self.fail_from:
            self.requests.append(req)
            raise EngineUnreachable(f"POST http://{self.name}/generate failed after 4 attempts: refused")
        self.turns = [self.script.pop(0)]
        out = await super().generate(req)
        out.weight_version = 7
        return out


CALL = template.render_tool_call("print(6*7)") + END
ANSWER = f"<answer>\\boxed{{42}}</answer>{END}"


async def test_a_rollout_whose_engine_goes_unreachable_goes_on_on_another_from_its_turn():
    script = [CALL, CALL, ANSWER]
    a = HandEngine("a", script, capacity=10**6, fail_from=1)  # answers turn 1, then is gone
    b = HandEngine("b", script, capacity=10**5)
    sched = Scheduler([a, b])
    traj = await rollout_one(sched, TOK, FakeExecutor(), PROMPT, max_turns=5, max_response_tokens=4000)
    _check_alignment(traj)
    assert traj.finish_reason == "answer" and traj.answer == "42" and traj.turns == 3
    assert traj.handoffs == 1 and traj.engine == "b" and traj.error is None
    assert [r.input_ids for r in b.requests][0] == a.requests[1].input_ids, "b went on from the turn a lost"
    assert len(traj.versions) == 3 and traj.min_version == 7
    st = {s.name: s for s in sched.stats}
    assert st["a"].draining and st["a"].failed and st["a"].inflight == 0, "a takes no new rollouts"
    assert st["b"].reserved == 0 and st["b"].inflight == 0


async def test_a_draining_engine_hands_its_rollouts_on_at_the_next_turn():
    script = [CALL, CALL, ANSWER]
    a = HandEngine("a", script, capacity=10**6)
    b = HandEngine("b", script, capacity=10**5)
    sched = Scheduler([a, b])

    class DrainingExecutor(FakeExecutor):  # a scale-down lands while the rollout runs its tool
        async def execute(self, code: str, stdin: str = ""):
            sched.drain_engine("a")
            return await super().execute(code, stdin)

    traj = await rollout_one(sched, TOK, DrainingExecutor(), PROMPT, max_turns=5, max_response_tokens=4000)
    assert traj.finish_reason == "answer" and traj.turns == 3 and traj.handoffs == 1
    assert len(a.requests) == 1 and len(b.requests) == 2, "the draining engine only finished its turn"
    assert sched.remove_drained() == [a], "a is idle once its turn ended: it can go"


async def test_a_draining_engine_keeps_its_rollouts_when_no_other_takes_them():
    script = [CALL, ANSWER]
    a = HandEngine("a", script, capacity=10**6)
    sched = Scheduler([a])

    class DrainingExecutor(FakeExecutor):
        async def execute(self, code: str, stdin: str = ""):
            sched.drain_engine("a")
            return await super().execute(code, stdin)

    traj = await rollout_one(sched, TOK, DrainingExecutor(), PROMPT, max_turns=5, max_response_tokens=4000)
    assert traj.finish_reason == "answer" and traj.handoffs == 0 and len(a.requests) == 2


async def test_a_rollout_that_loses_every_engine_ends_as_abort_naming_why():
    a = HandEngine("a", [CALL], capacity=10**6, fail_from=0)
    b = HandEngine("b", [CALL], capacity=10**5, fail_from=0)
    sched = Scheduler([a, b], no_engine_timeout_s=0.1)
    traj = await rollout_one(sched, TOK, FakeExecutor(), PROMPT, max_turns=5, max_response_tokens=4000)
    assert traj.finish_reason == "abort" and traj.turns == 0 and traj.handoffs == 1
    assert "b" in traj.error and "refused" in traj.error
    assert [s.draining for s in sched.stats] == [True, True]


async def test_an_unreachable_server_raises_its_engines_unreachable_error():
    from kuberl.rollout.sglang_engine import SGLangEngine, SGLangUnreachable
    from kuberl.rollout.vllm_engine import VLLMEngine, VLLMError, VLLMUnreachable
    from kuberl.util.ports import free_port

    port = free_port()  # nothing listens there
    for cls, unreachable, own in ((SGLangEngine, SGLangUnreachable, SGLangError), (VLLMEngine, VLLMUnreachable, VLLMError)):
        engine = cls(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01)
        try:
            with pytest.raises(unreachable) as err:
                await engine._request("GET", "/v1/models")
        finally:
            await engine.close()
        assert isinstance(err.value, EngineUnreachable) and isinstance(err.value, own)
        assert "2 attempts" in str(err.value)


async def test_a_sandbox_that_cannot_run_a_turns_calls_aborts_only_that_rollout():
    class DownExecutor(FakeExecutor):
        async def execute(self, code: str, stdin: str = ""):
            if "boom" in code:
                raise RuntimeError("sandbox /v1/execute: no answer within 60 s")
            return await super().execute(code, stdin)

    down = template.render_tool_call("print('boom')") + END
    traj, _ = await _run([down, ANSWER], DownExecutor())
    assert traj.finish_reason == "abort" and traj.turns == 1 and traj.tool_calls == 0
    assert "tool executor: RuntimeError: sandbox /v1/execute: no answer within 60 s" in traj.error
    fine, _ = await _run([CALL, ANSWER], DownExecutor())
    assert fine.finish_reason == "answer" and fine.error is None
