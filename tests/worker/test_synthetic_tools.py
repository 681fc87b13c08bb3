"""The synthetic engine's function calling: which function it calls, with what arguments,
and its answer after a function's output (the rules fabric tests rely on)."""

from __future__ import annotations

import json

import numpy as np

from omnifabric.common.tools import AUTO, FUNCTION, NONE, REQUIRED, argument_errors
from omnifabric.worker.engine import ChatMessage, ChatTurn, ToolCall, ToolChoice, ToolSpec
from omnifabric.worker.engines.synthetic import SyntheticEngine

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
BOOKING = ToolSpec(
    "book_table",
    "Book a table at a restaurant.",
    {
        "type": "object",
        "properties": {
            "people": {"type": "integer"},
            "price": {"type": "number"},
            "terrace": {"type": "boolean"},
            "wishes": {"type": "array", "items": {"type": "string"}},
            "contact": {"type": "object"},
            "note": {"type": "string"},
        },
        "required": ["people", "price", "terrace", "wishes", "contact"],
    },
)
TOOLS = (WEATHER, BOOKING)
AUTO_CHOICE = ToolChoice(AUTO)


def chat(text: str, choice: ToolChoice = AUTO_CHOICE, tools=TOOLS, **kw):
    turn = ChatTurn(messages=(ChatMessage("user", (text,)),), tools=tools, tool_choice=choice, **kw)
    return list(SyntheticEngine(compute_ms=0).chat(turn))


def calls(chunks) -> list[ToolCall]:
    return [c for chunk in chunks for c in chunk.tool_calls]


def text(chunks) -> str:
    return "".join(c.text for c in chunks)


def test_auto_calls_the_tool_whose_name_word_the_user_said() -> None:
    chunks = chat("What's the WEATHER in Paris?")
    (call,) = calls(chunks)
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert argument_errors(WEATHER, call.arguments) == []
    assert call.call_id.startswith("call_") and len(call.call_id) > 5
    # Prefilled first, the calls, then the done chunk; no words.
    assert chunks[0].prefilled and chunks[-1].done and text(chunks) == ""
    assert chunks[-2].tool_calls == (call,)


def test_the_call_is_deterministic() -> None:
    assert calls(chat("weather in Oslo")) == calls(chat("weather in Oslo"))


def test_auto_without_a_name_word_echoes_as_before() -> None:
    # "get" is under 4 letters; "table" is not said as a word of its own ("tables" is not).
    for said in ("Can you get me something?", "How many tables?"):
        chunks = chat(said)
        assert calls(chunks) == [] and text(chunks) == f"You said: {said}"


def test_auto_takes_the_first_matching_tool() -> None:
    (call,) = calls(chat("book a table, and the weather too"))
    assert call.name == "get_weather"


def test_required_calls_the_first_tool_and_fills_each_type() -> None:
    (call,) = calls(chat("hello there", ToolChoice(REQUIRED), tools=(BOOKING, WEATHER)))
    assert call.name == "book_table"
    assert json.loads(call.arguments) == {
        "people": 1,
        "price": 1,
        "terrace": True,
        "wishes": [],
        "contact": {},
    }


def test_a_named_function_is_called() -> None:
    (call,) = calls(chat("what's the weather?", ToolChoice(FUNCTION, "book_table")))
    assert call.name == "book_table"


def test_string_arguments_without_a_word_are_synthetic() -> None:
    (call,) = calls(chat("weather ?!", ToolChoice(FUNCTION, "get_weather")))
    # "weather" is the only word of 3+ letters; punctuation alone is no word.
    assert json.loads(call.arguments)["city"] == "weather"
    (call,) = calls(chat("a b", ToolChoice(FUNCTION, "get_weather")))
    assert json.loads(call.arguments)["city"] == "synthetic"


def test_none_and_no_tools_leave_the_echo_unchanged() -> None:
    for chunks in (chat("weather in Paris", ToolChoice(NONE)), chat("weather in Paris", tools=())):
        assert calls(chunks) == [] and text(chunks) == "You said: weather in Paris"


def test_arguments_that_cannot_fit_are_not_sent() -> None:
    nested = ToolSpec(
        "set_alarm",
        "",
        {
            "type": "object",
            "properties": {
                "when": {
                    "type": "object",
                    "properties": {"hour": {"type": "integer"}},
                    "required": ["hour"],
                }
            },
            "required": ["when"],
        },
    )
    chunks = chat("set the alarm", ToolChoice(AUTO), tools=(nested,))
    assert calls(chunks) == []
    assert text(chunks) == "I could not call set_alarm."
    assert chunks[-1].ignored == ("tool set_alarm: arguments.when.hour is required",)


def test_after_a_function_output_it_answers_with_the_output_verbatim() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    output = '{"temperature_c": 18,  "conditions": "light rain"}\n'
    messages = (
        ChatMessage("user", ("What's the weather in Paris?",)),
        ChatMessage("assistant", (), (call,)),
        ChatMessage("tool", (output,), tool_call_id="call_1"),
    )
    engine = SyntheticEngine(compute_ms=0)
    chunks = list(engine.chat(ChatTurn(messages=messages, tools=TOOLS, speech=True)))
    assert calls(chunks) == []
    assert text(chunks) == f"The result: {output}"
    assert all(len(c.text.rstrip()) <= 16 or " " not in c.text.strip() for c in chunks)
    # Spoken as its other replies are: a quarter second of tone a piece.
    pieces = [c for c in chunks if c.text]
    assert len(pieces) > 1 and all(c.audio.size == 24000 // 4 for c in pieces)
    assert chunks[-1].done and chunks[-1].output_tokens == len(text(chunks).split())


def test_several_outputs_are_answered_together_and_cut_at_max_new_tokens() -> None:
    messages = (
        ChatMessage("user", ("weather and booking",)),
        ChatMessage("assistant", (), (ToolCall("a", "get_weather", "{}"),)),
        ChatMessage("tool", ("sunny",), tool_call_id="a"),
        ChatMessage("tool", ("booked",), tool_call_id="b"),
    )
    engine = SyntheticEngine(compute_ms=0)
    assert text(engine.chat(ChatTurn(messages=messages))) == "The result: sunny booked"
    chunks = list(engine.chat(ChatTurn(messages=messages, max_new_tokens=2)))
    assert text(chunks) == "The result:" and chunks[-1].cut


def test_the_echo_pieces_are_unchanged() -> None:
    engine = SyntheticEngine(compute_ms=0)
    turn = ChatTurn(messages=(ChatMessage("user", ("one two three four  five\nsix",)),))
    pieces = [c.text for c in engine.chat(turn) if c.text]
    assert pieces == ["You said: one ", "two three four ", "five six"]
    cut = list(engine.chat(ChatTurn(messages=turn.messages, max_new_tokens=4)))
    assert [c.text for c in cut if c.text] == ["You said: one ", "two"] and cut[-1].cut
    audio = ChatTurn(messages=(ChatMessage("user", (np.zeros(16000, np.float32),)),))
    assert text(engine.chat(audio)) == "You said: [audio 1.0 s]"
