"""Every place of every event of the MiniCPM-o dialects (realtime duplex and chat, the legacy
duplex and chat endpoints, half-duplex, POST /api/chat) given each odd value of the
protocol fuzz and each deep nesting of the OpenAI one, one case each: only client errors
come out, and what is taken becomes the worker's protobuf (a chat turn through parse_chat
first, as the connection does). The OpenAI dialect's own: test_openai_fuzz.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omnifabric.edge import codec, worker_client
from omnifabric.edge import events as ev
from omnifabric.edge.chat import ChatTurn, parse_chat
from omnifabric.edge.dialects.base import ChatDialect, DuplexDialect
from omnifabric.edge.dialects.half_duplex import HalfDuplex
from omnifabric.edge.dialects.http_chat import HttpChat
from omnifabric.edge.dialects.legacy_chat import LegacyChat
from omnifabric.edge.dialects.legacy_duplex import LegacyDuplex
from omnifabric.edge.dialects.realtime import RealtimeDuplex
from omnifabric.edge.dialects.realtime_chat import RealtimeChat
from omnifabric.edge.errors import ClientError, EdgeError
from tests.fuzz.test_openai_fuzz import DEEP, _at, places, replaced
from tests.fuzz.test_protocol_fuzz import ODD_VALUES, _small_jpeg, encode

pytestmark = pytest.mark.ci_long  # 14,476 cases: ~18 s (tests/conftest.py)

SECOND = base64.b64encode(np.zeros(16000, "<f4").tobytes()).decode()
VOICE = base64.b64encode((np.sin(np.arange(16000) / 5) * 0.1).astype("<f4").tobytes()).decode()
JPEG = base64.b64encode(_small_jpeg()).decode()
#: Every duplex setting a config takes (fields.duplex_settings and the dialects' own).
CONFIG = {
    "length_penalty": 1.0,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "listen_prob_scale": 1.0,
    "force_listen_count": 1,
    "max_new_speak_tokens_per_chunk": 20,
    "max_kv_tokens": 4096,
    "tts_enabled": True,
    "max_tokens": 100,
    "vad_threshold": 0.5,
    "min_speech_ms": 200,
    "end_of_turn_silence_ms": 500,
    "seed": 1,
    "context_window": "basic",
    "window_high_tokens": 4000,
    "window_low_tokens": 3000,
    "window_units": 4,
    "window_previous_tokens": 100,
    "speech_cuts": False,
    "vision_hd": False,
    "generate_audio": True,
}
USER = [{"type": "text", "text": "hi"}, {"type": "audio", "data": SECOND}]
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*USER, {"type": "image", "data": JPEG}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And?"},
    ],
    "streaming": True,
    "generation": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.8, "length_penalty": 1.0},
    "tts": {"enabled": True, "mode": "default", "ref_audio_data": VOICE, "language": "en"},
    "image": {"max_slice_nums": 2, "use_image_id": True},
    "omni_mode": False,
    "enable_thinking": False,
}
HALF_DUPLEX_CONFIG = {
    "session": {"timeout_s": 60},
    "generation": {"temperature": 0.7, "max_new_tokens": 10, "top_k": 5},
    "vad": {"threshold": 0.5, "min_speech_duration_ms": 100, "min_silence_duration_ms": 500},
    "tts": {"enabled": True},
}


def chat_opened() -> RealtimeChat:
    d = RealtimeChat()
    d.decode(json.dumps({"type": "session.init", "payload": {}}))
    return d


#: Each dialect as its route opens it, and one valid message of each kind it takes.
DIALECTS: dict[str, tuple[Callable[[], DuplexDialect | ChatDialect], list[dict[str, Any]]]] = {
    "realtime": (
        lambda: RealtimeDuplex("video", "", ""),
        [
            {
                "type": "session.init",
                "payload": {
                    "system_prompt": "x",
                    "config": CONFIG,
                    "max_slice_nums": 2,
                    "voice": {"ref_audio_base64": VOICE, "tts_ref_audio_base64": VOICE},
                },
            },
            {
                "type": "session.update",
                "session": {"instructions": "x", "config": CONFIG, "ref_audio": VOICE},
            },
            {
                "type": "input.append",
                "input": {"audio": SECOND, "video_frames": [JPEG], "force_listen": False},
            },
            {"type": "input_audio_buffer.append", "audio": SECOND, "video_frames": [JPEG]},
            {"type": "session.close", "reason": "bye"},
        ],
    ),
    "realtime_chat": (
        chat_opened,
        [{"type": "input.append", "input": CHAT}, {"type": "session.close", "reason": "bye"}],
    ),
    "legacy_duplex": (
        lambda: LegacyDuplex("omni_1"),
        [
            {
                "type": "prepare",
                "system_prompt": "x",
                "config": CONFIG,
                "max_slice_nums": 1,
                "ref_audio_base64": VOICE,
                "tts_ref_audio_base64": VOICE,
            },
            {"type": "audio_chunk", "audio_base64": SECOND, "frame_base64_list": [JPEG]},
            {"type": "pause", "timeout": 5},
            {"type": "client_diagnostic", "x": 1},
        ],
    ),
    "half_duplex": (
        lambda: HalfDuplex("hd_1"),
        [
            {
                "type": "prepare",
                "system_prompt": "x",
                "ref_audio_base64": VOICE,
                "system_content": [{"type": "text", "text": "a"}, {"type": "audio", "data": VOICE}],
                "config": HALF_DUPLEX_CONFIG,
            },
            {"type": "audio_chunk", "audio_base64": SECOND},
        ],
    ),
    "legacy_chat": (LegacyChat, [CHAT]),
    "http_chat": (HttpChat, [CHAT]),
}


def handled(d: DuplexDialect | ChatDialect, text: str) -> str:
    """One message as the connection handles it: "taken" or "refused"; anything but a client
    error raised fails the test."""
    try:
        commands = d.decode(text.encode() if isinstance(d, HttpChat) else text)
        for cmd in commands:
            if isinstance(cmd, ChatTurn):  # validated off the event loop, then sent
                cmd = ev.TurnCommand(chat=parse_chat(cmd.body))
            built(cmd)
    except EdgeError as err:
        assert isinstance(err, ClientError), (type(err), err)
        answer = d.error(err)
        if isinstance(answer, dict):
            json.loads(codec.dumps(answer))
        return "refused"
    return "taken"


def built(cmd: Any) -> None:
    lease = worker_client.Lease("lease_1", "w", "127.0.0.1:1")
    if isinstance(cmd, ev.InitCommand):
        worker_client.start_request(lease, "s", "audio", cmd).SerializeToString()
    elif isinstance(cmd, ev.AppendCommand):
        worker_client.unit_request(1, cmd).SerializeToString()
    elif isinstance(cmd, ev.TurnCommand):
        assert cmd.chat is not None
        worker_client.chat_request(cmd.chat, "lease_1", "s").SerializeToString()
    elif isinstance(cmd, ev.SendCommand):
        for message in cmd.messages:
            json.loads(codec.dumps(message))


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_every_place_of_every_message_takes_odd_values(name):
    make, messages = DIALECTS[name]
    for message in messages:
        assert handled(make(), json.dumps(message)) == "taken", message
    outcomes = {"taken": 0, "refused": 0}
    for message in messages:
        objects = [p for p in [(), *places(message)] if isinstance(_at(message, p), dict)]
        for path in [*places(message), *((*p, "x") for p in objects)]:
            for value in [*DEEP, *ODD_VALUES]:
                outcomes[handled(make(), encode(replaced(message, path, value)))] += 1
    assert outcomes["taken"] and outcomes["refused"], outcomes
