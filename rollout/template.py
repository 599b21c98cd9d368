"""The rStar2-Agent prompt template (paper fig. 3) and the tool-call wire format.

This module is the contract between rollout (which parses what the model writes), trainer
(whose SFT traces must look exactly like what rollout parses) and sandbox (which executes
``execute_python_code_with_standard_io`` calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_NAME = "execute_python_code_with_standard_io"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
    "<reason>",
    "</reason>",
    "<think>",
)

TOOLS_JSON = json.dumps(
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": (
                "Execute Python code with standard input and capture standard output. This function takes a "
                "Python code string and an input string, provides the input string through standard input (stdin) "
                "to the code, and captures and returns any output produced through standard output (stdout). If the "
                "executed code raises an exception, the error message will be captured and returned instead."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {
                        "type": "string",
                        "description": "A string containing Python code to be executed. "
                        "The code can read from standard input using the input() function.",
                    },
                    "input": {
                        "type": "string",
                        "description": "A string that will be provided as standard input "
                        "to the code when it calls input().",
                    },
                },
                "required": ["code", "input"],
            },
            "return": {
                "type": "string",
                "description": "str: The output produced by the executed code through "
                "standard output. If an error occurs during execution, the error message will be returned.",
            },
        },
    }
)

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <reason> </reason> and <answer> </answer> tags, "
    "respectively, i.e., <reason> reasoning process here </reason><answer> answer here </answer>.\n\n"
    "# Tools: You may call one or more functions to assist with the user query. You are provided with function "
    f"signatures within <tools></tools> XML tags:\n<tools>{TOOLS_JSON}</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:<tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call>"
)

USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your "
    "final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem: "
)


def render_prompt(question: str, style: str = "rstar2") -> str:
    """The text of the first turn, ending where the assistant starts writing.

    ``compact`` drops the ~400-token system prompt: tiny local models (the quickstart) learn
    the same tool protocol from SFT without paying for it on every rollout.
    """
    if style == "compact":
        return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
    return (
        f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n"
        f"{IM_START}user\n{USER_PREFIX}{question} {IM_END}\n{IM_START}assistant <think>"
    )


def render_tool_response(content: str) -> str:
    """What follows an assistant turn that called tools: the results under the user role."""
    return f"\n{IM_START}user\n<tool_response>{content}</tool_response>{IM_END}\n{IM_START}assistant\n"


def render_tool_responses(contents: list[str]) -> str:
    body = "".join(f"<tool_response>{c}</tool_response>" for c in contents)
    return f"\n{IM_START}user\n{body}{IM_END}\n{IM_START}assistant\n"


def render_tool_call(code: str, stdin: str = "") -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
        + "</tool_call>"
    )


@dataclass(frozen=True)
class ToolCall:
    code: str
    stdin: str = ""
    name: str = TOOL_NAME


@dataclass(frozen=True)
class ToolCallError:
    """A <tool_call> block that could not be used; ``message`` goes back as the tool response."""

    message: str


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


_DECODER = json.JSONDecoder()


def _next_call(text: str, start: int) -> tuple[str | dict, int] | None:
    """The JSON object of the <tool_call> at ``start`` and the index after its closing tag.

    The object is decoded first and only then the closing tag expected, so code that itself
    contains the string "</tool_call>" is not cut in half. A body that is not valid JSON is
    returned as its raw text up to the next closing tag.
    """
    body_start = start + len("<tool_call>")
    close = text.find("</tool_call>", body_start)
    if close < 0:
        return None
    i = body_start
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return text[body_start:close], close + len("</tool_call>")
    rest = text[end:]
    stripped = rest.lstrip()
    if not stripped.startswith("</tool_call>"):
        return text[body_start:close], close + len("</tool_call>")
    return obj, end + (len(rest) - len(stripped)) + len("</tool_call>")


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every closed <tool_call> block of one assistant turn, in order (paper section 2.1)."""
    calls: list[ToolCall | ToolCallError] = []
    pos = text.find("<tool_call>")
    while pos >= 0:
        found = _next_call(text, pos)
        if found is None:
            break
        obj, pos = found
        calls.append(_to_call(obj))
        pos = text.find("<tool_call>", pos)
    return calls


def _to_call(obj: str | dict) -> ToolCall | ToolCallError:
    if isinstance(obj, str):
        try:
            json.loads(obj)
        except json.JSONDecodeError as err:
            return ToolCallError(f"Error: invalid tool call JSON: {err.msg} at position {err.pos}")
        return ToolCallError("Error: text after the tool call JSON object before </tool_call>")
    if not isinstance(obj, dict) or not isinstance(obj.get("arguments"), dict):
        return ToolCallError('Error: tool call must be {"name": ..., "arguments": {...}}')
    if obj.get("name") != TOOL_NAME:
        return ToolCallError(f"Error: unknown function {obj.get('name')!r}; available: {TOOL_NAME}")
    code, stdin = obj["arguments"].get("code"), obj["arguments"].get("input", "")
    if not isinstance(code, str):
        return ToolCallError("Error: arguments.code must be a string")
    return ToolCall(code=code, stdin=stdin if isinstance(stdin, str) else str(stdin))


def has_unclosed_tool_call(text: str) -> bool:
    return text.count("<tool_call>") > text.count("</tool_call>")


def extract_answer(text: str) -> str | None:
    """The final answer: \\boxed{} inside the last <answer> block, else the block's text."""
    blocks = _ANSWER_RE.findall(text)
    if not blocks:
        return None
    block = blocks[-1]
    boxed = _last_boxed(block)
    return (boxed if boxed is not None else block).strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None
