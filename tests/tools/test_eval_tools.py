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


def test_the_held_out_set_asks_other_words_in_other_voices():
    import json

    from omnifabric.tools.eval_tools import HELD_OUT, MAIN_VOICE, plan

    assert sum(c.tool is not None for c in HELD_OUT) == 15
    assert sum(c.tool is None for c in HELD_OUT) == 10
    specs = {t["name"]: ToolSpec(t["name"], t["description"], t["parameters"]) for t in TOOLS}
    for case in HELD_OUT:
        if case.tool:
            assert argument_errors(specs[case.tool], json.dumps(case.arguments)) == []
    main_values = {
        str(v).lower() for c in CASES for v in c.arguments.values() if isinstance(v, str)
    }
    for case in HELD_OUT:  # no city, restaurant or order number of the main set again
        for value in case.arguments.values():
            assert (
                not isinstance(value, str)
                or value.endswith("pm")
                or (value.lower() not in main_values)
            ), value
    assert not {c.text for c in HELD_OUT} & {c.text for c in CASES}
    requests = plan(["main", "held-out"], ["typed", "spoken"])
    assert len(requests) == 2 * (40 + 25)
    spoken = [r for r in requests if r.mode == "spoken"]
    assert {r.voice for r in spoken if r.set == "main"} == {MAIN_VOICE}
    voices = {r.voice for r in spoken if r.set == "held-out"}
    assert len(voices) == 3 and MAIN_VOICE not in voices
    assert any(v is not None and v[0] == "espeak" for v in voices)
    assert all(r.voice is None for r in requests if r.mode == "typed")
    only_calls = plan(["main"], ["spoken"], "calls")
    assert len(only_calls) == 20 and all(r.case.tool for r in only_calls)


def test_the_table_reports_each_set_apart_and_a_miss_says_what_was_heard():
    from omnifabric.tools.eval_tools import Outcome, line, table

    weather = {"name": "get_weather", "arguments": '{"city": "Den Rome"}'}
    outcomes = [
        Outcome("spoken", "Is it sunny in Rome?", "get_weather", [weather], False, 2.0),
        Outcome("spoken", "Hi!", None, [], True, 1.0),
        Outcome("spoken", "Weather in Oslo?", "get_weather", [], False, 3.0, set="held-out"),
    ]
    outcomes[2].voice, outcomes[2].heard = "espeak:en-us@165", "Weather in a slow?"
    rows = table(outcomes).splitlines()
    assert rows[2].startswith("| main | spoken | 0/1 | 1/1 | 0 |")
    assert rows[3].startswith("| held-out | spoken | 0/1 | 0/0 | 0 |")
    assert line(outcomes[2]) == (
        "MISS [held-out spoken espeak:en-us@165] 'Weather in Oslo?' -> - (3.00 s) "
        "heard 'Weather in a slow?'"
    )
    assert line(outcomes[1]) == "ok  [spoken] 'Hi!' -> - (1.00 s)"


def test_a_request_of_several_parts_is_right_only_with_every_call_and_no_more():
    import json

    from omnifabric.tools.eval_tools import SEVERAL

    case = SEVERAL[0]  # Paris and London
    paris = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    london = {"name": "get_weather", "arguments": '{"city": "london"}'}
    assert scored(case, [london, paris]) and scored(case, [paris, london])
    assert not scored(case, [paris]) and not scored(case, [paris, paris])
    assert not scored(case, [paris, london, london])
    specs = {t["name"]: ToolSpec(t["name"], t["description"], t["parameters"]) for t in TOOLS}
    assert sum(len(c.expected()) > 1 for c in SEVERAL) == 8
    for case in SEVERAL:  # every expected call is one the offered schema takes
        for name, arguments in case.expected():
            assert argument_errors(specs[name], json.dumps(arguments)) == []
