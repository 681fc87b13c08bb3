"""omnifabric eval-tools: its request set and its scoring, without a stack (the run itself
is a benchmark: docs/performance.md)."""

from __future__ import annotations

from omnifabric.common.tools import ToolSpec, argument_errors
from omnifabric.tools.eval_tools import CASES, TOOLS, Case, scored


def test_the_set_asks_twenty_with_a_call_and_twenty_without():
    assert sum(c.tool is not None for c in CASES) == 20
    assert sum(c.tool is None for c in CASES) == 20
    specs = {t["name"]: ToolSpec(t["name"], t["description"], t["parameters"]) for t in TOOLS}
    for case in CASES:  # every expected call is one the offered schema takes
        if case.tool:
            import json

            assert argument_errors(specs[case.tool], json.dumps(case.arguments)) == []


def test_a_call_is_right_only_as_the_function_with_its_arguments():
    case = Case("Book a table for two at the Ivy at 9pm.", "book_table", {
        "restaurant": "the Ivy", "people": 2, "time": "9pm"})  # fmt: skip
    call = {
        "name": "book_table",
        "arguments": '{"restaurant": "Ivy", "people": "2", "time": "9 PM"}',
    }
    assert scored(case, [call])
    assert not scored(case, [{**call, "name": "get_weather"}])
    assert not scored(case, [call, call])  # one call, not two
    assert not scored(case, [{**call, "arguments": '{"restaurant": "Nobu", "people": 2}'}])
    assert not scored(case, [{**call, "arguments": "not json"}])
    assert scored(Case("Hello!"), []) and not scored(Case("Hello!"), [call])
