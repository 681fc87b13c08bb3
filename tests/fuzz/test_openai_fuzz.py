"""Fuzzing the OpenAI Realtime dialect as the connection drives it: near-valid client
events (one value anywhere in a valid event replaced by an odd one: wrong types, NaN,
huge numbers, nesting 64 to 100,000 deep), a few in a row on one session, and then what
the edge does with the result: every message it would send written as JSON, every
session start, unit, tool output and chat turn built as the worker's protobuf, and each
started response run to its end.

Only client errors may come out of `decode` (an `error` event, the session goes on), and
they too must be writable: anything else raised is a connection closed with 1011 or a
response lost. Found this way: a tool schema 1,000 deep, and response metadata likewise
(common.nesting).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnifabric.edge import codec, worker_client
from omnifabric.edge import events as ev
from omnifabric.edge.chat import ChatResult, TurnDelta, TurnDone, TurnStarted
from omnifabric.edge.dialects.openai import OpenAIRealtime
from omnifabric.edge.errors import ClientError, EdgeError
from tests.e2e.openai_helpers import WEATHER_TOOL
from tests.fuzz.test_protocol_fuzz import FUZZ, ODD_VALUES, WILD, Raw, _small_jpeg, encode

PCM = base64.b64encode((np.sin(np.arange(2400) / 7) * 9000).astype("<i2").tobytes()).decode()
JPEG = base64.b64encode(_small_jpeg()).decode()
USER = {
    "type": "message",
    "id": "item_1",
    "role": "user",
    "content": [{"type": "input_text", "text": "hi"}],
}
FORMAT = {"type": "audio/pcm", "rate": 24000}
#: One valid event of each kind the dialect takes, every optional field set.
TEMPLATES: list[dict[str, Any]] = [
    {
        "type": "session.update",
        "event_id": "evt_1",
        "session": {
            "type": "realtime",
            "model": "m",
            "instructions": "Be brief.",
            "output_modalities": ["audio"],
            "max_output_tokens": 100,
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "tracing": "auto",
            "include": ["item.input_audio_transcription.logprobs"],
            "truncation": "auto",
            "audio": {
                "input": {
                    "format": FORMAT,
                    "turn_detection": {"type": "server_vad", "prefix_padding_ms": 300},
                    "transcription": {"model": "whisper-1"},
                    "noise_reduction": {"type": "near_field"},
                },
                "output": {"format": FORMAT, "voice": "alloy", "speed": 1.0},
            },
        },
    },
    {"type": "input_audio_buffer.append", "audio": PCM},
    {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {
        "type": "conversation.item.create",
        "previous_item_id": None,
        "item": {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hi"},
                {"type": "input_audio", "audio": PCM, "transcript": "hi"},
                {"type": "input_image", "image_url": "data:image/jpeg;base64," + JPEG},
            ],
        },
    },
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_audio", "transcript": "hello"}],
        },
    },
    {
        "type": "conversation.item.create",
        "item": {
            "type": "function_call",
            "name": "get_weather",
            "call_id": "call_2",
            "arguments": '{"city": "Oslo"}',
        },
    },
    {
        "type": "conversation.item.create",
        "item": {"type": "function_call_output", "call_id": "call_1", "output": "9C"},
    },
    {"type": "conversation.item.retrieve", "item_id": "item_1"},
    {
        "type": "conversation.item.truncate",
        "item_id": "item_1",
        "content_index": 0,
        "audio_end_ms": 9,
    },
    {"type": "conversation.item.delete", "item_id": "item_1"},
    {
        "type": "response.create",
        "response": {
            "output_modalities": ["text"],
            "instructions": "Answer.",
            "metadata": {"topic": "weather"},
            "max_output_tokens": 5,
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "conversation": "auto",
            "input": [USER],
            "audio": {"output": {"voice": "alloy", "format": FORMAT}},
        },
    },
    {"type": "response.cancel"},
]


def places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in `value` a replacement can go (the root's keys and below)."""
    found = [path] if path else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += places(inner, (*path, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            found += places(inner, (*path, i))
    return found


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """A copy of `value` with `new` at `path` (its last key may be a new one)."""
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]] if len(path) > 1 else None, path[1:], new)
    return copy


def _at(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


#: Nested values, half the draws: past orjson's writer (254), Python's stack and orjson's
#: reader (1,024); lists, dicts and both.
DEEP = [
    Raw(opening * n + end + closing * n)
    for n in (300, 1000, 100_000)
    for opening, end, closing in (("[", "1", "]"), ('{"a":', "{}", "}"), ('[{"a":', "0", "}]"))
]
#: What replaces a value.
ODD = st.one_of(WILD, st.sampled_from(DEEP))
#: Keys added beside the template's own.
EXTRA_KEYS = ["type", "x", "metadata", "tools", "audio", "item", "session"]


@st.composite
def events(draw) -> str:
    """One template, mostly with one value replaced, or a key added, by an odd one."""
    template = draw(st.sampled_from(TEMPLATES))
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return encode(template)
    if choice == 1:
        objects = [p for p in [(), *places(template)] if isinstance(_at(template, p), dict)]
        path = (*draw(st.sampled_from(objects)), draw(st.sampled_from(EXTRA_KEYS)))
    else:
        path = draw(st.sampled_from(places(template)))
    return encode(replaced(template, path, draw(ODD)))


def built(d: OpenAIRealtime, commands: list[ev.Command]) -> int:
    """What the edge does with each command short of the network; the turns started."""
    lease = worker_client.Lease("lease_1", "w", "127.0.0.1:1")
    turns = 0
    for cmd in commands:
        if isinstance(cmd, ev.SendCommand):
            for message in cmd.messages:
                json.loads(codec.dumps(message))
        elif isinstance(cmd, ev.InitCommand):
            worker_client.start_request(lease, "s", "audio", cmd).SerializeToString()
        elif isinstance(cmd, ev.ToolOutputCommand):
            worker_client.tool_output_request(cmd).SerializeToString()
        elif isinstance(cmd, ev.TurnCommand):
            assert cmd.chat is not None
            worker_client.chat_request(cmd.chat, "lease_1", "s").SerializeToString()
            turns += 1
        elif isinstance(cmd, ev.AudioCommand):
            assert np.isfinite(cmd.samples).all()
    return turns


def run_turn(d: OpenAIRealtime) -> None:
    """A started response, run to its end as the worker's turn events drive it."""
    said = [*d.encode_turn(TurnStarted(True, False)), *d.encode_turn(TurnDelta("Hi", b""))]
    said += d.encode_turn(TurnDone(ChatResult(text="Hi", reason="turn_end")))
    for message in said:
        json.loads(codec.dumps(message))


def opened() -> OpenAIRealtime:
    """A session where each template is valid: manual turns, the weather function, and a
    conversation of a user item, a call (call_1) and its output."""
    d = OpenAIRealtime("m")
    session = {"audio": {"input": {"turn_detection": None}}, "tools": [WEATHER_TOOL]}
    call = {"type": "function_call", "name": "get_weather", "call_id": "call_1", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "9C"}
    for event in (
        {"type": "session.update", "session": session},
        *({"type": "conversation.item.create", "item": item} for item in (USER, call, output)),
    ):
        d.decode(json.dumps(event))
    return d


def feed(d: OpenAIRealtime, frames: list[str]) -> None:
    """The frames in order, as the connection handles them; anything but a client error
    raised fails the test."""
    for text in frames:
        try:
            commands = d.decode(text)
        except EdgeError as err:
            assert isinstance(err, ClientError), (type(err), err)
            json.loads(codec.dumps(d.error(err)))
            continue
        if built(d, commands):
            run_turn(d)


@pytest.mark.ci_long  # 2000 sequences of events: ~11 s (tests/conftest.py)
@FUZZ
@given(st.lists(events(), min_size=1, max_size=4))
def test_only_client_errors_escape_and_everything_said_is_writable(frames):
    feed(opened(), frames)


def test_every_place_of_every_event_takes_odd_values():
    """Each nested value of DEEP and each odd value of the protocol fuzz at each place of
    each template (and as a new key beside each object's own), every one (the random
    draws reach a given place rarely)."""
    cases = 0
    for template in TEMPLATES:
        objects = [p for p in [(), *places(template)] if isinstance(_at(template, p), dict)]
        for path in [*places(template), *((*p, "x") for p in objects)]:
            for value in [*DEEP, *ODD_VALUES]:
                feed(opened(), [encode(replaced(template, path, value))])
                cases += 1
    assert cases > 8000
