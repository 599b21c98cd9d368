"""What the child reads of a call, cheaply: the request off its pipe (not JSON), and the trailing
expression from the code's text alone (child.split_trailing_expression), which, where it
answers, must answer exactly what parsing the code answers (what the child did before)."""

from __future__ import annotations

import ast
import contextlib
import io
from typing import Any

import pytest

from kuberl.sandbox.process.child import decode_request, encode_request, split_trailing_expression

SNIPPETS = {
    "print": ("print(sum(range(100)))", True),
    "name": ("x = 1\nx", True),
    "negation": ("x = 3\n-x", True),
    "multi_line_call": ("print(1,\n2)", False),  # its last line alone is no expression
    "call_closed_at_col_0": ("f = lambda *a: len(a)\nf(1,\n2\n)", False),
    "semicolon": ("x = 5; x", False),
    "block_last": ("for i in range(2):\n    print(i)", False),
    "if_with_expression": ("if True:\n    1\n", False),
    "try_finally": ("try:\n    1\nfinally:\n    2", False),
    "decorated": ("import functools\n@functools.cache\ndef f():\n    return 1", False),
    "string_lines": ("s = '''\nabc\n'''\ns", True),
    "inside_string": ("s = '''\nabc\n'''", False),
    "comment_after": ("x = 1\n# end", False),
    "expression_then_comment": ("x = 2\nx\n# done\n", True),
    "function_call": ("def f():\n    return 2\nf()", True),
    "continuation": ("x = 1 + \\\n2\nx", True),
    "comprehension_continued": ("a = [i\nfor i in range(3)]\na", True),
    "generator_at_col_0": ("sum(i\nfor i in range(3))", False),
    "blank_tail": ("print('a')\n\n\n", True),
    "crlf": ("x = 4\r\nx\r\n", True),
    "tabs": ("if True:\n\ty = 2\ny", True),
    "empty": ("", False),
    "only_comment": ("# nothing", False),
    "zero_division": ("x = 1\n\n1/0", True),
    "error_in_head": ("y = 1\ny.bad\ny", True),
    "return_outside": ("return 1", False),
    "yield_outside": ("(yield)", False),
    "await_outside": ("x = 1\nawait x", False),
    "syntax_error": ("x = (\n", False),
    "nul": ("x = 1\0", False),
}


def _by_parsing(code: str) -> tuple[str, Any]:
    """What the child did before: parse, run the module, evaluate its trailing expression."""
    env: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            tree = ast.parse(code, filename="<string>", mode="exec")
            tail = tree.body.pop().value if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<string>", "exec"), env)  # noqa: S102
            value = eval(compile(ast.Expression(tail), "<string>", "eval"), env) if tail is not None else None  # noqa: S307
        except BaseException as exc:  # noqa: BLE001
            return out.getvalue(), _failure(exc)
    return out.getvalue(), repr(value)


def _by_split(code: str) -> tuple[str, Any] | None:
    split = split_trailing_expression(code)
    if split is None:
        return None
    env: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(split[0], env)  # noqa: S102
            value = eval(split[1], env)  # noqa: S307
        except BaseException as exc:  # noqa: BLE001
            return out.getvalue(), _failure(exc)
    return out.getvalue(), repr(value)


def _failure(exc: BaseException) -> tuple[str, int | None]:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return type(exc).__name__, getattr(exc, "lineno", None) or (tb.tb_lineno if tb else None)


@pytest.mark.parametrize(("code", "split"), SNIPPETS.values(), ids=SNIPPETS.keys())
def test_the_text_split_answers_what_parsing_answers(code: str, split: bool) -> None:
    fast = _by_split(code)
    assert (fast is not None) == split
    if fast is not None:
        assert fast == _by_parsing(code)  # output, value or error and its line


REQUESTS = [
    {"op": "exec", "code": "print(1)\n# \ud800 é \0", "stdin": "a\nb 7 9\n", "timeout": 10.0},
    {"op": "exec", "code": "", "stdin": "", "timeout": 0.001},
    {"op": "verify", "prediction": "\\frac{1}{2}", "gold": "0.5 \n", "timeout": 5.0},
]


@pytest.mark.parametrize("req", REQUESTS, ids=["exec", "empty", "verify"])
def test_a_request_reaches_the_child_as_sent(req: dict[str, Any]) -> None:
    """The worker-to-child request (not JSON: its Python costs the child page faults) keeps
    every text exactly, lone surrogates, NULs and newlines included."""
    assert decode_request(encode_request(req)) == req
