"""The minicpmo duplex session's call rules (calls.CallWatch) on units' results alone, with a
tokenizer of whole words (runs without the model code): where a call's text begins, when it
is read, a barge-in, the cap on its units, parallel calls, and the outputs."""

from __future__ import annotations

import json

import numpy as np

from omnifabric.worker.engine import GenerateResult, ToolChoice, ToolSpec
from omnifabric.worker.engines import tool_text
from omnifabric.worker.engines.minicpmo.calls import MAX_CALL_UNITS, CallWatch

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
    last = w.unit_result(unit('{"city": "Paris"}}</tool_call>'), forced=False)
    (call,) = last.tool_calls
    assert json.loads(call.arguments) == {"city": "Paris"} and last.end_of_turn
    assert last.is_listen and last.text == "" and not last.audio.size
    assert w.take_force() and not w.take_force()
    assert w.unit_result(unit("Hello."), forced=False).text == "Hello."


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
