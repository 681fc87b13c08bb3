"""Function calls and their outputs as text, the way ChatML-family templates write them.

The reference engine (reference/functions.py) and the minicpmo engine (minicpmo/engine.py)
both put calls and outputs into a conversation as text, and both read a model's arguments
back and check them against the function's schema; this module is that shared part, owned
by neither engine:

- a call: an assistant turn "<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>";
- outputs: one user turn of "<tool_response>" blocks;
- arguments: the JSON object the model wrote, checked against the schema (common.tools);
- the words of a reply whose calls could not be made.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from omnifabric.common import nesting
from omnifabric.common.tools import argument_errors
from omnifabric.worker.engine import ToolCall, ToolSpec

#: How a function's output begins in the turn of outputs (``results_text``).
RESULT_OPEN = "<tool_response>"
#: A reply whose calls could not be made (their arguments never fit).
CANNOT = "Sorry, I could not do that."


def parse_arguments(text: str, spec: ToolSpec) -> tuple[str, list[str]]:
    """The JSON object at the start of ``text`` (what follows it is dropped), as compact JSON
    text, and what is wrong with it for ``spec`` ([] when it fits)."""
    try:
        value, _ = nesting.raw_decode(text.strip())
    except ValueError as exc:
        return "", [f"the arguments are not JSON ({exc})"]
    if not isinstance(value, dict):
        return "", ["the arguments must be a JSON object"]
    arguments = json.dumps(value, ensure_ascii=False)
    return arguments, argument_errors(spec, arguments)


def call_text(call: ToolCall) -> str:
    """A call as the model's template writes it in an assistant turn."""
    try:
        arguments: Any = nesting.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def calls_text(calls: Sequence[ToolCall], said: str = "") -> str:
    """An assistant turn of ``said`` (words, if any) and ``calls``, as the model writes it."""
    return "\n".join([*([said] if said else []), *(call_text(c) for c in calls)])


def results_text(outputs: Sequence[str]) -> str:
    """Function outputs as one user turn's text."""
    return "\n".join(f"{RESULT_OPEN}\n{o}\n</tool_response>" for o in outputs)
