"""Calls as text, read back from what a model wrote or a client sent (worker.engines.tool_text,
the minicpmo engine's call reader): nesting past common.nesting's limit is a problem named,
never a RecursionError out of the engine's step (a model may write thousands of "[" in a
reply; a client's function_call item carries any string as its arguments)."""

from __future__ import annotations

from omnifabric.common.tools import AUTO, ToolCall, ToolChoice, ToolSpec
from omnifabric.worker.engines import tool_text
from omnifabric.worker.engines.minicpmo import calls

WEATHER = ToolSpec(
    "get_weather",
    "",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_arguments_are_a_problem_named():
    assert tool_text.parse_arguments('{"city": "Oslo"} ' + DEEP, WEATHER) == ("", [
        "the arguments are not JSON (JSON nested deeper than 512 levels)"
    ])  # fmt: skip
    assert tool_text.parse_arguments('{"city": "Oslo"} [[1]]', WEATHER) == ('{"city": "Oslo"}', [])


def test_a_clients_deep_arguments_go_into_the_prompt_as_text():
    text = tool_text.call_text(ToolCall("call_1", "get_weather", DEEP))
    assert text.startswith("<tool_call>\n") and '"arguments": "[[[' in text
    said = tool_text.call_text(ToolCall("call_1", "get_weather", '{"city": "Oslo"}'))
    assert '"arguments": {"city": "Oslo"}' in said


def test_a_models_deep_call_is_left_out_and_the_next_one_read():
    good = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    body = f"<tool_call>{DEEP}</tool_call><tool_call>{good}</tool_call>"
    found, problems = calls.read_calls(body, [WEATHER], ToolChoice(AUTO))
    assert [(c.name, c.arguments) for c in found] == [("get_weather", '{"city": "Oslo"}')]
    assert len(problems) == 1 and problems[0].startswith("a call is not JSON: '[[[")
    deep_arguments = '{"name": "get_weather", "arguments": "' + DEEP + '"}'
    found, problems = calls.read_calls(f"<tool_call>{deep_arguments}", [WEATHER], ToolChoice())
    assert not found and problems == ["tool get_weather: the arguments must be a JSON object"]


def test_a_call_named_by_anything_but_a_string_is_left_out():
    """A list as the name raised TypeError (unhashable) out of the reader."""
    for name, shown in (("[1]", "list"), ('{"a": 1}', "dict"), ("3", "int"), ('"nope"', "'nope'")):
        body = '<tool_call>{"name": ' + name + ', "arguments": {}}</tool_call>'
        found, problems = calls.read_calls(body, [WEATHER], ToolChoice())
        assert not found and problems == [f"a call of {shown}, not a function offered"]
