"""Turn-based chat at the edge, without I/O: the chat commands and turn events the chat
dialects translate, and the request validator. The turn itself (a worker slot for the
turn only) is edge.session.run_turn, driven by edge.connection.ChatConnection for
/v1/realtime?mode=chat, /ws/chat and POST /api/chat. A validated request is plain data;
edge.worker_client turns it into the worker's ChatRequest."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifabric.common.close_reasons import SERVER_SHUTDOWN, close_message
from omnifabric.common.tools import ToolCall
from omnifabric.edge import events as ev
from omnifabric.edge import pcm
from omnifabric.edge.chat_input import (
    AudioPart,
    ChatInput,
    ChatMessage,
    Generation,
    ImageOptions,
    ImagePart,
    Part,
    TextPart,
    TtsOptions,
)
from omnifabric.edge.errors import InvalidPayload, MissingField
from omnifabric.edge.fields import flag, integer_field, number_field, obj

log = logging.getLogger("omnifabric.edge.chat")

ROLES = ("system", "user", "assistant")
TTS_MODES = ("default", "audio_assistant", "omni", "audio_roleplay", "voice_cloning")
#: Limits of one chat request (documented in docs/protocol.md, Chat and Limits).
MAX_MESSAGES = 64
MAX_AUDIO_SECONDS = 120
MAX_NEW_TOKENS = 4096
MAX_VIDEO_FRAMES = 64
#: What a client is told when the edge drains (the one sentence of server_shutdown).
SHUTDOWN_MESSAGE = close_message(SERVER_SHUTDOWN)


@dataclass
class ChatResult:
    """What one turn produced."""

    text: str = ""
    audio: list[bytes] = field(default_factory=list)
    input_tokens: int = 0
    generated_tokens: int = 0
    usage: ev.Usage = field(default_factory=ev.Usage)
    reason: str = "turn_end"
    """turn_end, max_tokens, or tool_calls (common.tools.TOOL_CALLS)."""
    ignored: tuple[str, ...] = ()
    timings_ms: dict[str, float] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)


# ---- what the chat dialects translate --------------------------------------------


@dataclass(frozen=True)
class ChatOpen:
    """The client opened the session (realtime chat's session.init)."""


@dataclass(frozen=True)
class ChatTurn:
    """A chat request (the JSON body, validated by parse_chat off the event loop)."""

    body: dict[str, Any]


@dataclass(frozen=True)
class ChatClose:
    """The client ends the session."""

    reason: str = "user_stop"


@dataclass(frozen=True)
class TurnStarted:
    streaming: bool
    speech: bool


@dataclass(frozen=True)
class TurnQueued:
    queued: ev.Queued


@dataclass(frozen=True)
class TurnLeased:
    waited: bool
    """The turn had to queue first."""


@dataclass(frozen=True)
class TurnPrefilled:
    input_tokens: int


@dataclass(frozen=True)
class TurnDelta:
    text: str
    pcm: bytes


@dataclass(frozen=True)
class TurnToolCall:
    """The reply calls a function (after its text, before TurnDone)."""

    call: ToolCall


@dataclass(frozen=True)
class TurnDone:
    result: ChatResult


@dataclass(frozen=True)
class Shutdown:
    """The edge drains: the connection ends with 1001, "going away" (RFC 6455 7.4.1)."""

    close_code = 1001
    reason = SERVER_SHUTDOWN


TurnEvent = (
    TurnStarted | TurnQueued | TurnLeased | TurnPrefilled | TurnDelta | TurnToolCall | TurnDone
)


def image_file(data: object, where: str) -> bytes:
    """A base64 image file (JPEG, PNG, ...), verified (``pcm.check_image``)."""
    return pcm.check_image(pcm.b64decode(data, where), where)


def _audio(item: dict[str, Any], where: str) -> bytes:
    """base64 float32 PCM at `sample_rate` (default 16000), or a WAV file (its header says
    its rate; edge.pcm.wav_to_pcm16k) -> float32 16 kHz bytes, through the low-pass
    resampler."""
    raw = pcm.b64decode(item.get("data"), f"{where}.data")
    if raw[:4] == b"RIFF":  # as float32, "RIFF" is 1.3e4: never a sample of audio
        decoded = pcm.wav_to_pcm16k(raw, f"{where}.data")
        check_audio_seconds(len(decoded) / 4 / 16000, where)
        return decoded
    if len(raw) % 4:
        raise InvalidPayload(f"{where}.data is not a whole number of float32 samples")
    rate = integer_field(item, "sample_rate", 4000, 192000, where) or 16000
    audio = np.frombuffer(pcm.check_finite(raw, f"{where}.data"), dtype="<f4")
    check_audio_seconds(audio.size / rate, where)
    return pcm.resample(audio, rate, 16000).astype("<f4").tobytes()


def check_audio_seconds(seconds: float, where: str) -> None:
    """One audio part of a chat request holds at most MAX_AUDIO_SECONDS."""
    if seconds > MAX_AUDIO_SECONDS:
        raise InvalidPayload(f"{where}: at most {MAX_AUDIO_SECONDS} s of audio per part")


def check_message_count(n: int) -> None:
    if n > MAX_MESSAGES:
        raise InvalidPayload(f"at most {MAX_MESSAGES} messages per request")


def check_messages(messages: tuple[ChatMessage, ...]) -> None:
    """A chat request's conversation: at most MAX_MESSAGES, the user's last (or a
    function's output, which the reply goes on from)."""
    check_message_count(len(messages))
    if not messages or messages[-1].role not in ("user", "tool"):
        raise InvalidPayload("the last message must be the user's")


def _video(item: dict[str, Any], where: str) -> list[Part]:
    """A base64 video file -> one JPEG frame per second (at most MAX_VIDEO_FRAMES) and its
    audio track as 16 kHz mono float32. Blocking: callers run parse_chat off the loop."""
    import av

    raw = pcm.b64decode(item.get("data"), f"{where}.data")
    integer_field(item, "stack_frames", 1, 8, where)  # accepted; one frame per second
    frames: list[bytes] = []
    audio: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(raw), "r") as container:
            if not container.streams.video:
                raise InvalidPayload(f"{where}.data has no video stream")
            next_t = 0.0
            for frame in container.decode(video=0):
                t = float(frame.time or 0.0)
                if t + 1e-6 >= next_t and len(frames) < MAX_VIDEO_FRAMES:
                    buf = io.BytesIO()
                    frame.to_image().convert("RGB").save(buf, "JPEG", quality=90)
                    frames.append(buf.getvalue())
                    next_t = t + 1.0
        with av.open(io.BytesIO(raw), "r") as container:
            if container.streams.audio:
                resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
                for sound in container.decode(audio=0):
                    for out in resampler.resample(sound):
                        audio.append(out.to_ndarray().reshape(-1).astype(np.float32))
    except InvalidPayload:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise InvalidPayload(f"{where}.data is not a readable video ({exc})") from None
    if not frames:
        raise InvalidPayload(f"{where}.data has no decodable frames")
    parts: list[Part] = [ImagePart(f) for f in frames]
    if audio:
        pcm16k = np.concatenate(audio)[: MAX_AUDIO_SECONDS * 16000]
        parts.append(AudioPart(pcm16k.astype("<f4").tobytes()))
    return parts


def _parts(content: object, where: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise InvalidPayload(f"{where}.content must be a string or a list of parts")
    parts: list[Part] = []
    for j, item in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(item, dict):
            raise InvalidPayload(f"{at} must be an object")
        kind = item.get("type")
        if kind == "text":
            if not isinstance(item.get("text"), str):
                raise MissingField(f"{at}.text is required")
            parts.append(TextPart(item["text"]))
        elif kind == "image":
            parts.append(ImagePart(image_file(item.get("data"), f"{at}.data")))
        elif kind == "audio":
            parts.append(AudioPart(_audio(item, at)))
        elif kind == "video":
            parts.extend(_video(item, at))
        else:
            raise InvalidPayload(f"{at}.type must be text, image, audio or video")
    return tuple(parts)


def parse_chat(body: dict[str, Any]) -> ChatInput:
    """Validate a chat request body (messages, streaming, generation, tts, image, omni_mode,
    enable_thinking). Raises MissingField / InvalidPayload naming the field."""
    messages = body.get("messages")
    if messages is None:
        raise MissingField("'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidPayload("'messages' must be a non-empty list")
    check_message_count(len(messages))  # before any is decoded
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPayload(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidPayload(f"messages[{i}].role must be system, user or assistant")
        if "content" not in message:
            raise MissingField(f"messages[{i}].content is required")
        parsed.append(ChatMessage(role, _parts(message["content"], f"messages[{i}]")))
    check_messages(tuple(parsed))
    streaming = body.get("streaming", True)
    if not isinstance(streaming, bool):
        raise InvalidPayload("'streaming' must be true or false")
    gen = obj(body, "generation")
    generation = Generation(
        max_new_tokens=integer_field(gen, "max_new_tokens", 1, MAX_NEW_TOKENS, "generation"),
        temperature=number_field(gen, "temperature", 0.0, 5.0, "generation"),
        top_p=number_field(gen, "top_p", 0.0, 1.0, "generation"),
        length_penalty=number_field(gen, "length_penalty", 0.0, 10.0, "generation"),
    )
    tts = obj(body, "tts")
    enabled = flag(tts, "enabled", "tts")
    mode = tts.get("mode", "default")
    if mode not in TTS_MODES:
        raise InvalidPayload(f"tts.mode must be one of {', '.join(TTS_MODES)}")
    notes = []
    ref_audio = b""
    # Absent or "": no voice. Any other value is checked ([] or 0 is no voice either).
    if tts.get("ref_audio_data") not in (None, ""):
        ref_audio = pcm.reference_audio(tts["ref_audio_data"], "tts.ref_audio_data")
    elif tts.get("ref_audio_path") not in (None, ""):
        if not isinstance(tts["ref_audio_path"], str):
            raise InvalidPayload("tts.ref_audio_path must be a string")
        notes.append("tts.ref_audio_path: server-side paths are not read (send ref_audio_data)")
    language = tts.get("language")
    if language is not None and not isinstance(language, str):
        raise InvalidPayload("tts.language must be a string")
    image = obj(body, "image")
    images = ImageOptions(
        max_slice_nums=integer_field(image, "max_slice_nums", 1, 16, "image"),
        use_image_id=flag(image, "use_image_id", "image"),
    )
    return ChatInput(
        messages=tuple(parsed),
        streaming=streaming,
        generation=generation,
        tts=TtsOptions(
            enabled=True if enabled is None else enabled,
            mode=mode,
            ref_audio=ref_audio,
            language=language,
        ),
        image=images,
        omni_mode=bool(flag(body, "omni_mode", "")),
        enable_thinking=bool(flag(body, "enable_thinking", "")),
        notes=tuple(notes),
    )


def metrics_json(result: ChatResult) -> dict[str, Any]:
    """A turn's timings and token counts, as the chat dialects report them."""
    metrics: dict[str, Any] = {k: round(v, 2) for k, v in result.timings_ms.items()}
    metrics["input_tokens"] = result.input_tokens
    metrics["generated_tokens"] = result.generated_tokens
    if result.ignored:
        metrics["ignored"] = list(result.ignored)
    return metrics


def add_usage(a: ev.Usage, b: ev.Usage) -> ev.Usage:
    """Cumulative session usage."""
    return ev.Usage(**{k: getattr(a, k) + getattr(b, k) for k in a.__dataclass_fields__})


def wav_base64(chunks: list[bytes]) -> str:
    """The reply audio (float32 24 kHz chunks) as a base64 16-bit WAV file."""
    import base64
    import wave

    audio = np.frombuffer(b"".join(chunks), dtype="<f4") if chunks else np.zeros(0, "<f4")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode("ascii")
