"""Tokenizer, builtin:arith data and SFT traces (layout identical to what the rollout loop builds)."""

from __future__ import annotations

import asyncio
import json

import pytest
from trainer_fakes import FakeSandbox

from kuberl.rollout import template
from kuberl.trainer.data import (
    arith_problems,
    build_sft_traces,
    load_jsonl,
    load_problems,
    tokenize_segments,
    tokenizer_corpus,
)
from kuberl.trainer.tokenizer import BPETokenizer, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return train_bpe(tokenizer_corpus(3000, 0), 1024)


def test_problems_are_deterministic_and_correct():
    a, b = arith_problems(50, 3), arith_problems(50, 3)
    assert a == b and a != arith_problems(50, 4)
    for p in a:
        assert str(eval(p.expr)) == p.answer  # noqa: S307
        assert p.question == f"{p.expr}=?"


def test_jsonl_loading_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "1+1", "answer": 2}) + "\n\n")
    assert load_problems(str(f), 0, 0)[0].answer == "2"
    f.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="expected"):
        load_jsonl(f)
    f.write_text("nope\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_jsonl(f)
    with pytest.raises(ValueError, match="unknown builtin"):
        load_problems("builtin:gsm8k", 1, 0)


def test_tokenizer_groups_digits_and_roundtrips(tok, tmp_path):
    assert tok.eos_id == tok.hf.token_to_id(template.IM_END)
    for s in template.SPECIAL_TOKENS:
        assert tok.encode(s) == [tok.hf.token_to_id(s)]
    ids = tok.encode("123456")
    assert [tok.decode([i]) for i in ids] == ["12", "34", "56"]
    text = template.render_prompt("647*271=?", "compact") + template.render_tool_call("print(647*271)")
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(template.render_tool_call("print(1)"))) < 15  # boilerplate merges
    cached = load_tokenizer("builtin:arith-bpe", tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert load_tokenizer("builtin:arith-bpe", tmp_path).to_str() == cached.to_str()
    assert load_tokenizer(str(tmp_path / "tokenizer.json"), "unused").to_str() == cached.to_str()
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer("gpt2-nope", tmp_path)


def test_sft_traces_match_rollout_layout(tok):
    probs = arith_problems(40, 1)
    traces = asyncio.run(build_sft_traces(probs, FakeSandbox(), seed=0, error_fraction=0.5))
    n_err = 0
    for p, segs in zip(probs, traces, strict=True):
        text = "".join(t for t, _ in segs)
        assert text.startswith(template.render_prompt(p.question, "compact"))
        assert template.extract_answer(text) == p.answer
        turns = [t for t, m in segs if m == 1]
        calls = [template.parse_tool_calls(t) for t in turns[:-1]]
        assert all(len(c) == 1 and isinstance(c[0], template.ToolCall) for c in calls)
        assert all(t.endswith(template.IM_END) for t in turns)
        n_err += len(turns) == 3
        if len(turns) == 3:
            assert "Error" in segs[2][0]  # the first tool response is the error, then the fix
        ids, mask = tokenize_segments(tok, segs)
        assert len(ids) == len(mask)
        # assistant-token ids are exactly encode(turn) as the rollout loop would have sampled them
        assert [i for i, m in zip(ids, mask, strict=True) if m] == [x for t in turns for x in tok.encode(t)]
    assert 10 <= n_err <= 30


def test_chat_traces_become_rollout_layout_segments(tmp_path):
    from kuberl.rollout import template
    from kuberl.trainer.data import load_sft_traces, messages_segments

    call = template.render_tool_call("print(6*7)")
    msgs = [
        {"role": "user", "content": "6*7=?"},
        {"role": "assistant", "content": call + call},
        {"role": "tool", "content": "42\n"},
        {"role": "tool", "content": "42\n"},
        {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"},
    ]
    segs = messages_segments(msgs, "compact")
    assert segs == [
        (template.render_prompt("6*7=?", "compact"), 0),
        (call + call + template.IM_END, 1),
        (template.render_tool_responses(["42\n", "42\n"]), 0),  # one block, as the loop writes it
        ("<answer>\\boxed{42}</answer>" + template.IM_END, 1),
    ]
    f = tmp_path / "sft.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n\n")
    assert load_sft_traces(str(f), "compact") == [segs]
    bad = {
        "a trace starts with a user message": [{"role": "system", "content": "x"}],
        "a trace ends with an assistant turn": msgs[:3],
        "roles are assistant or tool; got 'critic'": [msgs[0], {"role": "critic", "content": "x"}],
        "a trace ends with an assistant turn ": msgs[:1],
        "list of \\{role, content\\} objects": [msgs[0], "hi"],
        "two assistant messages in a row": [msgs[0], msgs[1], msgs[1]],
        "a tool message answers an assistant turn": [msgs[0], msgs[2], msgs[1]],
        "with string content": [{"role": "user", "content": None}, msgs[1]],
        "content must be a string, got list": [msgs[0], {"role": "assistant", "content": ["x"]}],
    }
    for why, m in bad.items():
        f.write_text(json.dumps({"messages": m}) + "\n")
        with pytest.raises(ValueError, match=r"sft.jsonl:1: .*" + why.strip()):
            load_sft_traces(str(f), "compact")
    f.write_text('{"question": "1+1=?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r'expected \{"messages"'):
        load_sft_traces(str(f), "compact")
