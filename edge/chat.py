"""Turn-based chat at the edge, without I/O: the chat commands and turn events the chat
dialects translate, and the request validator. The turn itself (a worker slot for the
turn only) is edge.session.run_turn, driven by edge.connection.ChatConnection for
/v1/realtime?mode=chat, /ws/chat and POST /api/chat."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifabric.common.close_reasons import SERVER_SHUTDOWN, close_message
from omnifabric.edge import events as ev
from omnifabric.edge import pcm
from omnifabric.edge.errors import InvalidPayload, MissingField
from omnifabric.edge.fields import flag, integer_field, number_field, obj
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb

log = logging.getLogger("omnifabric.edge.chat")

ROLES = ("system", "user", "assistant")
TTS_MODES = ("default", "audio_assistant", "omni", "audio_roleplay", "voice_cloning")
#: Limits of one chat request (documented in the README).
MAX_MESSAGES = 64
MAX_AUDIO_SECONDS = 120
MAX_NEW_TOKENS = 4096
MAX_VIDEO_FRAMES = 64
#: What a client is told when the edge drains (the one sentence of server_shutdown).
SHUTDOWN_MESSAGE = close_message(SERVER_SHUTDOWN)


@dataclass(frozen=True)
class ChatInput:
    """A validated chat request, ready for the worker."""

    request: worker_pb.ChatRequest
    streaming: bool
    speech: bool
    notes: tuple[str, ...] = ()
    """Accepted fields that have no effect at the edge or on any engine, and why."""


@dataclass
class ChatResult:
    """What one turn produced."""

    text: str = ""
    audio: list[bytes] = field(default_factory=list)
    input_tokens: int = 0
    generated_tokens: int = 0
    usage: ev.Usage = field(default_factory=ev.Usage)
    reason: str = "turn_end"
    ignored: tuple[str, ...] = ()
    timings_ms: dict[str, float] = field(default_factory=dict)


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
class TurnDone:
    result: ChatResult


@dataclass(frozen=True)
class Shutdown:
    """The edge drains: the connection ends with 1001, "going away" (RFC 6455 7.4.1)."""

    close_code = 1001
    reason = SERVER_SHUTDOWN


TurnEvent = TurnStarted | TurnQueued | TurnLeased | TurnPrefilled | TurnDelta | TurnDone


def _image(data: object, where: str) -> bytes:
    """A base64 image file (JPEG, PNG, ...), verified by the image parser."""
    from PIL import Image, UnidentifiedImageError

    raw = pcm.b64decode(data, where)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise InvalidPayload(f"{where} is not a readable image") from None
    return raw


def _audio(item: dict[str, Any], where: str) -> bytes:
    """base64 float32 PCM at `sample_rate` (default 16000) -> float32 16 kHz bytes."""
    raw = pcm.b64decode(item.get("data"), f"{where}.data")
    if len(raw) % 4:
        raise InvalidPayload(f"{where}.data is not a whole number of float32 samples")
    rate = integer_field(item, "sample_rate", 4000, 192000, where) or 16000
    audio = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(audio).all():
        raise InvalidPayload(f"{where}.data: samples must be finite numbers")
    if audio.size / rate > MAX_AUDIO_SECONDS:
        raise InvalidPayload(f"{where}: at most {MAX_AUDIO_SECONDS} s of audio per part")
    return pcm.resample(audio, rate, 16000).astype("<f4").tobytes()


def _video(item: dict[str, Any], where: str) -> list[worker_pb.ContentPart]:
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
    parts = [worker_pb.ContentPart(image=f) for f in frames]
    if audio:
        pcm16k = np.concatenate(audio)[: MAX_AUDIO_SECONDS * 16000]
        parts.append(worker_pb.ContentPart(audio_pcm=pcm16k.astype("<f4").tobytes()))
    return parts


def _parts(content: object, where: str) -> list[worker_pb.ContentPart]:
    if isinstance(content, str):
        return [worker_pb.ContentPart(text=content)]
    if not isinstance(content, list):
        raise InvalidPayload(f"{where}.content must be a string or a list of parts")
    parts = []
    for j, item in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(item, dict):
            raise InvalidPayload(f"{at} must be an object")
        kind = item.get("type")
        if kind == "text":
            if not isinstance(item.get("text"), str):
                raise MissingField(f"{at}.text is required")
            parts.append(worker_pb.ContentPart(text=item["text"]))
        elif kind == "image":
            parts.append(worker_pb.ContentPart(image=_image(item.get("data"), f"{at}.data")))
        elif kind == "audio":
            parts.append(worker_pb.ContentPart(audio_pcm=_audio(item, at)))
        elif kind == "video":
            parts.extend(_video(item, at))
        else:
            raise InvalidPayload(f"{at}.type must be text, image, audio or video")
    return parts


def parse_chat(body: dict[str, Any]) -> ChatInput:
    """Validate a chat request body (messages, streaming, generation, tts, image, omni_mode,
    enable_thinking). Raises MissingField / InvalidPayload naming the field."""
    messages = body.get("messages")
    if messages is None:
        raise MissingField("'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidPayload("'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise InvalidPayload(f"at most {MAX_MESSAGES} messages per request")
    request = worker_pb.ChatRequest()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPayload(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidPayload(f"messages[{i}].role must be system, user or assistant")
        if "content" not in message:
            raise MissingField(f"messages[{i}].content is required")
        request.messages.append(
            worker_pb.ChatMessage(role=role, parts=_parts(message["content"], f"messages[{i}]"))
        )
    if request.messages[-1].role != "user":
        raise InvalidPayload("the last message must be the user's")
    streaming = body.get("streaming", True)
    if not isinstance(streaming, bool):
        raise InvalidPayload("'streaming' must be true or false")
    gen = obj(body, "generation")
    g = request.generation
    if (n := integer_field(gen, "max_new_tokens", 1, MAX_NEW_TOKENS, "generation")) is not None:
        g.max_new_tokens = n
    if (x := number_field(gen, "temperature", 0.0, 5.0, "generation")) is not None:
        g.temperature = x
    if (x := number_field(gen, "top_p", 0.0, 1.0, "generation")) is not None:
        g.top_p = x
    if (x := number_field(gen, "length_penalty", 0.0, 10.0, "generation")) is not None:
        g.length_penalty = x
    tts = obj(body, "tts")
    enabled = flag(tts, "enabled", "tts")
    request.tts.enabled = True if enabled is None else enabled
    mode = tts.get("mode", "default")
    if mode not in TTS_MODES:
        raise InvalidPayload(f"tts.mode must be one of {', '.join(TTS_MODES)}")
    request.tts.mode = mode
    notes = []
    if tts.get("ref_audio_data"):
        request.tts.ref_audio_pcm = pcm.reference_audio(tts["ref_audio_data"], "tts.ref_audio_data")
    elif tts.get("ref_audio_path"):
        if not isinstance(tts["ref_audio_path"], str):
            raise InvalidPayload("tts.ref_audio_path must be a string")
        notes.append("tts.ref_audio_path: server-side paths are not read (send ref_audio_data)")
    if tts.get("language") is not None:
        if not isinstance(tts["language"], str):
            raise InvalidPayload("tts.language must be a string")
        request.tts.language = tts["language"]
    image = obj(body, "image")
    if (v := integer_field(image, "max_slice_nums", 1, 16, "image")) is not None:
        request.image.max_slice_nums = v
    if (v := flag(image, "use_image_id", "image")) is not None:
        request.image.use_image_id = v
    request.omni_mode = bool(flag(body, "omni_mode", ""))
    request.enable_thinking = bool(flag(body, "enable_thinking", ""))
    return ChatInput(request, streaming, request.tts.enabled, tuple(notes))


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
