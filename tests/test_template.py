"""The tool-call wire format shared by rollout, trainer and sandbox (rStar2-Agent section 2.1)."""

import json
import re

from kuberl.rollout.template import (
    IM_END,
    TOOL_NAME,
    ToolCall,
    ToolCallError,
    extract_answer,
    has_unclosed_tool_call,
    parse_tool_calls,
    render_prompt,
    render_tool_call,
    render_tool_responses,
)


def test_rstar2_prompt_matches_paper_figure_3():
    text = render_prompt("What is 2+2?")
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert TOOL_NAME in text and "<tools>" in text
    assert "This is the problem: What is 2+2? <|im_end|>" in text
    assert text.endswith("<|im_start|>assistant <think>")
    tools = json.loads(re.search(r"<tools>(\{.*?\})</tools>", text).group(1))
    assert tools["function"]["parameters"]["required"] == ["code", "input"]


def test_compact_prompt_is_short():
    assert render_prompt("1+1", style="compact") == f"<|im_start|>user\n1+1{IM_END}\n<|im_start|>assistant\n"


def test_render_then_parse_roundtrip_keeps_code_and_stdin():
    code = 'x = int(input())\nprint(x * "}</tool_call>".count("}"))'
    calls = parse_tool_calls("thinking " + render_tool_call(code, "21") + " more")
    assert calls == [ToolCall(code=code, stdin="21")]


def test_multiple_calls_in_order_and_invalid_json_becomes_error():
    text = (
        render_tool_call("print(1)")
        + '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(2)"</tool_call>'
        + render_tool_call("print(3)")
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("print(1)") and calls[2] == ToolCall("print(3)")
    assert isinstance(calls[1], ToolCallError) and "invalid tool call JSON" in calls[1].message


def test_wrong_name_or_shape_is_an_error_not_an_execution():
    bad_name = '<tool_call>{"name": "rm_rf", "arguments": {"code": "x"}}</tool_call>'
    bad_args = (
        '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": "print(1)"}</tool_call>'
    )
    bad_code = (
        '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": 5}}</tool_call>'
    )
    for text, needle in (
        (bad_name, "unknown function"),
        (bad_args, "must be"),
        (bad_code, "must be a string"),
    ):
        (call,) = parse_tool_calls(text)
        assert isinstance(call, ToolCallError) and needle in call.message


def test_json_array_and_trailing_text_are_errors():
    (call,) = parse_tool_calls("<tool_call>[1, 2]</tool_call>")
    assert isinstance(call, ToolCallError)
    (call,) = parse_tool_calls('<tool_call>{"name": "x", "arguments": {}} junk</tool_call>')
    assert isinstance(call, ToolCallError) and "Extra data" in call.message


def test_no_tool_call_and_unclosed_call():
    assert parse_tool_calls("just text <answer>\\boxed{3}</answer>") == []
    assert has_unclosed_tool_call('<tool_call>{"name": ')
    assert not has_unclosed_tool_call(render_tool_call("1"))


def test_tool_responses_render_under_user_role():
    text = render_tool_responses(["42\n", "Traceback..."])
    assert text == (
        "\n<|im_start|>user\n<tool_response>42\n</tool_response><tool_response>Traceback...</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_extract_answer_takes_boxed_in_last_answer_block():
    assert (
        extract_answer("<answer>first</answer> then <answer>so \\boxed{\\frac{1}{2}}</answer>")
        == "\\frac{1}{2}"
    )
    assert extract_answer("<answer> 17 </answer>") == "17"
    assert extract_answer("\\boxed{5} but no answer tag") is None
    assert extract_answer("<answer>\\boxed{unbalanced</answer>") == "\\boxed{unbalanced"
