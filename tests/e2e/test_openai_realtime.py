"""The OpenAI Realtime API on the edge, driven by the real `openai` SDK, unchanged: a real
scheduler, synthetic worker and keyed edge on 127.0.0.1 (the reference engine's spoken
question is in test_reference.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect

from omnifabric.edge import g711
from tests.conftest import scaled
from tests.e2e.openai_helpers import WEATHER_TOOL, until
from tests.e2e.test_default_voice import http_url
from tests.edge.test_voices import request
from tests.stack import keyed_stack

openai = pytest.importorskip("openai")

KEY = "sk-openai-user"
RATE = 24000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    s = keyed_stack(logs, f"{KEY}\n", "--record-dir", str(logs / "records"))
    yield s
    s.stop()


def base_url(stack) -> str:
    return http_url(stack.url, "/v1")


def client(stack, key: str = KEY):
    return openai.AsyncOpenAI(base_url=base_url(stack), api_key=key, max_retries=0)


def pcm16(seconds: float, amplitude: float) -> str:
    t = np.arange(int(seconds * RATE)) / RATE
    x = amplitude * np.sin(2 * np.pi * 220 * t)
    return base64.b64encode((x * 32767).astype("<i2").tobytes()).decode()


async def speak(conn, seconds: float = 2.0) -> None:
    """A loud tone, as a client streams its microphone (0.2 s appends); then nothing: the
    edge's clock hears the silence."""
    for _ in range(int(seconds / 0.2)):
        await conn.input_audio_buffer.append(audio=pcm16(0.2, 0.3))


async def test_a_spoken_turn_with_server_vad_is_answered_in_audio(stack):
    seen: list = []
    async with client(stack).realtime.connect(model="minicpm-o-4.5") as conn:
        created = await until(conn, "session.created")
        assert created.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        await until(conn, "session.updated")
        await speak(conn)
        done = await until(conn, "response.done", seen=seen)
    kinds = [e.type for e in seen]
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    firsts = [kinds.index(k) for k in order]  # ValueError: one is missing
    assert firsts == sorted(firsts), kinds
    assert done.response.status == "completed"
    assert done.response.usage.output_tokens > 0
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type.endswith("audio.delta"))
    assert len(audio) >= RATE * 2  # over a second of PCM16 at 24 kHz
    transcript = "".join(e.delta for e in seen if e.type.endswith("transcript.delta"))
    assert transcript and done.response.output[0].content[0].transcript == transcript
    # Recorded like the other dialects' sessions, and listed by the sessions API.
    sid = created.session.id
    for _ in range(50):
        status, meta = request(http_url(stack.url, f"/api/sessions/{sid}"), "GET", key=KEY)
        if status == 200 and meta.get("ended_at"):
            break
        await asyncio.sleep(scaled(0.1))
    assert status == 200 and meta["system_prompt"] == "Be brief.", meta
    assert len(meta["timeline"]) >= 5


async def test_a_text_turn_gets_a_text_reply(stack):
    seen: list = []
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hello"}],
            }
        )
        added = await until(conn, "conversation.item.added")
        assert added.item.content[0].text == "Say hello"
        await conn.response.create(response={"output_modalities": ["text"]})
        done = await until(conn, "response.done", seen=seen)
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert "Say hello" in text  # the synthetic engine echoes the turn
    assert done.response.status == "completed"
    assert done.response.output[0].content[0].text == text
    assert not [e for e in seen if e.type.startswith("response.output_audio")]


async def test_manual_turns_commit_then_answer_and_the_conversation_goes_on(stack):
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await until(conn, "session.updated")
        for turn in (1, 2):
            seen: list = []
            await speak(conn, 1.0)
            await conn.input_audio_buffer.commit()
            committed = await until(conn, "input_audio_buffer.committed")
            await conn.response.create()
            done = await until(conn, "response.done", seen=seen)
            assert done.response.status == "completed", turn
            assert "[audio 1.0 s]" in done.response.output[0].content[0].transcript
            assert any(e.type == "response.output_audio.delta" for e in seen)
        await conn.conversation.item.retrieve(item_id=committed.item_id)
        retrieved = await until(conn, "conversation.item.retrieved")
        assert retrieved.item.id == committed.item_id


async def test_cancel_mid_reply_then_barge_in(stack):
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await speak(conn)
        await until(conn, "response.output_audio.delta")
        await conn.response.cancel()
        done = await until(conn, "response.done")
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "client_cancelled"
        # The next turn, and speech over its reply: the engine yields, the reply is cut.
        await speak(conn)
        await until(conn, "response.output_audio.delta", timeout_s=60)
        await speak(conn, 1.0)
        done = await until(conn, "response.done", timeout_s=60)
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "turn_detected"


@pytest.mark.ci_long  # speech in both G.711 codecs: ~5 s (tests/conftest.py)
async def test_g711_in_and_out(stack):
    tone = (0.3 * np.sin(2 * np.pi * 300 * np.arange(1600) / 8000) * 32767).astype(np.int16)
    seen: list = []
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcmu"}},
                    "output": {"format": {"type": "audio/pcma"}},
                },
            }
        )
        updated = await until(conn, "session.updated")
        assert updated.session.audio.output.format.type == "audio/pcma"
        for _ in range(10):  # 2 s of mu-law at 8 kHz, 0.2 s an event
            chunk = base64.b64encode(g711.mulaw_encode(tone)).decode()
            await conn.input_audio_buffer.append(audio=chunk)
        await until(conn, "response.done", seen=seen)
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type.endswith("audio.delta"))
    assert len(audio) >= 8000  # a byte a sample at 8 kHz
    assert np.abs(g711.alaw_decode(audio)).max() > 1000  # the reply's tone, decoded


async def test_a_bad_event_gets_an_error_and_the_next_turn_works(stack):
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await conn.send({"type": "session.teleport", "event_id": "evt_bad"})
        error = await until(conn, "error")
        assert error.error.type == "invalid_request_error"
        assert error.error.event_id == "evt_bad"
        await conn.session.update(
            session={"type": "realtime", "audio": {"output": {"voice": "alloy", "speed": 1.4}}}
        )
        # Accepted, and the settings in effect reported: no error (frameworks end sessions
        # on errors) and no event outside the API's schema (typed clients call it one).
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.output.voice == "default"
        assert updated.session.audio.output.speed == 1.0
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "x"}],
            }
        )
        await conn.response.create(response={"output_modalities": ["text"]})
        done = await until(conn, "response.done")
        assert done.response.status == "completed"


async def test_keys_as_header_and_as_a_browser_subprotocol(stack):
    with pytest.raises(Exception) as refused:
        async with client(stack, key="sk-wrong").realtime.connect(model="m") as conn:
            await conn.recv()
    assert "401" in str(refused.value)
    url = stack.url + "?model=m"
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with connect(url, subprotocols=protocols) as ws:
        assert ws.subprotocol == "realtime"
        created = json.loads(await asyncio.wait_for(ws.recv(), scaled(10)))
        assert created["type"] == "session.created"


async def _turn_with_tools(conn, text: str, **session) -> list:
    """A typed question with the weather tool offered; the response's events."""
    await conn.session.update(
        session={
            "type": "realtime",
            "tools": [WEATHER_TOOL],
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            **session,
        }
    )
    await until(conn, "session.updated")
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await conn.response.create()
    seen: list = []
    await until(conn, "response.done", seen=seen)
    return seen


async def test_a_function_is_called_and_its_output_answered(stack):
    """Issue 53: the model's call streams as the API streams it (the synthetic engine calls
    a tool whose name the question mentions), the client's output goes back, the next
    response answers with it."""
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        seen = await _turn_with_tools(conn, "What's the weather in Paris?")
        (done_args,) = [e for e in seen if e.type == "response.function_call_arguments.done"]
        assert done_args.name == "get_weather"
        assert json.loads(done_args.arguments) == {"city": "Paris"}
        done = seen[-1].response
        assert done.status == "completed" and done.output[0].type == "function_call"
        await conn.conversation.item.create(
            item={
                "type": "function_call_output",
                "call_id": done_args.call_id,
                "output": '{"sky": "cloudy", "celsius": 14}',
            }
        )
        await until(conn, "conversation.item.done")
        await conn.response.create()
        seen = []
        await until(conn, "response.done", seen=seen)
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert "cloudy" in text


async def test_tool_choice_none_gets_no_call_and_a_bad_output_is_an_error(stack):
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        seen = await _turn_with_tools(conn, "What's the weather in Paris?", tool_choice="none")
        assert not [e for e in seen if e.type.startswith("response.function_call")]
        assert seen[-1].response.output[0].type == "message"
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": "call_unknown", "output": "{}"}
        )
        error = await until(conn, "error")
        assert error.error.param == "item.call_id"
        await conn.conversation.item.create(  # the session goes on
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Thanks"}],
            }
        )
        await conn.response.create()
        assert (await until(conn, "response.done")).response.status == "completed"


@pytest.mark.ci_long  # a duplex session's call and its answer: ~7 s (tests/conftest.py)
async def test_a_duplex_sessions_call_is_answered_after_its_output(stack):
    """Server VAD: the engine's turn ends in a call (the synthetic engine calls the first
    function after each user turn); the client runs it, sends the output and the usual
    response.create (taken as said), and the engine's next reply says the result."""
    async with client(stack).realtime.connect(model="m") as conn:
        await until(conn, "session.created")
        await conn.session.update(
            session={"type": "realtime", "tools": [WEATHER_TOOL], "output_modalities": ["text"]}
        )
        await until(conn, "session.updated")
        await speak(conn)
        seen: list = []
        await until(conn, "response.done", seen=seen)
        (call,) = [e for e in seen if e.type == "response.function_call_arguments.done"]
        assert call.name == "get_weather"
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"}
        )
        await conn.response.create()
        seen = []
        done = await until(conn, "response.done", "error", seen=seen)
        assert done.type == "response.done", done
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert "The result: cloudy" in text
