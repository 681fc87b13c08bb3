"""Function calling on the minicpmo engine's chat path, the plumbing (opt-in, tiny random
checkpoint): the functions reach the model through the checkpoint's chat template, and the
model's call tokens come back as checked calls. The tiny model's words are random, so its
decoder is scripted: while it generates, a forward hook makes each next token the
script's (the model's own code does everything else)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator

import pytest

from omnifabric.common.tools import FUNCTION, NONE, argument_errors
from omnifabric.worker.engine import ChatMessage, ChatTurn, ToolCall, ToolChoice
from omnifabric.worker.engines.reference import functions
from tests.worker.minicpmo.conftest import WEATHER, needs_code

pytestmark = needs_code

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
#: What the scripts make the model say has no newline: the duplex layout's chat path
#: forbids newline tokens (the tokenizer's bad_token_ids), so the model writes calls without.
SAID_CALL = CALL.replace("\n", "")


@contextlib.contextmanager
def scripted(engine, text: str) -> Iterator[list[list[dict]]]:
    """While the model generates, its next tokens are `text`'s, then <|im_end|>; yields the
    messages streaming_prefill got (one list a call)."""
    model, tokenizer = engine.model, engine.tokenizer
    script = [*tokenizer.encode(text, add_special_tokens=False)]
    script.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    at = {"on": False, "next": 0}
    prefilled: list[list[dict]] = []
    generate, prefill = model.streaming_generate, model.streaming_prefill

    @functools.wraps(generate)
    def scripted_generate(*args, **kwargs):
        at.update(on=True, next=0)
        try:
            yield from generate(*args, **kwargs)
        finally:
            at["on"] = False

    @functools.wraps(prefill)
    def recorded_prefill(*args, **kwargs):
        prefilled.append([dict(m) for m in kwargs["msgs"]])
        return prefill(*args, **kwargs)

    def hook(module, inputs, output):
        if at["on"] and at["next"] < len(script):
            output.logits[:, -1, script[at["next"]]] += 1e4
            at["next"] += 1
        return output

    handle = model.llm.register_forward_hook(hook)
    model.streaming_generate, model.streaming_prefill = scripted_generate, recorded_prefill
    try:
        yield prefilled
    finally:
        handle.remove()
        del model.streaming_generate, model.streaming_prefill


def chat(engine, *messages: ChatMessage, **fields) -> list:
    fields.setdefault("tools", (WEATHER,))
    turn = ChatTurn(messages=messages, temperature=0, max_new_tokens=80, **fields)
    return list(engine.chat(turn))


def user(text: str) -> ChatMessage:
    return ChatMessage("user", (text,))


def calls(chunks) -> list[ToolCall]:
    return [c for chunk in chunks for c in chunk.tool_calls]


def text(chunks) -> str:
    return "".join(c.text for c in chunks)


def contents(prefilled: list[list[dict]]) -> list[tuple[str, str]]:
    return [(m["role"], "\n".join(str(p) for p in m["content"])) for ms in prefilled for m in ms]


def test_the_models_call_tokens_come_back_as_a_checked_call(engine) -> None:
    with scripted(engine, SAID_CALL) as prefilled:
        chunks = chat(engine, ChatMessage("system", ("Be brief.",)), user("Weather in Paris?"))
    (call,) = calls(chunks)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and argument_errors(WEATHER, call.arguments) == []
    assert text(chunks) == "" and chunks[0].prefilled and chunks[-1].done
    assert chunks[-1].ignored == ()
    # The system turn carries the template's tools block after the client's prompt.
    (system, question) = contents(prefilled)
    assert system[0] == "system" and system[1].startswith("Be brief.\n")
    assert "<tools>" in system[1] and '"name": "get_weather"' in system[1]
    assert question == ("user", "Weather in Paris?")


def test_words_before_a_call_stream_and_a_call_of_another_function_is_left_out(engine) -> None:
    script = 'Let me see. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    with scripted(engine, script):
        chunks = chat(engine, user("Weather in Paris?"))
    assert calls(chunks) == [] and text(chunks) == "Let me see. "
    assert chunks[-1].ignored == ("a call of 'get_time', not a function offered",)


def test_arguments_that_do_not_fit_are_never_passed_on(engine) -> None:
    script = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
    with scripted(engine, script):
        chunks = chat(engine, user("Weather in Paris?"))
    assert calls(chunks) == [] and text(chunks) == functions.CANNOT
    assert chunks[-1].ignored == ("tool get_weather: arguments.city is required",)


def test_a_named_function_is_asked_for_and_no_call_is_reported(engine) -> None:
    with scripted(engine, "Sunny.") as prefilled:
        chunks = chat(engine, user("Weather?"), tool_choice=ToolChoice(FUNCTION, "get_weather"))
    assert calls(chunks) == [] and text(chunks) == "Sunny."
    assert contents(prefilled)[0][1].endswith("\nCall the function get_weather.")
    assert chunks[-1].ignored == ("tool_choice function: the model called no function",)


def test_outputs_go_back_as_the_template_writes_them(engine) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    with scripted(engine, "It is 18 C.") as prefilled:
        chunks = chat(
            engine,
            user("Weather in Paris?"),
            ChatMessage("assistant", (), (call,)),
            ChatMessage("tool", ("18 C",), (), "call_1"),
        )
    assert calls(chunks) == [] and text(chunks) == "It is 18 C."
    assert contents(prefilled)[1:] == [
        ("user", "Weather in Paris?"),
        ("assistant", CALL),
        ("user", "<tool_response>\n18 C\n</tool_response>"),
    ]


@pytest.mark.parametrize("tools", [(), (WEATHER,)])
def test_without_functions_or_with_none_nothing_is_offered(engine, tools) -> None:
    with scripted(engine, "Hello.") as prefilled:
        chunks = chat(engine, user("Hi."), tools=tools, tool_choice=ToolChoice(NONE))
    assert text(chunks) == "Hello." and calls(chunks) == []
    assert contents(prefilled) == [("user", "Hi.")]
