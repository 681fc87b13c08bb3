"""The dialects, sans I/O: client messages -> commands, session events -> client messages,
with plain function calls (no sockets, no event loop, no fabric)."""

from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import replace

import numpy as np
import pytest

from omnifabric.common import nesting
from omnifabric.edge import errors, fields
from omnifabric.edge import events as ev
from omnifabric.edge.dialects import realtime
from omnifabric.edge.dialects.base import SessionFacts
from omnifabric.edge.pcm import MAX_VOICE_S, reference_audio


def b64(arr: np.ndarray) -> str:
    return base64.b64encode(arr.astype("<f4").tobytes()).decode()


ONE_SECOND = b64(np.zeros(16000, np.float32))


def parse(obj) -> object:
    return realtime.command(fields.parse_frame(json.dumps(obj)))


def test_not_json_is_invalid_json():
    with pytest.raises(fields.InvalidJson):
        fields.parse_frame("{not json")


@pytest.mark.parametrize(
    "text, error",
    [
        ("[1, 2]", errors.InvalidPayload),
        ('{"a": 1}', errors.MissingField),
        ('{"type": 5}', errors.InvalidPayload),
        ('{"type": "input.append", "x": NaN}', errors.InvalidPayload),
        ("[" * 100_000 + "]" * 100_000, errors.InvalidPayload),
    ],
)
def test_frame_errors(text, error):
    with pytest.raises(error):
        fields.parse_frame(text)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # orjson: past its depth
        '{"type": "x", "n": NaN, "a": ' + "[" * 600 + "]" * 600 + "}",  # orjson: NaN
        '{"type": "x", "n": "\\ud800", "a": ' + "[" * 600 + "]" * 600 + "}",  # a surrogate
    ],
)
def test_deep_json_never_reaches_the_recursive_parser(monkeypatch, text):
    """What orjson refuses is re-read by the standard library's parser, which recurses once
    a level: past nesting.MAX_PARSE_DEPTH it is refused without it (at the interpreter's
    limit a garbage collection's finalizers would fail)."""

    def recursive(*args, **kwargs):
        raise AssertionError("the standard library's parser ran")

    monkeypatch.setattr(fields.json, "loads", recursive)
    with pytest.raises(errors.InvalidPayload, match="nesting too deep"):
        fields.parse_frame(text)


def test_the_standard_library_reads_what_orjson_refuses_within_its_depth():
    """A lone surrogate escape is JSON orjson refuses: read at nesting.MAX_PARSE_DEPTH
    levels; brackets inside strings (escaped quotes too) are not nesting; an unterminated
    string is not JSON."""
    lone = '"\\ud800"'

    def frame(arrays: int) -> str:  # the event's object and `arrays` arrays around `lone`
        strings = '"s": "[\\"' + "[" * 5000 + '"'
        return '{"type": "x", ' + strings + ', "a": ' + "[" * arrays + lone + "]" * arrays + "}"

    event = fields.parse_frame(frame(nesting.MAX_PARSE_DEPTH - 1))
    inner = event["a"]
    for _ in range(nesting.MAX_PARSE_DEPTH - 2):
        inner = inner[0]
    assert inner == ["\ud800"] and event["s"] == '["' + "[" * 5000
    with pytest.raises(errors.InvalidPayload, match="nesting too deep"):
        fields.parse_frame(frame(nesting.MAX_PARSE_DEPTH))
    with pytest.raises(fields.InvalidJson):
        fields.parse_frame('{"type": "x", "n": ' + lone + ', "s": "' + "[" * 5000)


def test_a_clients_value_is_shown_short_and_never_recursively():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert fields.shown(deep) == "a list" and fields.shown({"a": deep}) == "an object"
    assert fields.shown("x" * 100) == repr("x" * 64) and fields.shown(None) == "None"
    assert fields.shown(10**100) == str(10**100)[:66]


def test_unknown_event():
    with pytest.raises(errors.UnknownEvent):
        parse({"type": "response.create"})


def test_init_current_dialect_maps_sdk_keys():
    cmd = parse(
        {
            "type": "session.init",
            "payload": {
                "instructions": "be brief",
                "config": {
                    "max_kv_tokens": 4096,
                    "tts_enabled": False,
                    "vision_hd": True,
                    "length_penalty": 1.1,
                    "model_extra": "ignored",
                },
                "voice": {"ref_audio_base64": ONE_SECOND},
            },
        }
    )
    assert isinstance(cmd, ev.InitCommand)
    assert cmd.dialect is ev.Dialect.CURRENT
    assert cmd.system_prompt == "be brief"
    assert cmd.config.max_kv_tokens == 4096 and cmd.config.tts_enabled is False
    assert cmd.config.length_penalty == 1.1
    assert cmd.max_slice_nums == 2
    assert len(cmd.ref_audio) == 64000


def test_init_first_dialect_accepts_wav_reference():
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(np.zeros(8000, "<i2").tobytes())
    wav_b64 = base64.b64encode(buf.getvalue()).decode()
    cmd = parse({"type": "session.update", "session": {"instructions": "hi", "ref_audio": wav_b64}})
    assert cmd.dialect is ev.Dialect.FIRST
    assert len(cmd.ref_audio) == 16000 * 4  # resampled 8 kHz -> 16 kHz


@pytest.mark.parametrize(
    "payload, error",
    [
        ({"type": "session.init"}, errors.MissingField),
        ({"type": "session.init", "payload": []}, errors.InvalidPayload),
        (
            {"type": "session.init", "payload": {"config": {"temperature": "hot"}}},
            errors.InvalidPayload,
        ),
        (
            {"type": "session.init", "payload": {"config": {"max_kv_tokens": 9000}}},
            errors.InvalidPayload,
        ),
        ({"type": "session.init", "payload": {"system_prompt": 3}}, errors.InvalidPayload),
    ],
)
def test_init_errors(payload, error):
    with pytest.raises(error):
        parse(payload)


def test_append_both_dialects():
    a = parse({"type": "input.append", "input": {"audio": ONE_SECOND, "force_listen": True}})
    b = parse({"type": "input_audio_buffer.append", "audio": ONE_SECOND})
    assert isinstance(a, ev.AppendCommand) and a.force_listen and len(a.pcm) == 64000
    assert isinstance(b, ev.AppendCommand) and not b.force_listen


@pytest.mark.parametrize(
    "body, error",
    [
        ({}, errors.MissingField),
        ({"audio": "***"}, errors.InvalidPayload),
        ({"audio": ""}, errors.InvalidPayload),
        ({"audio": base64.b64encode(b"\x00" * 16003).decode()}, errors.InvalidPayload),
        ({"audio": b64(np.full(16000, np.nan, np.float32))}, errors.InvalidPayload),
        ({"audio": ONE_SECOND, "video_frames": ["aGVsbG8="]}, errors.InvalidPayload),
        ({"audio": ONE_SECOND, "force_listen": "yes"}, errors.InvalidPayload),
    ],
)
def test_append_errors(body, error):
    with pytest.raises(error):
        parse({"type": "input.append", "input": body})


def test_reference_audio_rejects_odd_bytes():
    with pytest.raises(errors.InvalidPayload):
        reference_audio(base64.b64encode(b"abc").decode(), "ref_audio")


def _out(**kw) -> ev.Output:
    base = dict(
        seq=4,
        is_listen=False,
        text="Hi",
        pcm=np.zeros(24000, "<f4").tobytes(),
        end_of_turn=False,
        kv_cache_length=120,
        timings_ms={"prefill_ms": 10.0, "generate_ms": 20.0, "wall_clock_ms": 31.0},
        usage=ev.Usage(input_tokens=5, output_tokens=2, total_tokens=7),
    )
    base.update(kw)
    return ev.Output(**base)


def test_render_first_dialect():
    r = realtime.OutputRenderer(ev.Dialect.FIRST, "rt_1")
    [listen] = r.render(_out(is_listen=True, text="", pcm=b""))
    assert listen["type"] == "response.listen" and listen["kv_cache_length"] == 120
    [speak] = r.render(_out(end_of_turn=True))
    assert speak["type"] == "response.output_audio.delta"
    assert speak["text"] == "Hi" and speak["end_of_turn"] is True
    assert len(base64.b64decode(speak["audio"])) == 96000
    assert speak["metrics"]["prefill_ms"] == 10.0 and speak["metrics"]["wall_clock_ms"] == 31.0


def test_render_current_dialect_splits_and_closes_turn():
    r = realtime.OutputRenderer(ev.Dialect.CURRENT, "rt_1")
    events = r.render(_out(end_of_turn=True))
    assert [e["kind"] for e in events] == ["text", "audio", "listen"]
    assert events[2]["text"] == ""  # the SDK drops listen deltas without a string text
    assert events[1]["usage"]["input_tokens_details"]["vision_tokens"] == 0
    assert all(e["input_id"] == "input_4" for e in events)
    [listen] = r.render(_out(is_listen=True, text="", pcm=b""))
    assert listen["kind"] == "listen" and listen["text"] == ""


def test_early_output_is_marked_and_only_asked_for_where_clients_take_it():
    """A reply's start sent between units carries its unit's seq and `early` in metrics;
    the dialects whose clients take output between units ask the worker for it, the
    legacy page (one result per chunk) and half-duplex calls do not; a gRPC client asks
    per session (SessionInit.early_results) and gets OutputUnit.early."""
    from omnifabric.edge.dialects.grpc_realtime import GrpcRealtime
    from omnifabric.edge.dialects.half_duplex import HalfDuplex
    from omnifabric.edge.dialects.legacy_duplex import LegacyDuplex
    from omnifabric.edge.dialects.openai.translator import OpenAIRealtime

    for dialect in (ev.Dialect.FIRST, ev.Dialect.CURRENT):
        r = realtime.OutputRenderer(dialect, "rt_1")
        [listen] = r.render(_out(is_listen=True, text="", pcm=b""))
        events = r.render(replace(_out(), early=True))
        assert {e["metrics"]["seq"] for e in (listen, *events)} == {4}
        assert all(e["metrics"].get("early") is True for e in events)
        assert "early" not in listen["metrics"]
    assert realtime.RealtimeDuplex.traits.early_results
    assert OpenAIRealtime.traits.early_results
    for name, cls in (("legacy", LegacyDuplex), ("half", HalfDuplex), ("grpc", GrpcRealtime)):
        assert not cls.traits.early_results, name
    from omnifabric.edge.dialects.grpc_realtime import init_command
    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

    for asked in (True, False):
        msg = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, early_results=asked)
        assert init_command(msg).early_results is asked
    grpc = GrpcRealtime()
    grpc.decode(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
    [early] = grpc.encode(replace(_out(), early=True))
    [own] = grpc.encode(_out(is_listen=True, text="", pcm=b""))
    assert early.output.early and early.output.seq == 4 and not own.output.early


def test_closed_reasons_per_dialect():
    closed = ev.Closed(ev.USER_STOP, ev.Usage(), client_reason="bye")
    assert realtime.closed_json(closed, ev.Dialect.FIRST, "s")["reason"] == "stopped"
    assert realtime.closed_json(closed, ev.Dialect.CURRENT, "s")["reason"] == "bye"
    plain = ev.Closed(ev.USER_STOP, ev.Usage())
    assert realtime.closed_json(plain, ev.Dialect.CURRENT, "s")["reason"] == "user_stop"
    timeout = ev.Closed(ev.TIMEOUT, ev.Usage())
    assert realtime.closed_json(timeout, ev.Dialect.FIRST, "s")["reason"] == "timeout"
    assert "usage" in realtime.closed_json(timeout, None, None)


def test_input_transcript_rides_on_the_units_first_event():
    for dialect in (ev.Dialect.FIRST, ev.Dialect.CURRENT):
        r = realtime.OutputRenderer(dialect, "rt_1")
        events = r.render(_out(input_transcript="What is the capital of France?"))
        assert events[0]["input_transcript"] == "What is the capital of France?"
        assert all("input_transcript" not in e for e in events[1:])
        assert all("input_transcript" not in e for e in r.render(_out()))


def test_created_carries_the_engines_notes_only_when_there_are_some():
    for dialect in (ev.Dialect.FIRST, ev.Dialect.CURRENT):
        plain = realtime.created_json(ev.Created("s1", 40), dialect, "audio")
        assert "notes" not in plain
        noted = realtime.created_json(
            ev.Created("s1", 40, ("voice: not cloned",)), dialect, "audio"
        )
        assert noted["notes"] == ["voice: not cloned"]
        assert noted["session_id"] == "s1"


def test_created_says_which_units_the_worker_takes_and_the_init_whether_the_client_cuts():
    """session.created's `input_units` (current dialect): the leased worker's unit bounds
    and whether its engine takes units as they come, so a client (the /audio page) may cut
    one short where speech stops; the init's `config.speech_cuts` says it does
    (InitCommand.speech_cuts: None when not said, the edge then decides)."""
    plain = realtime.created_json(ev.Created("s1", 40), ev.Dialect.CURRENT, "audio")
    assert "input_units" not in plain  # the worker stated no bounds
    for as_sent in (True, False):
        created = ev.Created("s1", 40, unit_samples=(4000, 64000), units_as_sent=as_sent)
        units = realtime.created_json(created, ev.Dialect.CURRENT, "audio")["input_units"]
        assert units == {"min_samples": 4000, "max_samples": 64000, "as_sent": as_sent}
        first = realtime.created_json(created, ev.Dialect.FIRST, "audio")
        assert "input_units" not in first  # the first dialect's event keeps its shape
    init = {"type": "session.init", "payload": {}}
    said = parse(init)
    assert isinstance(said, ev.InitCommand) and said.speech_cuts is None
    for cuts in (True, False):
        said = parse({**init, "payload": {"config": {"speech_cuts": cuts}}})
        assert isinstance(said, ev.InitCommand) and said.speech_cuts is cuts
    with pytest.raises(errors.InvalidPayload, match="config.speech_cuts"):
        parse({**init, "payload": {"config": {"speech_cuts": "yes"}}})


def test_chat_numbers_beyond_float_range_are_invalid_payload():
    """One number check for every dialect: chat's huge integers are refused like the
    realtime config's (math.isfinite overflowed on them in chat's own copy)."""
    from omnifabric.edge.chat import parse_chat
    from omnifabric.edge.errors import InvalidPayload

    body = {"messages": [{"role": "user", "content": "x"}]}
    for field in ("temperature", "top_p", "length_penalty", "max_new_tokens"):
        with pytest.raises(InvalidPayload, match=f"generation.{field}"):
            parse_chat({**body, "generation": {field: 10**400}})
    with pytest.raises(InvalidPayload, match="image.max_slice_nums"):
        parse_chat({**body, "image": {"max_slice_nums": -(10**400)}})
    assert parse_chat({**body, "generation": {"temperature": 1}}) is not None


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", [2], 1 << 32])
def test_max_slice_nums_must_be_a_positive_uint32(value):
    for event in (
        {"type": "session.init", "payload": {"max_slice_nums": value}},
        {"type": "session.update", "session": {"max_slice_nums": value}},
        {"type": "input.append", "input": {"audio": ONE_SECOND, "max_slice_nums": value}},
    ):
        with pytest.raises(errors.InvalidPayload, match="max_slice_nums"):
            parse(event)


def test_max_slice_nums_range_is_not_the_parsers():
    """The parser checks the form only: the range comes from the leased worker's limits
    (edge.worker_client.check_slices), so a value a worker may take is not refused here."""
    cmd = parse({"type": "session.init", "payload": {"max_slice_nums": 5}})
    assert isinstance(cmd, ev.InitCommand) and cmd.max_slice_nums == 5
    cmd = parse({"type": "input.append", "input": {"audio": ONE_SECOND, "max_slice_nums": 12}})
    assert isinstance(cmd, ev.AppendCommand) and cmd.max_slice_nums == 12


# ---- every dialect, as plain function calls ---------------------------------------------


def _frame(obj) -> str:
    return json.dumps(obj)


def test_legacy_duplex_translates_prepare_chunks_pause_and_its_ends():
    from omnifabric.edge.dialects.legacy_duplex import LegacyDuplex

    d = LegacyDuplex("adx_1")
    assert d.mode == "audio" and d.refusal() is None
    assert LegacyDuplex("omni_7").mode == "video"
    assert LegacyDuplex("bad id!").refusal().close_code == 1008
    [init] = d.decode(_frame({"type": "prepare", "prefix_system_prompt": "hi", "config": {}}))
    assert isinstance(init, ev.InitCommand) and init.system_prompt == "hi"
    [unit] = d.decode(_frame({"type": "audio_chunk", "audio_base64": ONE_SECOND}))
    assert isinstance(unit, ev.AppendCommand) and len(unit.pcm) == 64000
    d.appended(1, unit)
    [pause] = d.decode(_frame({"type": "pause", "timeout": 5}))
    assert pause == ev.PauseCommand(5.0)
    assert d.decode(_frame({"type": "resume"})) == [ev.ResumeCommand()]
    assert d.decode(_frame({"type": "client_diagnostic"})) == []
    with pytest.raises(errors.UnknownEvent):
        d.decode(_frame({"type": "what"}))
    with pytest.raises(errors.InvalidPayload, match="timeout"):
        d.decode(_frame({"type": "pause", "timeout": 0}))
    assert d.not_ready(unit) == "send prepare and wait for prepared before audio_chunk"
    [result] = d.encode(_out(seq=1))
    assert result["type"] == "result" and result["current_time"] == 1000
    assert result["cost_all_ms"] == 30.0 and result["audio_data"]
    assert d.encode(ev.Paused(5.0)) == [{"type": "paused", "timeout": 5.0}]
    timeout = ev.Closed(ev.USER_STOP, ev.Usage(), client_reason=ev.PAUSE_TIMEOUT)
    assert d.encode(timeout) == [{"type": "timeout", "reason": "pause_timeout"}]
    assert d.encode(ev.Closed(ev.CONTEXT_FULL, ev.Usage())) == [
        {"type": "timeout", "reason": "context_full"}
    ]
    assert d.decode(_frame({"type": "stop"})) == [ev.CloseCommand()]
    assert d.encode(ev.Closed(ev.USER_STOP, ev.Usage())) == [
        {"type": "stopped", "session_id": "adx_1"}
    ]
    err = d.error(errors.InvalidPayload("no"))
    assert err == {"type": "error", "error": "no", "message": "no"}
    assert d.error(errors.QueueFull("full"))["error"] == "queue_full: full"


def test_grpc_dialect_first_request_costs_and_refusals():
    from omnifabric.edge.dialects.base import Refusal
    from omnifabric.edge.dialects.grpc_realtime import GrpcRealtime
    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

    d = GrpcRealtime()
    assert d.mode is None
    append = rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=bytes(64000)))
    with pytest.raises(errors.InvalidPayload) as info:
        d.decode(append)
    assert d.error(info.value) == Refusal("INVALID_ARGUMENT", "the first request must be init")
    init = rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_VIDEO))
    [cmd] = d.decode(init)
    assert isinstance(cmd, ev.InitCommand) and d.mode == "video"
    [unit] = d.decode(append)
    assert isinstance(unit, ev.AppendCommand)
    with pytest.raises(errors.InvalidPayload, match="only once"):
        d.decode(init)
    resume = rt_pb.ConnectRequest(resume=rt_pb.SessionResumeRequest(resume_token="t"))
    with pytest.raises(errors.InvalidPayload, match="^resume may only be the first request"):
        d.decode(resume)  # it was called "an empty request"
    d.bind(SessionFacts("rt_5"))
    timings = {"prefill_ms": 1.0, "cost_llm_ms": 7.5, "cost_tts_ms": 2.0, "queue_ms": 0.5}
    [out] = d.encode(_out(timings_ms=timings, n_tokens=3, n_tts_tokens=9))
    assert dict(out.output.timings.engine_costs_ms) == {"llm": 7.5, "tts": 2.0}
    assert (out.output.n_tokens, out.output.n_tts_tokens) == (3, 9)
    assert out.output.usage.total_tokens == 7
    failed = ev.Closed(ev.ERROR, ev.Usage(), "engine broke", error_code="inference_error")
    error, closed = d.encode(failed)
    assert error.error.code == "inference_error"
    assert closed.closed.message == "engine broke" and closed.closed.session_id == "rt_5"
    assert d.error(errors.QueueFull("full")) == Refusal("RESOURCE_EXHAUSTED", "queue_full: full")
    assert d.error(errors.InternalError("boom")) == Refusal("INTERNAL", "internal error")
    assert d.error(errors.NotReady("wait")).error.code == "not_ready"
    refused = d.init_refused(errors.InvalidPayload("max_slice_nums: 5; this server takes 1 to 2"))
    assert d.error(refused).status == "INVALID_ARGUMENT"


def test_grpc_settings_are_checked_by_the_json_dialects_rules_and_all_arrive():
    """The gRPC init's config went to the worker unchecked (a NaN temperature, a top_p of
    5, a 64-bit seed torch cannot take) where the JSON dialects refuse it; its voice was
    not checked for finite samples, and deep JSON in a tool's schema ended the call with
    INTERNAL (RecursionError). Every field of DuplexConfig still arrives."""
    from omnifabric.edge.dialects.grpc_realtime import init_command, settings_from
    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

    given = dict(
        length_penalty=1.1, temperature=0.5, top_k=20, top_p=0.75, listen_prob_scale=1.5,
        force_listen_count=2, max_new_speak_tokens_per_chunk=20, max_kv_tokens=4096,
        tts_enabled=False, max_tokens=300, vad_threshold=0.5, min_speech_ms=250,
        end_of_turn_silence_ms=600, half_duplex=True, seed=7, context_window="basic",
        window_high_tokens=3000, window_low_tokens=2000, window_units=10,
        window_previous_tokens=100,
    )  # fmt: skip
    names = {f.name for f in common_pb2.DuplexConfig.DESCRIPTOR.fields}
    assert set(given) == names  # a new field is added here, and so checked to arrive
    settings = settings_from(common_pb2.DuplexConfig(**given))
    assert {k: getattr(settings, k) for k in given} == pytest.approx(given)
    assert settings_from(common_pb2.DuplexConfig()) == ev.DuplexSettings()
    for bad, message in [
        (dict(temperature=float("nan")), "init.config.temperature must be a number"),
        (dict(top_p=5.0), r"init.config.top_p must be in \[0.0, 1.0\]"),
        (dict(top_k=0), "init.config.top_k must be in"),
        (dict(seed=2**64 - 1), "init.config.seed must be in"),
        (dict(max_kv_tokens=2**32 - 1), "init.config.max_kv_tokens must be in"),
        (dict(context_window="bogus"), "init.config.context_window must be one of"),
    ]:
        with pytest.raises(errors.InvalidPayload, match=message):
            settings_from(common_pb2.DuplexConfig(**bad))
    nan_voice = np.full(1600, np.nan, "<f4").tobytes()
    with pytest.raises(errors.InvalidPayload, match="^ref_audio: samples must be finite"):
        init_command(rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, ref_audio=nan_voice))
    long_voice = np.zeros(int(MAX_VOICE_S * 16000) + 1, "<f4").tobytes()
    with pytest.raises(errors.InvalidPayload, match="^tts_ref_audio: the voice is 60.0 s: at"):
        init_command(rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, tts_ref_audio=long_voice))
    deep = common_pb2.ToolSpec(name="f", parameters_json="[" * 100_000 + "]" * 100_000)
    with pytest.raises(errors.InvalidPayload, match=r"init.tools\[0\].parameters_json"):
        init_command(rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, tools=[deep]))


def test_grpc_dialect_carries_tools_calls_and_outputs():
    """Issue 53: the RealtimeService's own function calling: tools in the init, the model's
    calls on the output, the client's outputs as requests (checked like the JSON ones)."""
    from omnifabric.common.tools import ToolCall
    from omnifabric.edge.dialects.grpc_realtime import GrpcRealtime
    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

    schema = '{"type": "object", "properties": {"city": {"type": "string"}}}'
    weather = common_pb2.ToolSpec(name="get_weather", parameters_json=schema)
    init = rt_pb.SessionInit(
        mode=common_pb2.MODE_AUDIO, tools=[weather], tool_choice="function",
        tool_choice_name="get_weather",
    )  # fmt: skip
    d = GrpcRealtime()
    [cmd] = d.decode(rt_pb.ConnectRequest(init=init))
    assert isinstance(cmd, ev.InitCommand) and cmd.tools[0].parameters["type"] == "object"
    assert (cmd.tool_choice.kind, cmd.tool_choice.name) == ("function", "get_weather")
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    [out] = d.encode(_out(tool_calls=(call,)))
    assert [(c.call_id, c.name) for c in out.output.tool_calls] == [("call_1", "get_weather")]
    output = rt_pb.ConnectRequest(tool_output=common_pb2.ToolOutput(call_id="call_1", output="9C"))
    assert d.decode(output) == [ev.ToolOutputCommand("call_1", "9C")]
    # An output for no call the model made (or one already answered) is the client's
    # mistake: an error event names the id, nothing goes to the worker.
    for call_id in ("call_1", "call_9"):
        unknown = common_pb2.ToolOutput(call_id=call_id, output="9C")
        with pytest.raises(errors.InvalidPayload, match=f"'{call_id}': no call"):
            d.decode(rt_pb.ConnectRequest(tool_output=unknown))
    spec = common_pb2.ToolSpec
    for tools, choice, why in (
        ([spec(name="a b")], {}, "name"),
        ([spec(name="f", parameters_json="{")], {}, "JSON"),
        ([weather], {"tool_choice": "function", "tool_choice_name": "x"}, "names no"),
    ):
        bad = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, tools=tools, **choice)
        with pytest.raises(errors.InvalidPayload, match=why):
            GrpcRealtime().decode(rt_pb.ConnectRequest(init=bad))


def _result(**kw):
    from omnifabric.edge.chat import ChatResult

    return ChatResult(
        text="Hello.",
        audio=[b"\0" * 8, b"\0" * 8],
        input_tokens=4,
        generated_tokens=2,
        usage=ev.Usage(input_tokens=4, output_tokens=2, total_tokens=6),
        timings_ms={"queue_ms": 3.0, "wall_clock_ms": 120.4},
        **kw,
    )


def test_realtime_chat_dialect_turns_and_cumulative_usage():
    from omnifabric.edge.chat import ChatClose, ChatOpen, ChatTurn, TurnDelta, TurnDone, TurnStarted
    from omnifabric.edge.dialects.realtime_chat import RealtimeChat

    d = RealtimeChat()
    d.session_id = "rt_9"
    assert d.opening() == [{"type": "session.queue_done"}]
    append = _frame({"type": "input.append", "input": {"messages": []}})
    with pytest.raises(errors.NotReady):
        d.decode(append)
    assert d.decode(_frame({"type": "session.init", "payload": {}})) == [ChatOpen()]
    with pytest.raises(errors.InvalidEvent):
        d.decode(_frame({"type": "session.init"}))
    assert d.decode(append) == [ChatTurn({"messages": []})]
    for turn in (1, 2):
        assert d.encode(TurnStarted(streaming=True, speech=True)) == []
        deltas = d.encode(TurnDelta("Hel", b"\0" * 8))
        assert [e["kind"] for e in deltas] == ["text", "audio"]
        assert deltas[0]["response_id"] == f"resp_rt_9_{turn}"
        [done] = d.encode(TurnDone(_result()))
        assert done["type"] == "response.done" and done["usage"]["total_tokens"] == 6 * turn
    d.encode(TurnStarted(streaming=False, speech=True))
    assert d.encode(TurnDelta("x", b"")) == []  # not streaming: all at the end
    text, audio, done = d.encode(TurnDone(_result()))
    assert (text["text"], audio["kind"], done["metrics"]["input_tokens"]) == ("Hello.", "audio", 4)
    [closed] = d.encode(ChatClose("bye"))
    assert closed["reason"] == "bye" and closed["usage"]["total_tokens"] == 18


def test_legacy_and_http_chat_dialects():
    from http import HTTPStatus

    from omnifabric.edge.chat import (
        SHUTDOWN_MESSAGE,
        ChatTurn,
        Shutdown,
        TurnDone,
        TurnLeased,
        TurnPrefilled,
        TurnQueued,
        TurnStarted,
    )
    from omnifabric.edge.dialects.http_chat import HttpChat
    from omnifabric.edge.dialects.legacy_chat import LegacyChat

    legacy = LegacyChat()
    assert legacy.one_request and legacy.id_prefix == "chat_"
    with pytest.raises(errors.InvalidPayload, match="not valid JSON"):
        legacy.decode("{nope")
    assert legacy.decode('{"messages": []}') == [ChatTurn({"messages": []})]
    legacy.encode(TurnStarted(streaming=False, speech=True))
    queued = legacy.encode(TurnQueued(ev.Queued(2, 3, 1.25, "t1", True)))
    assert queued[0]["type"] == "queued" and queued[0]["estimated_wait_s"] == 1.2
    assert legacy.encode(TurnLeased(waited=True)) == [{"type": "queue_done"}]
    assert legacy.encode(TurnPrefilled(4)) == [{"type": "prefill_done", "input_tokens": 4}]
    [done] = legacy.encode(TurnDone(_result()))
    assert done["type"] == "done" and done["audio_data"] and done["text"] == "Hello."
    assert legacy.encode(Shutdown()) == [{"type": "error", "error": SHUTDOWN_MESSAGE}]

    http = HttpChat()
    with pytest.raises(errors.InvalidPayload, match="not JSON"):
        http.decode(b"\xff")
    http.encode(TurnStarted(streaming=True, speech=True))
    http.encode(TurnQueued(ev.Queued(1, 1, 0.5, "t2", True)))
    [answer] = http.encode(TurnDone(_result()))
    assert answer.status == HTTPStatus.OK and answer.body["audio_sample_rate"] == 24000
    assert answer.body["estimated_queue_wait_s"] == 0.5 and answer.body["duration_ms"] == 120
    assert http.error(errors.QueueFull("full")).status == HTTPStatus.SERVICE_UNAVAILABLE
    assert http.error(errors.MissingField("x")).status == HTTPStatus.BAD_REQUEST
    assert http.error(errors.InferenceError("x")).status == HTTPStatus.INTERNAL_SERVER_ERROR


def test_every_route_opens_its_dialect():
    from omnifabric.edge import dialects

    def opened(path: str, mode: str = "audio"):
        route, rest = dialects.find(dialects.WEBSOCKET, path)
        return route.open(rest, {"mode": [mode]}, "audio")

    assert type(opened("/v1/realtime")).__name__ == "RealtimeDuplex"
    assert type(opened("/v1/realtime", "chat")).__name__ == "RealtimeChat"
    assert opened("/ws/duplex/adx_3").session_id == "adx_3"
    assert type(opened("/ws/chat")).__name__ == "LegacyChat"
    assert dialects.find(dialects.WEBSOCKET, "/ws/duplex/") is None
    assert dialects.find(dialects.WEBSOCKET, "/nope") is None
    assert dialects.find(dialects.HTTP, "/api/chat") is not None


def test_inits_name_registered_voices():
    """ref_audio_id / tts_ref_audio_id (a voice from /api/assets/ref_audio) in every duplex
    dialect; sending the audio too is refused."""
    from omnifabric.edge.dialects.legacy_duplex import LegacyDuplex

    cmd = parse({"type": "session.init", "payload": {"voice": {"ref_audio_id": "v1"}}})
    assert (cmd.ref_audio_id, cmd.tts_ref_audio_id, cmd.ref_audio) == ("v1", "", b"")
    cmd = parse({"type": "session.update", "session": {"tts_ref_audio_id": "v2"}})
    assert cmd.tts_ref_audio_id == "v2"
    [init] = LegacyDuplex("adx_1").decode(_frame({"type": "prepare", "ref_audio_id": "v3"}))
    assert init.ref_audio_id == "v3"
    with pytest.raises(errors.InvalidPayload, match="not both"):
        parse(
            {"type": "session.update", "session": {"ref_audio_id": "v1", "ref_audio": ONE_SECOND}}
        )
    with pytest.raises(errors.InvalidPayload, match="must be a string"):
        parse({"type": "session.init", "payload": {"voice": {"ref_audio_id": 5}}})


def test_half_duplex_maps_vad_and_generation_config():
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    d = HalfDuplex("hd_1")
    config = {
        "vad": {
            "threshold": 0.8,
            "min_speech_duration_ms": 128,
            "min_silence_duration_ms": 800.0,
            "speech_pad_ms": 30,
        },
        "generation": {"max_new_tokens": 5, "length_penalty": 1.1, "temperature": 0.7},
        "tts": {"enabled": False},
        "session": {"timeout_s": 60},
    }
    [init] = d.decode(_frame({"type": "prepare", "system_prompt": "hi", "config": config}))
    s = init.config
    assert (s.vad_threshold, s.min_speech_ms, s.end_of_turn_silence_ms) == (0.8, 128, 800)
    assert (s.temperature, s.length_penalty, s.tts_enabled) == (0.7, 1.1, False)
    assert s.half_duplex is True  # the engine answers whole turns (MiniCPM-o: its chat path)
    [prepared] = d.encode(ev.Created("hd_1", 10, ("min_speech_ms: not used",)))
    assert prepared["timeout_s"] == 60 and prepared["notes"] == ["min_speech_ms: not used"]
    assert "notes" not in HalfDuplex("hd_2").encode(ev.Created("hd_2", 10))[0]
    # max_new_tokens caps each answer: the worker's max_tokens of a half-duplex session (it
    # ends the answer itself). The edge feeds the answer nothing: the worker goes on alone.
    assert s.max_tokens == 5
    d.encode(_out(seq=1, n_tokens=3))
    # The answer began: the audio held for the next unit is dropped, nothing is fed.
    assert d.after_output(_out(seq=1)) == [ev.ClearAudioCommand()]
    d.encode(_out(seq=1, n_tokens=2))  # the worker's own pieces carry the answer's seq
    assert d.after_output(_out(seq=1)) == []
    [*_, done] = d.encode(_out(seq=1, text="", n_tokens=0, end_of_turn=True))
    assert done["type"] == "turn_done" and d.after_output(_out(seq=1)) == []
    assert done["turn_index"] == 1  # turns answered so far, as the reference server counts


def test_half_duplex_audio_is_a_stream_cut_into_the_workers_units():
    """audio_chunk of any length (issue 36: the 2484-sample last piece of a recording cut
    into 0.5 s chunks was refused): short chunks wait for the next, long ones go in equal
    units the worker serves, no sample lost or reordered."""
    from omnifabric.edge.cadence import CutCadence, for_traits
    from omnifabric.edge.dialects.half_duplex import MAX_CHUNK_SAMPLES, HalfDuplex

    d = HalfDuplex("hd_1")
    cadence = for_traits(d.traits.cadence)  # the driver's, as edge.connection runs it
    assert isinstance(cadence, CutCadence)
    d.decode(_frame({"type": "prepare"}))
    audio = np.arange(200000, dtype="<f4") / 200000

    def chunk(a: int, b: int) -> list[ev.AppendCommand]:
        b64 = base64.b64encode(audio[a:b].tobytes()).decode()
        units: list[ev.AppendCommand] = []
        for cmd in d.decode(_frame({"type": "audio_chunk", "audio_base64": b64})):
            if isinstance(cmd, ev.AudioCommand):
                cadence.push(cmd.samples, cmd.rate)
                units += cadence.due(0.0, clock=False)
        return units

    def answered(out: ev.Output) -> None:
        d.encode(out)
        for cmd in d.after_output(out):
            assert isinstance(cmd, ev.ClearAudioCommand)
            cadence.clear()

    # Before the session started the driver refuses a chunk as not ready (as before): the
    # cut cadence holds nothing then.
    assert not cadence.holds_before_start
    cadence.start((4000, 64000), 0.0)  # the leased worker's bounds, as the session starts
    sent: list[ev.AppendCommand] = []
    sizes = []
    for a, b in ((0, 8000), (8000, 10484), (10484, 11484), (11484, 13000), (13000, 13000),
                 (13000, 150000), (150000, 151000)):  # fmt: skip
        units = chunk(a, b)
        sizes.append([len(c.pcm) // 4 for c in units])
        sent += units
    # 0.5 s goes at once; 2484, 1000 and 1516 wait until they make 5000; an empty chunk is
    # nothing; 137000 samples go as three equal units within 64000; 1000 waits.
    assert sizes == [[8000], [], [], [5000], [], [45666, 45667, 45667], []]
    got = np.frombuffer(b"".join(c.pcm for c in sent), "<f4")
    assert np.array_equal(got, audio[:150000])
    # The answer starts: what waited is the user's last instant before it, ignored too.
    answered(_out(seq=5, n_tokens=1))
    assert chunk(151000, 152000) == []
    answered(_out(seq=6, text="", n_tokens=0, end_of_turn=True))
    assert [len(c.pcm) // 4 for c in chunk(152000, 156000)] == [4000]
    with pytest.raises(errors.InvalidPayload, match=f"at most {MAX_CHUNK_SAMPLES}"):
        big = np.zeros(MAX_CHUNK_SAMPLES + 1, "<f4")
        d.decode(_frame({"type": "audio_chunk", "audio_base64": base64.b64encode(big).decode()}))


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"vad": {"threshold": 1.5}}, "config.vad.threshold must be in"),
        ({"vad": {"min_silence_duration_ms": 10}}, "config.vad.min_silence_duration_ms"),
        ({"vad": {"min_speech_duration_ms": "x"}}, "config.vad.min_speech_duration_ms"),
        ({"generation": {"max_new_tokens": 0}}, "config.generation.max_new_tokens"),
        ({"generation": {"temperature": -1}}, "config.generation.temperature"),
        ({"vad": []}, "vad"),
    ],
)
def test_half_duplex_config_errors_name_the_field(config, error):
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    with pytest.raises(errors.InvalidPayload, match=error):
        HalfDuplex("hd_1").decode(_frame({"type": "prepare", "config": config}))


def test_a_refused_half_duplex_prepare_changes_nothing():
    # Its timeout_s was kept although the prepare was refused: the call later ended after
    # 1 s of silence instead of the default 180 s (the fuzzer's find).
    from omnifabric.edge.dialects.half_duplex import TIMEOUT_S, HalfDuplex

    def idle_timeout() -> float:
        [_, pause] = d.decode(_frame({"type": "audio_chunk", "audio_base64": ""}))
        assert isinstance(pause, ev.PauseCommand)
        return pause.timeout_s

    d = HalfDuplex("hd_1")
    refused = {"session": {"timeout_s": 1}, "vad": {"threshold": 5}}
    with pytest.raises(errors.InvalidPayload, match="config.vad.threshold"):
        d.decode(_frame({"type": "prepare", "config": refused}))
    d.decode(_frame({"type": "prepare"}))
    assert d.encode(ev.Created("hd_1", 10))[0]["timeout_s"] == TIMEOUT_S
    assert idle_timeout() == TIMEOUT_S
    # A second prepare is refused by the session ("already prepared"): no Created follows.
    d.decode(_frame({"type": "prepare", "config": {"session": {"timeout_s": 1}}}))
    assert idle_timeout() == TIMEOUT_S


def test_half_duplex_takes_the_reference_pages_system_content():
    """The reference page's prepare: system_content parts (text, a voice not loaded yet,
    text), then the same with the voice; bad parts are refused by position."""
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    voice = np.linspace(-0.5, 0.5, 8000, dtype="<f4")
    voice_b64 = base64.b64encode(voice.tobytes()).decode()

    def prepare(content, **more):
        [init] = HalfDuplex("hd_1").decode(
            _frame({"type": "prepare", "system_content": content, **more})
        )
        return init

    parts = [
        {"type": "text", "text": "Imitate the voice of the sample."},
        {"type": "audio", "data": None, "name": "", "duration": 0},
        {"type": "text", "text": "Be a helpful assistant."},
    ]
    init = prepare(parts)
    assert init.system_prompt == "Imitate the voice of the sample.\nBe a helpful assistant."
    assert init.ref_audio == b""
    parts[1] = {"type": "audio", "data": voice_b64, "name": "v.wav", "duration": 0.5}
    init = prepare(parts, system_prompt="First.")
    assert init.system_prompt.startswith("First.\nImitate")
    assert np.array_equal(np.frombuffer(init.ref_audio, "<f4"), voice)
    for bad, match in (
        ("text", "must be a list"),
        ([{"type": "video"}], r"system_content\[0\] must be"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": 3}], r"\[1\].text"),
        ([{"type": "audio", "data": "%%%"}], r"system_content\[0\].data"),
    ):
        with pytest.raises(errors.InvalidPayload, match=match):
            prepare(bad)


def test_realtime_events_are_numbered_and_a_resume_replays_what_was_missed():
    d = realtime.RealtimeDuplex("audio")
    [init] = d.decode(_frame({"type": "session.init", "payload": {}}))
    created = d.encode(ev.Created("rt_1", 10, (), "tok", 30.0))
    assert created[0]["seq"] == 1 and created[0]["resume_token"] == "tok"
    assert created[0]["resume_window_s"] == 30.0
    outputs = [
        _out(seq=1, is_listen=True, text="", pcm=b""),
        _out(seq=2, text="Hi", end_of_turn=False),
        _out(seq=3, text="there", end_of_turn=True),
    ]
    sent = [m for out in outputs for m in d.encode(out)]
    assert [m["seq"] for m in sent] == list(range(2, 2 + len(sent)))
    state = d.client_state()

    # A new edge rebuilds the numbering from the outputs and sends what came after 3.
    again = realtime.RealtimeDuplex("audio", "tok", "3")
    assert again.refusal() is None and again.last_seq == 3
    reattached = ev.Reattached("rt_1", 10, (), state, tuple(outputs), "tok", 30.0)
    resumed, *missed = again.replay(reattached)
    assert resumed == {
        "type": "session.resumed",
        "session_id": "rt_1",
        "last_seq": 3,
        "replayed": len(sent) - 2,
        "last_input_seq": 0,
        "resume_token": "tok",
        "resume_window_s": 30.0,
    }
    assert missed == sent[2:]  # the same events, the same seqs and response ids
    [nxt] = again.encode(_out(seq=4, is_listen=True, text="", pcm=b""))
    assert nxt["seq"] == sent[-1]["seq"] + 1
    # Speech no longer kept cannot be replayed: the resume is refused, not silently cut.
    gone = replace(outputs[1], pcm=b"", audio_dropped=True)
    late = realtime.RealtimeDuplex("audio", "tok", "1")
    late.refusal()
    with pytest.raises(errors.ResumeExpired):
        late.replay(ev.Reattached("rt_1", 10, (), state, (outputs[0], gone), "tok", 30.0))
    # ... but what the client already has may be gone.
    early = realtime.RealtimeDuplex("audio", "tok", str(sent[-1]["seq"]))
    early.refusal()
    reattached = ev.Reattached("rt_1", 10, (), state, (outputs[0], gone, outputs[2]), "tok", 30)
    assert early.replay(reattached)[0]["replayed"] == 0
    bad = realtime.RealtimeDuplex("audio", "tok", "-1")
    assert bad.refusal().code == "invalid_payload"


def test_half_duplex_answers_stop_at_256_tokens_unless_asked():
    """The reference server's default max_new_tokens (256) when the call sets none: the
    worker's cap of each answer."""
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    [init] = HalfDuplex("hd_1").decode(_frame({"type": "prepare"}))
    assert init.config.max_tokens == 256 and init.config.half_duplex is True


def test_half_duplex_stop_turn_sends_one_force_listen_unit_while_answering():
    """POST /api/half_duplex/stop: one force_listen unit while the model answers (the
    worker's next piece takes it), nothing otherwise; the answer needs no unit per piece."""
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    d = HalfDuplex("hd_1")
    d.decode(_frame({"type": "prepare"}))
    assert d.stop_turn() == []
    d.encode(_out(seq=4, n_tokens=2))
    assert d.after_output(_out(seq=4)) == [ev.ClearAudioCommand()]
    assert d.stop_turn() == [ev.EndTurnCommand()]  # the cadence's silent force_listen unit
    [*_, done] = d.encode(_out(seq=5, is_listen=True, text="", pcm=b"", end_of_turn=True))
    assert done["type"] == "turn_done" and d.stop_turn() == []


def test_half_duplex_speech_in_chunks_heard_together_sets_vad_state():
    """A slow engine hears waiting chunks as one unit, answering the others as buffered (no
    event): speech in any of them still turns vad_state on with the unit's result."""
    from omnifabric.edge.dialects.half_duplex import HalfDuplex

    d = HalfDuplex("hd_1")
    d.decode(_frame({"type": "prepare"}))
    loud = ev.AppendCommand(pcm=np.full(8000, 0.1, "<f4").tobytes())
    quiet = ev.AppendCommand(pcm=np.zeros(8000, "<f4").tobytes())
    d.appended(1, loud)
    d.appended(2, quiet)  # 1 and 2 were heard with 2: only 2's result comes
    assert d.encode(_out(seq=2, is_listen=True, text="", pcm=b"")) == [
        {"type": "vad_state", "speaking": True}
    ]
    d.appended(3, quiet)
    assert d.encode(_out(seq=3, is_listen=True, text="", pcm=b"")) == []


def test_a_sampling_seed_reaches_the_worker_config_and_bad_ones_are_refused():
    from omnifabric.edge.worker_client import config_to
    from omnifabric.worker.service import decode_settings

    settings = fields.duplex_settings({"seed": 1234, "temperature": 0.7})
    assert settings.seed == 1234 and config_to(settings).seed == 1234
    assert decode_settings(config_to(settings), 1).seed == 1234  # what the engine gets
    assert fields.duplex_settings({}).seed is None
    assert not config_to(fields.duplex_settings({})).HasField("seed")
    for bad in (-1, 1 << 63, 1.5, "7"):
        with pytest.raises(errors.InvalidPayload, match="config.seed"):
            fields.duplex_settings({"seed": bad})
