"""The OpenAI Realtime dialect without I/O: its events, its turns, and its audio through the
paced cadence (edge.cadence), driven by plain calls as the connection driver makes them."""

from __future__ import annotations

import base64
import json
import time
import warnings

import numpy as np
import pytest

from omnifabric.common import nesting, tool_wire, tools
from omnifabric.edge import events as ev
from omnifabric.edge import g711
from omnifabric.edge.cadence import FILL_GRACE_S, PacedCadence, for_traits
from omnifabric.edge.chat import ChatResult, TurnDelta, TurnDone, TurnStarted
from omnifabric.edge.chat_input import AudioPart
from omnifabric.edge.dialects import WEBSOCKET, find
from omnifabric.edge.dialects.base import SessionFacts
from omnifabric.edge.dialects.openai import OpenAIRealtime, decode_audio, encode_audio
from omnifabric.edge.dialects.realtime import RealtimeDuplex
from omnifabric.edge.errors import EdgeError, InvalidEvent, UnknownEvent
from tests.e2e.openai_helpers import WEATHER_TOOL


def pcm16(seconds: float, amplitude: float = 0.0, rate: int = 24000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    x = amplitude * np.sin(2 * np.pi * 220 * t)
    return base64.b64encode((x * 32767).astype("<i2").tobytes()).decode()


APPEND_NOTHING = json.dumps({"type": "input_audio_buffer.append", "audio": ""})


def send(d: OpenAIRealtime, **event) -> list:
    return d.decode(json.dumps(event))


def sent_messages(commands: list) -> list[dict]:
    return [m for c in commands if isinstance(c, ev.SendCommand) for m in c.messages]


class Driven:
    """The dialect and the cadence its traits name, as edge.connection drives them: audio
    commands go to the cadence, the units it makes due come back."""

    def __init__(self, d: OpenAIRealtime) -> None:
        self.d = d
        cadence = for_traits(d.traits.cadence)
        assert isinstance(cadence, PacedCadence)
        self.cadence = cadence

    def send(self, **event) -> list:
        return self.run(send(self.d, **event))

    def run(self, commands: list) -> list:
        """The commands, with the audio ones replaced by the units they make due."""
        out: list = []
        for cmd in commands:
            if isinstance(cmd, ev.AudioCommand):
                self.cadence.push(cmd.samples, cmd.rate)
                out += self.cadence.due(time.monotonic(), clock=False)
            elif isinstance(cmd, ev.EndTurnCommand):
                out += self.cadence.end_turn() + self.cadence.due(time.monotonic(), clock=False)
            else:
                out.append(cmd)
        return out

    def tick(self, now: float) -> list:
        return self.cadence.due(now, clock=True)

    def appended(self, seq: int, unit: ev.AppendCommand) -> None:
        self.cadence.sent(seq, time.monotonic())
        self.d.appended(seq, unit)

    def after_output(self, out: ev.Output) -> list:
        """The dialect's commands after an output, then the units the answer lets go."""
        units = self.run(self.d.after_output(out))
        self.cadence.answered(out)
        return units + self.cadence.due(time.monotonic(), clock=False)


def running(d: OpenAIRealtime) -> Driven:
    """The duplex session started (as the driver reports it)."""
    driven = Driven(d)
    driven.run(d.decode(APPEND_NOTHING))
    d.bind(SessionFacts("rt_1"))
    driven.cadence.start((1600, 16000 * 30), time.monotonic())
    assert d.encode(ev.Created("rt_1", 10)) == []
    return driven


def output(
    seq: int, *, listen: bool, text: str = "", end: bool = False, usage=None, **kw
) -> ev.Output:
    pcm = b"" if listen else np.full(24000, 0.1, "<f4").tobytes()
    return ev.Output(seq, listen, text, pcm, end, 0, {}, usage or ev.Usage(), **kw)


def test_the_route_tells_the_openai_client_from_minicpm_o_clients():
    route, _ = find(WEBSOCKET, "/v1/realtime")
    assert isinstance(route.open("", {"model": ["gpt-realtime"]}, "audio"), OpenAIRealtime)
    # The official MiniCPM-o SDK names its mode (and may name a model too).
    both = route.open("", {"mode": ["audio"], "model": ["x"]}, "audio")
    assert isinstance(both, RealtimeDuplex)
    assert isinstance(route.open("", {}, "audio"), RealtimeDuplex)


def test_session_created_on_connect_and_updated_with_what_was_set():
    d = OpenAIRealtime("m")
    d.bind(SessionFacts("rt_1"))
    (created,) = d.opening()
    assert created["type"] == "session.created" and created["event_id"]
    assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    update = {
        "type": "realtime",
        "instructions": "Be brief.",
        "output_modalities": ["text"],
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}},
        },
    }
    (updated,) = sent_messages(send(d, type="session.update", session=update))
    session = updated["session"]
    assert updated["type"] == "session.updated"
    assert session["instructions"] == "Be brief." and session["output_modalities"] == ["text"]
    assert session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert session["audio"]["input"]["turn_detection"] is None


def test_what_the_engine_cannot_honour_is_accepted_and_the_effective_settings_reported():
    """Issue 53 (4): no event outside the API's schema (typed clients report one as an
    error) and no error (frameworks end the session on one): session.updated alone, with
    the settings in effect."""
    d = OpenAIRealtime("m")
    session = {
        "tracing": "auto",
        "audio": {
            "input": {"transcription": {"model": "whisper-1"}, "noise_reduction": {}},
            "output": {"voice": "alloy", "speed": 1.5},
        },
    }
    (updated,) = sent_messages(send(d, type="session.update", session=session, event_id="c1"))
    assert updated["type"] == "session.updated"
    audio = updated["session"]["audio"]
    assert audio["output"]["voice"] == "default" and audio["output"]["speed"] == 1.0
    assert audio["input"]["transcription"] is None and audio["input"]["noise_reduction"] is None


def test_settings_a_running_duplex_session_cannot_take_keep_their_running_value():
    d = running(OpenAIRealtime("m")).d
    update = {"instructions": "Be a pirate.", "output_modalities": ["text"]}
    (updated,) = sent_messages(send(d, type="session.update", session=update))
    assert updated["session"]["instructions"] == ""
    assert updated["session"]["output_modalities"] == ["audio"]


@pytest.mark.parametrize(
    "session, param",
    [
        ({"bogus": 1}, "session.bogus"),
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        ({"audio": {"input": {"turn_detection": {"type": "magic"}}}}, None),
        # Issue 53 (5): an out-of-range number names its parameter.
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 5.0}}}},
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {
                "audio": {
                    "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 9}}
                }
            },
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "session.audio.input.format.rate",
        ),
        # A list or an object as the type raised TypeError (unhashable) and closed the
        # connection with 1011 (the fuzzer's find); a string as the format had no param.
        ({"audio": {"input": {"format": {"type": []}}}}, "session.audio.input.format.type"),
        ({"audio": {"output": {"format": {"type": {}}}}}, "session.audio.output.format.type"),
        ({"audio": {"input": {"format": "pcm16"}}}, "session.audio.input.format"),
        # Echoed in session.updated: a key the API has not, or a value of another type
        # (1,000 levels deep, the writer failed and the connection closed with 1011).
        *(
            (
                {"audio": {"input": {"turn_detection": {"type": "server_vad", key: value}}}},
                f"session.audio.input.turn_detection.{key}",
            )
            for key, value in (
                ("x", 1),
                ("prefix_padding_ms", "300"),
                ("idle_timeout_ms", -1),
                ("create_response", 1),
                ("interrupt_response", [False]),
                ("eagerness", "sometimes"),
            )
        ),
        ({"tool_choice": {"type": "function", "name": [1]}}, "session.tool_choice.name"),
    ],
)
def test_a_bad_update_is_refused_whole_with_openais_error_shape(session, param):
    d = OpenAIRealtime("m")
    with pytest.raises(EdgeError) as caught:
        send(d, type="session.update", session=session, event_id="e9")
    error = d.error(caught.value)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["event_id"] == "e9" and error["error"]["message"]
    if param:
        assert error["error"]["param"] == param
    assert d.settings.output_modalities == ("audio",)  # nothing applied


def test_a_response_asking_an_unhashable_format_is_an_error_naming_it():
    d = OpenAIRealtime("m")
    send(d, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    response = {"audio": {"output": {"format": {"type": ["audio/pcm"]}}}}
    with pytest.raises(EdgeError) as caught:
        send(d, type="response.create", response=response)
    assert d.error(caught.value)["error"]["param"] == "response.audio.output.format.type"


def test_malformed_and_unknown_events_get_an_error_and_the_session_goes_on():
    d = OpenAIRealtime("m")
    with pytest.raises(InvalidEvent):
        d.decode("{not json")
    with pytest.raises(InvalidEvent):
        d.decode(b"\x00\x01")
    with pytest.raises(UnknownEvent):
        send(d, type="session.fly")
    for bad in ({"type": "input_audio_buffer.append", "audio": "@@"}, {"type": "response.cancel"}):
        with pytest.raises(EdgeError) as caught:
            d.decode(json.dumps(bad))
        assert caught.value.close_code is None
    assert sent_messages(send(d, type="session.update", session={}))[0]["type"] == "session.updated"


def test_the_first_audio_starts_the_duplex_session_and_units_go_one_at_a_time():
    d = Driven(OpenAIRealtime("m"))
    commands = d.send(type="input_audio_buffer.append", audio=pcm16(3.0, 0.3))
    assert [type(c) for c in commands] == [ev.InitCommand]  # queued: no unit yet
    assert d.send(type="input_audio_buffer.append", audio=pcm16(0.1)) == []
    d.cadence.start((1600, 16000 * 30), time.monotonic())
    (unit,) = d.tick(100.0)
    assert isinstance(unit, ev.AppendCommand) and len(unit.pcm) == 16000 * 4
    d.appended(1, unit)
    assert d.tick(100.1) == []  # one unit in flight at a time
    (nxt,) = d.after_output(output(1, listen=True))
    d.appended(2, nxt)
    (third,) = d.after_output(output(2, listen=True))
    d.appended(3, third)
    # 0.1 s left: not a unit until the clock says a second passed without one
    assert d.after_output(output(3, listen=True)) == []


def test_the_clock_fills_a_silent_second_so_a_reply_never_waits_for_input():
    d = running(OpenAIRealtime("m"))
    assert d.tick(time.monotonic()) == []  # the clock starts with the session
    now = time.monotonic() + 1.0 + FILL_GRACE_S
    (unit,) = d.tick(now)  # nothing came in a second: silence
    assert not np.frombuffer(unit.pcm, "<f4").any()
    d.appended(1, unit)
    d.after_output(output(1, listen=True))
    assert d.tick(now + 0.5) == []
    (later,) = d.tick(now + 1.0 + FILL_GRACE_S)
    assert len(later.pcm) == 16000 * 4


def test_engine_turn_taking_becomes_vad_events_and_a_response():
    d = running(OpenAIRealtime("m")).d
    speech = ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes())
    silence = ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes())
    d.appended(1, speech)
    started = d.encode(output(1, listen=True))
    assert [m["type"] for m in started] == ["input_audio_buffer.speech_started"]
    d.appended(2, silence)
    assert d.encode(output(2, listen=True)) == []
    d.appended(3, silence)
    reply = d.encode(output(3, listen=False, text="Hi.", input_transcript="hello"))
    kinds = [m["type"] for m in reply]
    assert kinds[:4] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert "conversation.item.input_audio_transcription.completed" in kinds
    assert kinds[kinds.index("response.created") :] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
    ]
    delta = next(m for m in reply if m["type"] == "response.output_audio.delta")
    assert len(base64.b64decode(delta["delta"])) == 24000 * 2  # PCM16 at 24 kHz
    d.appended(4, silence)
    end = d.encode(output(4, listen=False, text=" Bye.", end=True))
    done = end[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Hi. Bye."


def test_speech_events_time_units_by_their_length():
    # The cadence cuts a unit where speech stops: the events' times are the units' own.
    d = running(OpenAIRealtime("m")).d
    d.appended(1, ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes()))
    d.encode(output(1, listen=True))
    d.appended(2, ev.AppendCommand(pcm=np.full(11200, 0.3, "<f4").tobytes()))  # 0.7 s
    (started,) = d.encode(output(2, listen=True))
    assert started["audio_start_ms"] == 1000
    d.appended(3, ev.AppendCommand(pcm=np.zeros(3200, "<f4").tobytes()))
    reply = d.encode(output(3, listen=False, text="Hi.", input_transcript="hello"))
    stopped = next(m for m in reply if m["type"] == "input_audio_buffer.speech_stopped")
    assert stopped["audio_end_ms"] == 1700  # the end of the speech unit, not 2000


def test_speech_over_a_reply_that_then_stops_is_a_barge_in():
    d = running(OpenAIRealtime("m")).d
    silence = ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes())
    speech = ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes())
    d.appended(1, silence)
    d.encode(output(1, listen=False, text="A long"))
    d.appended(2, speech)
    stopped = d.encode(output(2, listen=True))
    done = stopped[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"]["reason"] == "turn_detected"
    assert stopped[0]["type"] == "input_audio_buffer.speech_started"


def test_cancel_ends_the_response_now_and_the_next_unit_ends_the_engines_turn():
    d = running(OpenAIRealtime("m"))
    (first,) = d.tick(time.monotonic() + 1.0 + FILL_GRACE_S)  # a silent second, in flight
    d.appended(1, first)
    d.d.encode(output(1, listen=False, text="Hello"))
    commands = d.send(type="response.cancel")
    assert not [c for c in commands if isinstance(c, ev.AppendCommand)]
    (done,) = [m for m in sent_messages(commands) if m["type"] == "response.done"]
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    (unit,) = d.after_output(output(1, listen=False))
    assert unit.force_listen
    d.appended(2, unit)
    assert d.d.encode(output(2, listen=False, text="more")) == []  # muted until it listens
    with pytest.raises(InvalidEvent):
        d.send(type="response.cancel")


def test_manual_turns_are_chat_turns_over_the_conversation():
    d = OpenAIRealtime("m")
    d.bind(SessionFacts("rt_1"))
    send(d, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    with pytest.raises(InvalidEvent):
        send(d, type="input_audio_buffer.commit")  # empty
    assert send(d, type="input_audio_buffer.append", audio=pcm16(1.0, 0.2)) == []
    committed = sent_messages(send(d, type="input_audio_buffer.commit"))
    assert [m["type"] for m in committed] == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    text = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(d, type="conversation.item.create", item=text)
    (turn,) = send(d, type="response.create", response={"instructions": "Short."})
    assert isinstance(turn, ev.TurnCommand) and turn.chat is not None
    chat = turn.chat  # built as the chat path's own validator builds it
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.speech
    heard = chat.messages[1].parts[0]
    assert isinstance(heard, AudioPart) and len(heard.pcm) == 16000 * 4  # a second at 16 kHz
    started = d.encode_turn(TurnStarted(True, True))
    assert [m["type"] for m in started][0] == "response.created"
    pcm = np.full(12000, 0.1, "<f4").tobytes()
    deltas = d.encode_turn(TurnDelta("Hello", pcm))
    # The message item is announced with the reply's first words (a reply may be calls).
    assert [m["type"] for m in deltas] == [
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
    ]
    done = d.encode_turn(TurnDone(ChatResult(text="Hello", usage=ev.Usage(total_tokens=9))))
    assert done[-1]["response"]["status"] == "completed"
    assert done[-1]["response"]["usage"]["total_tokens"] == 9
    assert d.items[-1].role == "assistant" and d.items[-1].text() == "Hello"


def test_a_text_only_response_and_a_token_cap():
    d = OpenAIRealtime("m")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(d, type="conversation.item.create", item=item)
    (turn,) = send(
        d, type="response.create", response={"output_modalities": ["text"], "max_output_tokens": 7}
    )
    assert turn.chat.tts.enabled is False
    assert turn.chat.generation.max_new_tokens == 7
    d.encode_turn(TurnStarted(True, False))
    *_, delta = d.encode_turn(TurnDelta("Hey", b""))
    assert delta["type"] == "response.output_text.delta"
    done = d.encode_turn(TurnDone(ChatResult(text="Hey", reason="max_tokens")))
    assert done[-1]["response"]["status"] == "incomplete"
    assert done[-1]["response"]["status_details"]["reason"] == "max_output_tokens"


@pytest.mark.parametrize(
    "metadata, param",
    [
        ([["k", "v"]], "response.metadata"),
        ({f"k{i}": "v" for i in range(17)}, "response.metadata"),
        ({"k" * 65: "v"}, "response.metadata"),
        ({"k": 3}, "response.metadata.k"),
        ({"k": "v" * 513}, "response.metadata.k"),
        ({"k": {"a": {"a": {}}}}, "response.metadata.k"),
    ],
)
def test_response_metadata_is_bounded_as_the_api_bounds_it(metadata, param):
    """The map is echoed on the response's events: 16 string pairs (keys of 64 characters,
    values of 512) at most, as the API documents; anything else is refused naming it."""
    d = OpenAIRealtime("m")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(d, type="conversation.item.create", item=item)
    with pytest.raises(EdgeError) as caught:
        send(d, type="response.create", response={"metadata": metadata})
    assert d.error(caught.value)["error"]["param"] == param
    tags = {f"k{i}": "v" * 512 for i in range(16)}
    send(d, type="response.create", response={"metadata": tags})
    [created] = [e for e in d.encode_turn(TurnStarted(True, False)) if "response" in e]
    assert created["type"] == "response.created" and created["response"]["metadata"] == tags


def test_a_response_needs_a_user_item_last_and_one_at_a_time():
    d = OpenAIRealtime("m")
    with pytest.raises(InvalidEvent):
        send(d, type="response.create")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(d, type="conversation.item.create", item=item)
    send(d, type="response.create")
    with pytest.raises(InvalidEvent):
        send(d, type="response.create")


def test_g711_formats_in_and_out():
    tone = (0.3 * np.sin(2 * np.pi * 300 * np.arange(8000) / 8000) * 32767).astype(np.int16)
    for kind, enc in (("audio/pcmu", g711.mulaw_encode), ("audio/pcma", g711.alaw_encode)):
        heard = decode_audio(enc(tone), kind)
        assert heard.size == 8000 and np.abs(heard - tone / 32768).max() < 0.02
        speech = np.full(24000, 0.25, "<f4").tobytes()
        out = encode_audio(speech, kind)
        assert len(out) == 8000  # a second at 8 kHz, a byte a sample


def test_g711_matches_the_standard_library_codec_bit_for_bit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    x = np.arange(-32768, 32768, dtype=np.int16)
    assert g711.mulaw_encode(x) == audioop.lin2ulaw(x.tobytes(), 2)
    assert g711.alaw_encode(x) == audioop.lin2alaw(x.tobytes(), 2)
    codes = bytes(range(256))
    assert g711.mulaw_decode(codes).tobytes() == audioop.ulaw2lin(codes, 2)
    assert g711.alaw_decode(codes).tobytes() == audioop.alaw2lin(codes, 2)


def test_truncate_cuts_the_heard_transcript_and_items_are_retrieved_and_deleted():
    d = OpenAIRealtime("m")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(d, type="conversation.item.create", item=item)
    send(d, type="response.create")
    d.encode_turn(TurnStarted(True, True))
    d.encode_turn(TurnDelta("Hello there", np.zeros(24000, "<f4").tobytes()))
    d.encode_turn(TurnDone(ChatResult(text="Hello there")))
    answer = d.items[-1]
    # A content_index that names no part of the item was echoed as it came (the fuzzer's).
    for bad in ({"not": "an int"}, 1, -1, True):
        with pytest.raises(EdgeError) as caught:
            send(
                d,
                type="conversation.item.truncate",
                item_id=answer.id,
                content_index=bad,
                audio_end_ms=500,
            )
        assert d.error(caught.value)["error"]["param"] == "content_index"
    (cut,) = sent_messages(
        send(d, type="conversation.item.truncate", item_id=answer.id, audio_end_ms=500)
    )
    assert cut["type"] == "conversation.item.truncated" and cut["audio_end_ms"] == 500
    assert cut["content_index"] == 0
    (got,) = sent_messages(send(d, type="conversation.item.retrieve", item_id=answer.id))
    assert got["item"]["content"] == [{"type": "output_audio", "transcript": "Hello"}]
    (gone,) = sent_messages(send(d, type="conversation.item.delete", item_id=answer.id))
    assert gone["item_id"] == answer.id and answer not in d.items
    with pytest.raises(EdgeError):
        send(d, type="conversation.item.retrieve", item_id=answer.id)


def _speaking(d: Driven) -> dict:
    """A duplex reply in progress; its conversation.item.added."""
    silence = ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes())
    d.appended(1, silence)
    reply = d.d.encode(output(1, listen=False, text="A long answer"))
    return next(m for m in reply if m["type"] == "conversation.item.added")


def test_the_reply_being_spoken_can_be_truncated():
    """Issue 53 (1): the assistant item is in the conversation from its announcement, so a
    barge-in's truncate of it is served (it was refused: no item in the conversation)."""
    d = running(OpenAIRealtime("m"))
    added = _speaking(d)
    item_id = added["item"]["id"]
    (cut,) = sent_messages(
        d.send(type="conversation.item.truncate", item_id=item_id, audio_end_ms=500)
    )
    assert cut["type"] == "conversation.item.truncated" and cut["item_id"] == item_id
    assert d.d.items[-1].id == item_id


def test_speech_over_a_reply_ends_it_at_once_and_no_more_of_it_is_sent():
    """Issue 53 (2): after speech_started no delta of the interrupted reply goes out; the
    reply is done (cancelled, turn_detected) there, and the engine's turn is ended."""
    d = running(OpenAIRealtime("m"))
    _speaking(d)
    speech = ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes())
    d.appended(2, speech)
    events = d.d.encode(output(2, listen=False, text=" goes on"))
    kinds = [m["type"] for m in events]
    assert kinds[0] == "input_audio_buffer.speech_started"
    assert "response.output_audio.delta" not in kinds
    done = events[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    (unit,) = d.after_output(output(2, listen=False))
    assert unit.force_listen  # the engine's turn ends with the next unit
    assert d.d.encode(output(3, listen=False, text="more")) == []  # the rest is not sent


def test_interrupt_response_off_lets_the_engine_decide():
    d = Driven(OpenAIRealtime("m"))
    turn = {"type": "server_vad", "interrupt_response": False}
    send(d.d, type="session.update", session={"audio": {"input": {"turn_detection": turn}}})
    d = running(d.d)
    _speaking(d)
    d.appended(2, ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes()))
    kinds = [m["type"] for m in d.d.encode(output(2, listen=False, text=" goes on"))]
    assert "response.output_audio.delta" in kinds and "response.done" not in kinds
    assert d.after_output(output(2, listen=False)) == []


def test_the_users_transcript_carries_its_usage():
    """Issue 53 (3): input_audio_transcription.completed has `usage` (the schema requires
    it; typed clients dropped the event without it)."""
    d = running(OpenAIRealtime("m"))
    d.appended(1, ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes()))
    d.d.encode(output(1, listen=True))
    d.appended(2, ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes()))
    reply = d.d.encode(output(2, listen=False, text="Hi.", input_transcript="hello"))
    (done,) = [m for m in reply if m["type"].endswith("transcription.completed")]
    assert done["usage"] == {"type": "duration", "seconds": 1.0}


def test_max_output_tokens_caps_a_duplex_reply():
    """Issue 53 (6): the session's max_output_tokens reaches the duplex reply: at the cap it
    is done (incomplete, max_output_tokens) and the engine's turn ends."""
    d = Driven(OpenAIRealtime("m"))
    send(d.d, type="session.update", session={"max_output_tokens": 5})
    d = running(d.d)
    d.appended(1, ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes()))
    first = d.d.encode(output(1, listen=False, text="One two", usage=ev.Usage(output_tokens=3)))
    assert "response.done" not in [m["type"] for m in first]
    d.appended(2, ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes()))
    second = d.d.encode(output(2, listen=False, text=" three", usage=ev.Usage(output_tokens=6)))
    done = second[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "max_output_tokens"
    assert done["max_output_tokens"] == 5
    (unit,) = d.after_output(output(2, listen=False))
    assert unit.force_listen


def _with_tools(**session) -> OpenAIRealtime:
    d = OpenAIRealtime("m")
    d.bind(SessionFacts("rt_1"))
    body = {"tools": [WEATHER_TOOL], "audio": {"input": {"turn_detection": None}}, **session}
    (updated,) = sent_messages(send(d, type="session.update", session=body))
    assert updated["session"]["tools"] == [WEATHER_TOOL]
    return d


def _ask(d: OpenAIRealtime, text: str, **response) -> ev.TurnCommand:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    send(d, type="conversation.item.create", item=item)
    (turn,) = send(d, type="response.create", response=response)
    assert isinstance(turn, ev.TurnCommand) and turn.chat is not None
    return turn


def test_function_tools_reach_the_turn_and_a_call_streams_as_the_api_does():
    from omnifabric.common.tools import ToolCall
    from omnifabric.edge.chat import TurnToolCall

    d = _with_tools()
    turn = _ask(d, "What's the weather in Paris?")
    assert [t.name for t in turn.chat.tools] == ["get_weather"]
    assert turn.chat.tool_choice.kind == "auto"
    assert [m["type"] for m in d.encode_turn(TurnStarted(True, True))] == ["response.created"]
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    events = d.encode_turn(TurnToolCall(call))
    assert [m["type"] for m in events] == [
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
    ]
    assert events[0]["item"]["type"] == "function_call" and events[0]["item"]["arguments"] == ""
    done_args = events[3]
    assert (done_args["name"], done_args["call_id"]) == ("get_weather", "call_1")
    assert json.loads(done_args["arguments"]) == {"city": "Paris"}
    done = d.encode_turn(TurnDone(ChatResult(reason="tool_calls")))[-1]["response"]
    assert done["status"] == "completed"
    assert [o["type"] for o in done["output"]] == ["function_call"]
    # The client runs the function and sends its output; the next response uses it.
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'}
    added = sent_messages(send(d, type="conversation.item.create", item=output))
    assert added[0]["item"]["type"] == "function_call_output"
    (turn,) = send(d, type="response.create")
    roles = [m.role for m in turn.chat.messages]
    assert roles == ["user", "assistant", "tool"]
    assert turn.chat.messages[1].tool_calls == (call,)
    assert turn.chat.messages[2].tool_call_id == "call_1"


def test_parallel_calls_stream_as_two_items_and_both_outputs_reach_the_next_turn():
    from omnifabric.common.tools import ToolCall
    from omnifabric.edge.chat import TurnToolCall

    d = _with_tools()
    _ask(d, "What's the weather in Paris and in London?")
    d.encode_turn(TurnStarted(True, True))
    made = [
        ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
        ToolCall("call_2", "get_weather", '{"city": "London"}'),
    ]
    items = [d.encode_turn(TurnToolCall(call))[0]["item"] for call in made]
    assert [i["call_id"] for i in items] == ["call_1", "call_2"]
    assert items[0]["id"] != items[1]["id"]
    done = d.encode_turn(TurnDone(ChatResult(reason="tool_calls")))[-1]["response"]
    assert [(o["type"], o["call_id"]) for o in done["output"]] == [
        ("function_call", "call_1"),
        ("function_call", "call_2"),
    ]
    for call_id, output in (("call_1", "21 C"), ("call_2", "14 C")):
        item = {"type": "function_call_output", "call_id": call_id, "output": output}
        send(d, type="conversation.item.create", item=item)
    (turn,) = send(d, type="response.create")
    messages = turn.chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c for m in messages for c in m.tool_calls] == made
    assert [m.tool_call_id for m in messages if m.role == "tool"] == ["call_1", "call_2"]


def test_tool_choice_none_and_a_named_function_reach_the_turn():
    d = _with_tools(tool_choice="none")
    assert _ask(d, "Weather in Paris?").chat.tool_choice.kind == "none"
    d.encode_turn(TurnDone(ChatResult()))
    named = {"type": "function", "name": "get_weather"}
    turn = _ask(d, "And Rome?", tool_choice=named)
    assert (turn.chat.tool_choice.kind, turn.chat.tool_choice.name) == ("function", "get_weather")


@pytest.mark.parametrize(
    "item, param",
    [
        (
            {"type": "function_call_output", "call_id": "call_nope", "output": "x"},
            "item.call_id",
        ),
        ({"type": "function_call", "name": "launch_rockets", "arguments": "{}"}, "item.name"),
    ],
)
def test_an_unknown_function_or_call_is_an_error_not_a_crash(item, param):
    d = _with_tools()
    with pytest.raises(EdgeError) as caught:
        send(d, type="conversation.item.create", item=item)
    assert d.error(caught.value)["error"]["param"] == param


def test_an_error_quotes_a_clients_long_value_short():
    d = _with_tools()
    item = {"type": "function_call_output", "call_id": "c" * 100_000, "output": "x"}
    with pytest.raises(EdgeError) as caught:
        send(d, type="conversation.item.create", item=item)
    message = d.error(caught.value)["error"]["message"]
    assert len(message) < 200 and repr("c" * 64) in message


@pytest.mark.parametrize(
    "session, param",
    [
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools[0].type"),
        ({"tools": [{"type": "function", "name": "no spaces"}]}, "session.tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "session.tool_choice.name"),
    ],
)
def test_bad_tools_are_refused_naming_the_parameter(session, param):
    d = OpenAIRealtime("m")
    with pytest.raises(EdgeError) as caught:
        send(d, type="session.update", session=session)
    assert d.error(caught.value)["error"]["param"] == param


def test_a_tool_schema_past_the_depth_limit_is_refused_and_the_session_goes_on():
    """A schema nested 1,000 deep (orjson reads 1,024) was taken, then broke the standard
    library's JSON writer on its way to the worker: the connection closed with 1011. Past
    common.tools.MAX_SCHEMA_DEPTH it is refused naming the parameter."""

    def update(dicts: int) -> str:  # the schema, its properties and `dicts` dicts in `p`
        inner = '{"a": ' * (dicts - 1) + "{}" + "}" * (dicts - 1)
        schema = '{"type": "object", "properties": {"p": ' + inner + "}}"
        tool = '{"type": "function", "name": "f", "parameters": ' + schema + "}"
        return '{"type": "session.update", "session": {"tools": [' + tool + "]}}"

    d = OpenAIRealtime("m")
    for dicts in (tools.MAX_SCHEMA_DEPTH - 1, 1000):
        with pytest.raises(EdgeError) as caught:
            d.decode(update(dicts))
        assert d.error(caught.value)["error"]["param"] == "session.tools[0].parameters"
        assert f"deeper than {tools.MAX_SCHEMA_DEPTH} levels" in str(caught.value)
    [updated] = sent_messages(d.decode(update(tools.MAX_SCHEMA_DEPTH - 2)))
    schema = updated["session"]["tools"][0]["parameters"]
    assert not nesting.value_deeper_than(schema, tools.MAX_SCHEMA_DEPTH)
    assert nesting.value_deeper_than(schema, tools.MAX_SCHEMA_DEPTH - 1)
    assert tool_wire.specs_to_pb(d.settings.tools)[0].parameters_json


def test_a_duplex_engines_call_and_the_clients_output_go_through_the_session():
    """Server VAD: the tools reach the engine's session; a unit that ends in a call is a
    response of its own; the client's output goes to the engine, and the response.create
    that follows it is taken as said (the engine answers by itself)."""
    from omnifabric.common.tools import ToolCall

    d = Driven(OpenAIRealtime("m"))
    send(d.d, type="session.update", session={"tools": [WEATHER_TOOL]})
    (init,) = d.run(d.d.decode(APPEND_NOTHING))
    assert isinstance(init, ev.InitCommand) and [t.name for t in init.tools] == ["get_weather"]
    d = running(d.d)
    d.appended(1, ev.AppendCommand(pcm=np.full(16000, 0.3, "<f4").tobytes()))
    d.d.encode(output(1, listen=True))
    d.appended(2, ev.AppendCommand(pcm=np.zeros(16000, "<f4").tobytes()))
    call = ToolCall("call_9", "get_weather", '{"city": "Paris"}')
    events = d.d.encode(
        output(2, listen=True, input_transcript="weather in paris", tool_calls=(call,))
    )
    kinds = [m["type"] for m in events]
    assert kinds[0] == "input_audio_buffer.speech_stopped" and "response.created" in kinds
    assert "response.function_call_arguments.done" in kinds
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["type"] == "function_call"
    item = {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}
    commands = send(d.d, type="conversation.item.create", item=item)
    assert commands[-1] == ev.ToolOutputCommand("call_9", "sunny")
    assert send(d.d, type="response.create") == []  # taken as said
    with pytest.raises(InvalidEvent):
        send(d.d, type="response.create")  # no output waits: the engine takes turns itself
