"""The minicpmo duplex session's call rules (calls.CallWatch) on units' results alone, with a
tokenizer of whole words (runs without the model code): where a call's text begins, when it
is read, a barge-in, the cap on its units, parallel calls, and the outputs."""

from __future__ import annotations

import json

import numpy as np

from omnifabric.worker.engine import GenerateResult, ToolChoice, ToolSpec
from omnifabric.worker.engines import tool_text
from omnifabric.worker.engines.minicpmo.calls import MAX_AWAIT_UNITS, MAX_CALL_UNITS, CallWatch

WEATHER = ToolSpec(
    "get_weather",
    "Get the weather.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'


class Words:
    """A tokenizer whose tokens are the words of a list (encode: one id a character)."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.words[i] for i in ids)

    def encode(self, text, add_special_tokens=False) -> list[int]:
        return [ord(c) for c in text]


def watch(words: list[str] | None = None) -> CallWatch:
    return CallWatch((WEATHER,), ToolChoice(), Words(words or []))


def unit(text: str = "", listen: bool = False, eot: bool = False) -> GenerateResult:
    audio = np.zeros(0 if listen else 240, np.float32)
    return GenerateResult(is_listen=listen, text=text, audio=audio, end_of_turn=eot)


def test_the_tts_speaks_what_comes_before_the_tag() -> None:
    w = watch(["Sure.", " ", "<tool_call>", '{"name"'])
    assert w.speakable([0, 1, 2, 3]) == 2 and w.speakable([0, 1]) == 2
    w.body = "<tool_call>"
    assert w.speakable([0, 1]) == 0 and w.silent


def test_a_call_over_units_is_read_when_closed_and_the_next_unit_listens() -> None:
    w = watch()
    first = w.unit_result(unit('Sure. <tool_call>{"name": '), forced=False)
    assert (first.text, first.audio.size, first.is_listen) == ("Sure. ", 240, False)
    middle = w.unit_result(unit('"get_weather", "arguments": '), forced=False)
    assert (middle.text, middle.audio.size, middle.is_listen, middle.tool_calls) == (
        "",
        0,
        False,
        (),
    )
    last = w.unit_result(unit('{"city": "Paris"}}</tool_call>', eot=True), forced=False)
    (call,) = last.tool_calls
    assert json.loads(call.arguments) == {"city": "Paris"} and last.end_of_turn
    assert last.is_listen and last.text == "" and not last.audio.size
    assert w.take_force()  # the turn closes
    w.output(call.call_id, "18 C")
    assert not w.take_force()  # the output came: the model answers
    assert w.unit_result(unit("Hello."), forced=False).text == "Hello."


def test_calls_closed_at_a_units_end_wait_one_unit_for_more() -> None:
    """Parallel calls split exactly at a unit boundary: the first closes the unit with the
    turn open, the next unit (without speech) begins the second; both are made together."""
    w = watch()
    first = w.unit_result(unit(CALL % "Rome"), forced=False)
    assert first.tool_calls == () and w.silent and not w.take_force()
    both = w.unit_result(unit("\n" + CALL % "Oslo", eot=True), forced=False)
    assert [json.loads(c.arguments)["city"] for c in both.tool_calls] == ["Rome", "Oslo"]
    assert both.is_listen and both.end_of_turn and not both.audio.size and w.take_force()
    # One call closed at the boundary, then words: the call stands, the words are not said.
    w = watch()
    assert w.unit_result(unit("Ok. " + CALL % "Rome"), forced=False).text == "Ok. "
    (call,) = (got := w.unit_result(unit("It is sunny."), forced=False)).tool_calls
    assert json.loads(call.arguments)["city"] == "Rome"
    assert (got.text, got.audio.size, got.is_listen) == ("", 0, True)
    # A barge-in at the boundary: the closed call is made, not dropped.
    w = watch()
    w.unit_result(unit(CALL % "Rome"), forced=False)
    assert len(w.unit_result(unit(listen=True), forced=True).tool_calls) == 1


def test_the_session_listens_while_outputs_are_awaited_for_a_while() -> None:
    w = watch()
    (call,) = w.unit_result(unit(CALL % "Rome", eot=True), forced=False).tool_calls
    assert [w.take_force() for _ in range(MAX_AWAIT_UNITS + 2)] == [True] * (
        MAX_AWAIT_UNITS + 1
    ) + [False]  # the turn's close, then MAX_AWAIT_UNITS units waiting, then free
    w.output(call.call_id, "18 C")  # late: still fed to the model
    assert w.take_results() and not w.take_force()


def test_parallel_calls_in_one_unit_and_words_in_the_same_unit() -> None:
    w = watch()
    got = w.unit_result(unit("Ok. " + CALL % "Rome" + CALL % "Oslo", eot=True), forced=False)
    assert [json.loads(c.arguments)["city"] for c in got.tool_calls] == ["Rome", "Oslo"]
    assert (got.text, got.is_listen, got.audio.size) == ("Ok. ", False, 240)


def test_a_barge_in_drops_the_call() -> None:
    w = watch()
    w.unit_result(unit('<tool_call>{"name": '), forced=False)
    cut = w.unit_result(unit(listen=True), forced=True)
    assert cut.tool_calls == () and w.body is None and not w.take_force()


def test_a_call_never_closed_is_read_after_the_cap() -> None:
    w = watch()
    w.unit_result(unit('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'), False)
    for _ in range(MAX_CALL_UNITS - 2):
        assert w.unit_result(unit(" "), forced=False).tool_calls == ()
    (call,) = w.unit_result(unit(" "), forced=False).tool_calls
    assert json.loads(call.arguments) == {"city": "Rome"} and w.take_force()


def test_outputs_are_fed_once_all_came_others_ignored() -> None:
    w = watch()
    got = w.unit_result(unit(CALL % "Rome" + CALL % "Oslo", eot=True), forced=False)
    first, second = (c.call_id for c in got.tool_calls)
    w.output("call_unknown", "x")
    w.output(first, "18 C")
    assert w.results == []
    w.output(first, "again")  # given twice: the first stands
    w.output(second, "9 C")
    text = tool_text.results_text(["18 C", "9 C"])
    assert w.take_results() == [ord(c) for c in text] and w.take_results() == []


def test_a_call_that_cannot_be_made_is_answered_as_an_error_once_in_a_row() -> None:
    w = watch()
    bad = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert w.unit_result(unit(bad, eot=True), forced=False).tool_calls == ()
    told = "".join(map(chr, w.take_results()))
    assert "get_time" in told and told.startswith(tool_text.RESULT_OPEN)
    assert w.take_force() and not w.take_force()  # the turn closes; nothing is awaited
    w.unit_result(unit(bad, eot=True), forced=False)  # wrong again: only logged
    assert w.take_results() == []
    w.unit_result(unit("Sorry, I cannot."), forced=False)  # it spoke: a new run of tries
    w.unit_result(unit(bad, eot=True), forced=False)
    assert w.take_results()
