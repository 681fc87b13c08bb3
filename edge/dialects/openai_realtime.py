"""The OpenAI Realtime API (its GA form, as the `openai` Python SDK 3.x speaks it) on
/v1/realtime?model=..., so clients written for it talk to omnifabric unchanged.

`AsyncOpenAI(base_url="http://HOST:PORT/v1", api_key=KEY).realtime.connect(model=M)` opens
`ws://HOST:PORT/v1/realtime?model=M` with `Authorization: Bearer KEY` (browsers offer the
`realtime` and `openai-insecure-api-key.KEY` subprotocols instead). The MiniCPM-o protocol
on the same path always names its `mode=`; a URL with `model=` and no `mode=` is this one.

How the protocol maps onto the fabric:
- `session.created` goes out on connect; `session.update` is answered by `session.updated`.
  What the engine cannot honour (tools, a transcription model, noise reduction, a speed,
  an unregistered voice, ...) is said once, as an `error` of type `invalid_request_error`
  with code `unsupported_parameter` and its `param`; the session goes on.
- With turn detection on (`server_vad`, the default, or `semantic_vad`) the conversation
  is a full-duplex session of the engine: the first `input_audio_buffer.append` queues it
  for a worker (nothing is sent while it waits: the queue API shows the position) and
  starts it with the session's settings. The client's audio (24 kHz PCM16, or 8 kHz G.711)
  is cut into the worker's units (1 s) and sent one at a time, the next when the last one
  was answered; when the client sends less than real time (it stopped streaming, or pauses)
  the edge fills the rest of the second with silence, so the session's clock never stops
  and a reply never waits for more input. The engine's own turn-taking drives the events:
  `speech_started` (input louder than the half-duplex call's speech level), then, when the
  engine starts to answer, `speech_stopped`, `committed`, the user item (with what the
  engine heard as its transcript, when it says), and the response's events; speech heard
  during a reply that then stops ends it `cancelled` (`turn_detected`).
- With turn detection null, turns are the client's: `commit` makes a user item of the
  buffer, `conversation.item.create` adds text, audio or image items, `response.create`
  answers the conversation as one chat turn (edge.chat: a worker slot for the turn only,
  the conversation kept here), with per-response instructions, modalities and token cap.
  A text item and `response.create` work the same way before any audio in a session with
  turn detection on; once its duplex session runs, replies are the engine's to make.
- Errors have OpenAI's shape; a malformed or unknown event gets one and the session goes on.
"""

from __future__ import annotations

import binascii
import dataclasses
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifabric.edge import codec, fields, g711, pcm
from omnifabric.edge import events as ev
from omnifabric.edge.chat import (
    MAX_AUDIO_SECONDS,
    MAX_NEW_TOKENS,
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnStarted,
)
from omnifabric.edge.dialects.base import DuplexDialect
from omnifabric.edge.dialects.half_duplex import SPEECH_RMS
from omnifabric.edge.errors import EdgeError, InvalidEvent, InvalidPayload, UnknownEvent

#: Audio formats: `type` -> (sample rate, bytes a sample).
FORMATS = {"audio/pcm": (24000, 2), "audio/pcmu": (8000, 1), "audio/pcma": (8000, 1)}
#: The rate the engine hears and the rate it speaks.
ENGINE_IN_RATE, ENGINE_OUT_RATE = 16000, 24000
#: The unit the edge cuts the client's stream into (16 kHz samples), within the worker's
#: bounds: one second, as the duplex models take it.
UNIT_SAMPLES = 16000
#: How late the client's audio may be before the edge fills the second with silence.
FILL_GRACE_S = 0.25
#: A unit unanswered this many unit lengths no longer holds the next one back.
IN_FLIGHT_UNITS = 2.0
#: Audio waiting for the engine at most (seconds); older audio is dropped (counted).
MAX_BACKLOG_S = 10.0
TURN_DETECTION = ("server_vad", "semantic_vad")
#: Turn detection settings the engine's own turn-taking has no use for.
TURN_DETECTION_EXTRAS = (
    "prefix_padding_ms",
    "create_response",
    "interrupt_response",
    "idle_timeout_ms",
    "eagerness",
)
#: Accepted and not used: said once when set.
UNSUPPORTED = {
    "tools": "function calling is not supported by this server's engines",
    "tool_choice": "function calling is not supported by this server's engines",
    "tracing": "traces are the server's own (OpenTelemetry), not per-session settings",
    "prompt": "stored prompts are not available: send instructions",
    "include": "log probabilities are not available",
    "truncation": "the engine keeps its own context (closes with context_full when full)",
    "audio.input.transcription": "the engine's own transcript is reported when it has one",
    "audio.input.noise_reduction": "no noise reduction is applied",
    "audio.output.speed": "the engine speaks at its own speed",
    "audio.input.turn_detection.prefix_padding_ms": "the engine keeps its own margins",
    "audio.input.turn_detection.create_response": "the duplex engine decides when to answer",
    "audio.input.turn_detection.interrupt_response": "the duplex engine decides when to yield",
    "audio.input.turn_detection.idle_timeout_ms": "no idle timeout: the engine decides",
    "audio.input.turn_detection.eagerness": "the engine's own turn-taking decides",
}
SESSION_KEYS = {
    "type",
    "model",
    "instructions",
    "output_modalities",
    "audio",
    "max_output_tokens",
    *(k for k in UNSUPPORTED if "." not in k),
}
#: The event that says what is accepted and not used (no OpenAI event says it).
NOTICE = "omnifabric.notice"
#: Voice names that mean the server's default voice.
DEFAULT_VOICES = ("", "default")
#: Settings a running duplex session cannot take (it started with them).
LOCKED = ("instructions", "output_modalities", "voice", "turn_detection")


def _format(value: Any, where: str) -> str:
    """An audio format object ({type, rate}) -> its type; InvalidPayload otherwise."""
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise InvalidPayload(f"{where}.type must be one of {', '.join(FORMATS)}")
    rate = value.get("rate")
    if rate is not None and rate != FORMATS[value["type"]][0]:
        raise InvalidPayload(f"{where}.rate: {value['type']} is {FORMATS[value['type']][0]} Hz")
    return str(value["type"])


def format_json(kind: str) -> dict[str, Any]:
    return {"type": kind, "rate": FORMATS[kind][0]} if kind == "audio/pcm" else {"type": kind}


def decode_audio(data: bytes, kind: str) -> np.ndarray:
    """Client audio bytes in `kind` -> float32 samples at its rate."""
    if kind == "audio/pcmu":
        samples = g711.mulaw_decode(data)
    elif kind == "audio/pcma":
        samples = g711.alaw_decode(data)
    else:
        samples = np.frombuffer(data[: len(data) - len(data) % 2], dtype="<i2")
    return samples.astype(np.float32) / 32768.0


def encode_audio(pcm24k_f32: bytes, kind: str) -> bytes:
    """The engine's speech (float32 24 kHz) -> bytes in `kind`."""
    audio = np.frombuffer(pcm24k_f32, dtype="<f4")
    rate = FORMATS[kind][0]
    if rate != ENGINE_OUT_RATE:
        audio = pcm.resample(audio, ENGINE_OUT_RATE, rate)
    samples = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    if kind == "audio/pcmu":
        return g711.mulaw_encode(samples)
    if kind == "audio/pcma":
        return g711.alaw_encode(samples)
    return samples.tobytes()


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidPayload(f"{where} must be a base64 string")
    try:
        return codec.b64decode(value)
    except (binascii.Error, ValueError):
        raise InvalidPayload(f"{where} base64 decode failed") from None


@dataclass
class Settings:
    """The session's settings as the client last set them."""

    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: dict[str, Any] | None = field(default_factory=lambda: {"type": "server_vad"})
    voice: str = ""
    max_output_tokens: int | None = None


@dataclass
class Item:
    """A conversation item: what the client and the engine said, kept for chat turns."""

    id: str
    role: str
    parts: list[dict[str, Any]]
    """OpenAI content parts as the client sees them (no audio bytes)."""
    audio: bytes = b""
    """A user item's audio as the engine hears it (float32 16 kHz)."""
    status: str = "completed"
    audio_ms: float = 0.0
    """An assistant item's speech, milliseconds (what truncation cuts in proportion)."""

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": self.parts,
        }

    def text(self) -> str:
        return "".join(p.get("text") or p.get("transcript") or "" for p in self.parts)


@dataclass
class Response:
    """The response being generated."""

    id: str
    item: Item
    audio: bool
    output_format: str
    voice: str
    usage_at_start: ev.Usage = field(default_factory=ev.Usage)
    heard_speech: bool = False
    """The user spoke over it (duplex)."""
    audio_ms: float = 0.0
    metadata: dict[str, Any] | None = None
    """The client's, echoed (LiveKit matches its requests by it)."""

    def content_index(self) -> dict[str, Any]:
        ids = {"response_id": self.id, "item_id": self.item.id}
        return {**ids, "output_index": 0, "content_index": 0}


class OpenAIRealtime(DuplexDialect):
    """/v1/realtime?model=... (no mode=)."""

    name = "openai_realtime"
    recorded = True
    lease_on_init = True
    tick_s = 0.1
    mode = "audio"

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.settings = Settings()
        self.items: list[Item] = []
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(4)
        self._client_event_id: str | None = None
        self._param: str | None = None
        self._said: set[str] = set()
        # the client's audio not yet sent: float32 chunks at the input format's rate
        self._pending: list[np.ndarray] = []
        self._pending_n = 0
        self.dropped_s = 0.0
        """Audio dropped because the engine fell behind (duplex), seconds."""
        # duplex
        self._init_sent = False
        self._running = False
        self._closed = False
        self._in_flight = 0
        self._sent_at = 0.0
        self._input_ms = 0.0
        self._unit_start_ms: dict[int, float] = {}
        self._speech_seqs: set[int] = set()
        self._user_speaking = False
        self._user_item: str = ""
        self._speech_start_ms = 0.0
        self._speech_end_ms = 0.0
        self._force_listen = False
        self._muted = False
        self._usage = ev.Usage()
        """The session's usage so far (cumulative, from the engine's outputs)."""
        self._usage_at_end = ev.Usage()
        """The usage when the last duplex reply ended: where the next one's starts."""
        # the response in progress (a duplex reply or a chat turn)
        self._response: Response | None = None

    # ---- ids, events, errors --------------------------------------------------------

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{self._tag}{next(self._ids):06d}"

    def _event(self, kind: str, **body: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": self._id("event"), **body}

    def error(self, err: EdgeError) -> dict[str, Any]:
        kind = "invalid_request_error" if err.kind == "client_error" else "server_error"
        param, self._param = self._param, None
        return self._event(
            "error",
            error={
                "type": kind,
                "code": err.code,
                "message": err.message,
                "param": param,
                "event_id": self._client_event_id,
            },
        )

    def _bad(self, param: str, message: str) -> InvalidPayload:
        self._param = param
        return InvalidPayload(message)

    def _unsupported(self, param: str, why: str) -> list[dict[str, Any]]:
        """The one notice that `param` is accepted and not used; [] once said. A notice,
        not an `error`: frameworks end the session on errors they do not know (Pipecat),
        and ignore event types they do not know."""
        if param in self._said:
            return []
        self._said.add(param)
        return [
            self._event(
                NOTICE,
                code="unsupported_parameter",
                param=param,
                message=f"{param}: {why}",
                client_event_id=self._client_event_id,
            )
        ]

    # ---- session ----------------------------------------------------------------------

    def session_json(self) -> dict[str, Any]:
        s = self.settings
        turn = None if s.turn_detection is None else dict(s.turn_detection)
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model,
            "output_modalities": list(s.output_modalities),
            "instructions": s.instructions,
            "max_output_tokens": "inf" if s.max_output_tokens is None else s.max_output_tokens,
            "audio": {
                "input": {
                    "format": format_json(s.input_format),
                    "turn_detection": turn,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {
                    "format": format_json(s.output_format),
                    "voice": self._voice_name(s.voice),
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
        }

    def opening(self) -> list[Any]:
        return [self._event("session.created", session=self.session_json())]

    def _session_update(self, event: dict[str, Any]) -> list[ev.Command]:
        body = event.get("session")
        if not isinstance(body, dict):
            raise self._bad("session", "'session' must be an object")
        unknown = sorted(set(body) - SESSION_KEYS)
        if unknown:
            raise self._bad(f"session.{unknown[0]}", f"unknown parameter 'session.{unknown[0]}'")
        if body.get("type", "realtime") != "realtime":
            raise self._bad("session.type", "only realtime sessions are served (no transcription)")
        new = dataclasses.replace(self.settings)
        notes: list[dict[str, Any]] = []
        if "instructions" in body:
            if not isinstance(body["instructions"], str):
                raise self._bad("session.instructions", "instructions must be a string")
            new.instructions = body["instructions"]
        if "output_modalities" in body:
            new.output_modalities = self._modalities(body["output_modalities"], "session")
        if "max_output_tokens" in body:
            new.max_output_tokens = self._max_tokens(body["max_output_tokens"], "session")
        audio = body.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise self._bad("session.audio", "audio must be an object")
            notes += self._audio_settings(audio, new)
        for key in UNSUPPORTED:
            if "." not in key and body.get(key) not in (None, [], "auto", "none"):
                notes += self._unsupported(f"session.{key}", UNSUPPORTED[key])
        if self._init_sent:
            for name in LOCKED:
                before = self.settings.turn_detection if name == "turn_detection" else None
                if getattr(new, name) != getattr(self.settings, name) and (
                    name != "turn_detection" or before is not None or new.turn_detection
                ):
                    notes += self._unsupported(
                        f"session.{name}",
                        "the conversation's duplex session has started with the earlier "
                        "value: a new session takes a new one",
                    )
        self.settings = new
        updated = self._event("session.updated", session=self.session_json())
        return [ev.SendCommand((*notes, updated))]

    def _modalities(self, value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) != 1 or value[0] not in ("audio", "text"):
            raise self._bad(
                f"{where}.output_modalities", 'output_modalities must be ["audio"] or ["text"]'
            )
        return (value[0],)

    def _max_tokens(self, value: Any, where: str) -> int | None:
        if value == "inf":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise self._bad(
                f"{where}.max_output_tokens", 'max_output_tokens must be 1 to 4096 or "inf"'
            )
        return min(value, MAX_NEW_TOKENS)

    def _audio_settings(self, audio: dict[str, Any], new: Settings) -> list[dict[str, Any]]:
        notes: list[dict[str, Any]] = []
        inp = fields.obj(audio, "input")
        out = fields.obj(audio, "output")
        if inp.get("format") is not None:
            new.input_format = _format(inp["format"], "session.audio.input.format")
        if out.get("format") is not None:
            new.output_format = _format(out["format"], "session.audio.output.format")
        for key in ("transcription", "noise_reduction"):
            if inp.get(key) is not None:
                notes += self._unsupported(f"audio.input.{key}", UNSUPPORTED[f"audio.input.{key}"])
        if out.get("speed") not in (None, 1, 1.0):
            notes += self._unsupported("audio.output.speed", UNSUPPORTED["audio.output.speed"])
        if "voice" in out:
            voice = out["voice"]
            if not isinstance(voice, str):
                raise self._bad("session.audio.output.voice", "voice must be a string")
            new.voice = voice
            if voice not in DEFAULT_VOICES and not self._voice_audio(voice):
                notes += self._unsupported(
                    f"audio.output.voice={voice}",
                    f"no registered voice {voice!r} (POST /api/assets/ref_audio registers "
                    "one): the server's default voice speaks",
                )
        if "turn_detection" in inp:
            notes += self._turn_detection(inp["turn_detection"], new)
        return notes

    def _turn_detection(self, value: Any, new: Settings) -> list[dict[str, Any]]:
        where = "session.audio.input.turn_detection"
        if value is None:
            new.turn_detection = None
            return []
        if not isinstance(value, dict) or value.get("type") not in TURN_DETECTION:
            raise self._bad(
                f"{where}.type", "turn_detection.type must be server_vad or semantic_vad"
            )
        # Checked here, applied to the duplex session's settings at its start.
        fields.number_field(value, "threshold", *fields.VAD_THRESHOLD, where)
        fields.integer_field(value, "silence_duration_ms", *fields.END_OF_TURN_SILENCE_MS, where)
        notes: list[dict[str, Any]] = []
        # What the engine does anyway needs no notice: answering, yielding, its own pace.
        usual = {"create_response": True, "interrupt_response": True, "eagerness": "auto"}
        for key in TURN_DETECTION_EXTRAS:
            if value.get(key) is not None and value.get(key) != usual.get(key):
                name = f"audio.input.turn_detection.{key}"
                notes += self._unsupported(name, UNSUPPORTED[name])
        new.turn_detection = dict(value)
        return notes

    def _voice_audio(self, voice: str) -> bytes:
        """A registered voice's reference audio; b"" for the default voice or an unknown one
        (said when it was set)."""
        if voice in DEFAULT_VOICES or self.voices is None:
            return b""
        return self.voices(voice) or b""

    def _voice_name(self, voice: str) -> str:
        """The voice that speaks, as the session reports it."""
        return voice if self._voice_audio(voice) else "default"

    def _init(self) -> ev.InitCommand:
        s = self.settings
        turn = s.turn_detection or {}
        threshold = turn.get("threshold")
        silence = turn.get("silence_duration_ms")
        config = ev.DuplexSettings(
            tts_enabled="audio" in s.output_modalities,
            vad_threshold=None if threshold is None else float(threshold),
            end_of_turn_silence_ms=silence,
        )
        return ev.InitCommand(
            dialect=ev.Dialect.CURRENT,
            system_prompt=s.instructions,
            config=config,
            ref_audio=self._voice_audio(s.voice),
        )

    # ---- client events ------------------------------------------------------------------

    def not_ready(self, cmd: ev.Command) -> str:
        return "the session has no worker yet"

    def decode(self, message: Any) -> list[ev.Command]:
        self._client_event_id = None
        if isinstance(message, bytes):
            raise InvalidEvent("binary frames are not part of the protocol: send JSON events")
        try:
            event = fields.parse_frame(message)
        except fields.InvalidJson as exc:
            raise InvalidEvent(f"the event is not valid JSON ({exc})") from None
        event_id = event.get("event_id")
        self._client_event_id = event_id if isinstance(event_id, str) else None
        kind = event["type"]
        handler = self._HANDLERS.get(kind)
        if handler is None:
            raise UnknownEvent(f"unknown event type {kind[:64]!r}")
        return handler(self, event)

    def _append(self, event: dict[str, Any]) -> list[ev.Command]:
        raw = _b64(event.get("audio"), "audio")
        kind = self.settings.input_format
        samples = decode_audio(raw, kind)
        rate = FORMATS[kind][0]
        duplex = self._duplex()
        cap_s = MAX_BACKLOG_S if duplex else float(MAX_AUDIO_SECONDS)
        if not duplex and (self._pending_n + samples.size) / rate > cap_s:
            raise self._bad(
                "audio", f"the input audio buffer holds at most {cap_s:.0f} s: commit it first"
            )
        self._pending.append(samples)
        self._pending_n += samples.size
        commands: list[ev.Command] = []
        if duplex:
            self._trim_backlog(rate)
            if not self._init_sent:
                self._init_sent = True
                commands.append(self._init())
            commands += self._pump(time.monotonic(), clock=False)
        return commands

    def _duplex(self) -> bool:
        """The conversation is (or becomes with the next audio) a duplex session."""
        return self._init_sent or self.settings.turn_detection is not None

    def _trim_backlog(self, rate: int) -> None:
        excess = self._pending_n - int(MAX_BACKLOG_S * rate)
        if excess <= 0:
            return
        audio = self._take_all()[excess:]
        self.dropped_s += excess / rate
        self._pending, self._pending_n = [audio], audio.size

    def _take_all(self) -> np.ndarray:
        audio = np.concatenate(self._pending) if self._pending else np.zeros(0, np.float32)
        self._pending, self._pending_n = [], 0
        return audio

    def _take(self, n: int) -> np.ndarray:
        audio = self._take_all()
        head, rest = audio[:n], audio[n:]
        if rest.size:
            self._pending, self._pending_n = [rest], rest.size
        return head

    def _commit(self, event: dict[str, Any]) -> list[ev.Command]:
        if self._duplex():
            raise InvalidEvent(
                "with turn detection on, the engine takes turns itself: set "
                "audio.input.turn_detection to null for manual commits"
            )
        if not self._pending_n:
            raise InvalidEvent("input_audio_buffer_commit_empty: the input audio buffer is empty")
        rate = FORMATS[self.settings.input_format][0]
        audio = pcm.resample(self._take_all(), rate, ENGINE_IN_RATE).astype("<f4").tobytes()
        item = Item(self._id("item"), "user", [{"type": "input_audio", "transcript": None}], audio)
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        committed = self._event(
            "input_audio_buffer.committed", item_id=item.id, previous_item_id=previous
        )
        return [ev.SendCommand((committed, *self._item_added(item, previous)))]

    def _clear(self, event: dict[str, Any]) -> list[ev.Command]:
        if self._init_sent:
            raise InvalidEvent("the duplex session hears the audio as it comes: nothing to clear")
        self._take_all()
        return [ev.SendCommand((self._event("input_audio_buffer.cleared"),))]

    def _item_added(self, item: Item, previous: str | None) -> list[dict[str, Any]]:
        return [
            self._event("conversation.item.added", previous_item_id=previous, item=item.json()),
            self._event("conversation.item.done", previous_item_id=previous, item=item.json()),
        ]

    def _item_create(self, event: dict[str, Any]) -> list[ev.Command]:
        body = event.get("item")
        if not isinstance(body, dict):
            raise self._bad("item", "'item' must be an object")
        item = self._parse_item(body, "item")
        if any(i.id == item.id for i in self.items):
            raise self._bad("item.id", f"an item {item.id!r} already exists")
        previous = event.get("previous_item_id")
        if previous is None:
            at = len(self.items)
        elif previous == "root":
            at = 0
        else:
            at = self._index(previous, "previous_item_id") + 1
        self.items.insert(at, item)
        before = self.items[at - 1].id if at else None
        if self._init_sent:
            notes = self._unsupported(
                "conversation.item.create",
                "the duplex engine hears the session's audio only: items are kept for the "
                "conversation's record",
            )
            return [ev.SendCommand((*notes, *self._item_added(item, before)))]
        return [ev.SendCommand(tuple(self._item_added(item, before)))]

    def _parse_item(self, body: dict[str, Any], where: str) -> Item:
        if body.get("type", "message") != "message":
            self._param = f"{where}.type"
            raise InvalidPayload(f"{where}.type: only message items are served (no tools)")
        role = body.get("role")
        if role not in ("user", "assistant", "system"):
            raise self._bad(f"{where}.role", f"{where}.role must be user, assistant or system")
        content = body.get("content")
        if not isinstance(content, list) or not content:
            raise self._bad(f"{where}.content", f"{where}.content must be a non-empty list")
        parts: list[dict[str, Any]] = []
        audio = b""
        for i, part in enumerate(content):
            at = f"{where}.content[{i}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise self._bad(f"{at}.text", f"{at}.text must be a string")
                parts.append({"type": kind, "text": text})
            elif kind == "input_audio" and role == "user":
                raw = _b64(part.get("audio"), f"{at}.audio")
                rate = FORMATS[self.settings.input_format][0]
                heard = pcm.resample(decode_audio(raw, self.settings.input_format), rate, 16000)
                audio += heard.astype("<f4").tobytes()
                parts.append({"type": "input_audio", "transcript": part.get("transcript")})
            elif kind == "input_image" and role == "user":
                url = part.get("image_url")
                if not isinstance(url, str) or not url.startswith("data:image/"):
                    raise self._bad(
                        f"{at}.image_url", f"{at}.image_url must be a data:image/...;base64 URL"
                    )
                parts.append({"type": "input_image", "image_url": url})
            elif kind == "output_audio" and role == "assistant":
                parts.append({"type": "output_audio", "transcript": part.get("transcript") or ""})
            else:
                raise self._bad(f"{at}.type", f"{at}.type {kind!r} is not served for a {role}")
        item_id = body.get("id")
        if item_id is not None and not isinstance(item_id, str):
            raise self._bad(f"{where}.id", f"{where}.id must be a string")
        return Item(item_id or self._id("item"), role, parts, audio)

    def _index(self, item_id: Any, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise self._bad(param, f"no item {str(item_id)[:64]!r} in the conversation")

    def _item_delete(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.items.pop(self._index(event.get("item_id"), "item_id"))
        return [ev.SendCommand((self._event("conversation.item.deleted", item_id=item.id),))]

    def _item_retrieve(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.items[self._index(event.get("item_id"), "item_id")]
        return [ev.SendCommand((self._event("conversation.item.retrieved", item=item.json()),))]

    def _item_truncate(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.items[self._index(event.get("item_id"), "item_id")]
        end_ms = event.get("audio_end_ms")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise self._bad("audio_end_ms", "audio_end_ms must be an integer >= 0")
        if item.role != "assistant":
            raise self._bad("item_id", "only an assistant item's audio can be truncated")
        # What the listener heard: the transcript cut where the audio was (in proportion).
        total_ms = item.audio_ms
        if total_ms and end_ms < total_ms:
            for part in item.parts:
                text = part.get("transcript") or ""
                part["transcript"] = text[: int(len(text) * end_ms / total_ms)]
        truncated = self._event(
            "conversation.item.truncated",
            item_id=item.id,
            content_index=event.get("content_index", 0),
            audio_end_ms=end_ms,
        )
        return [ev.SendCommand((truncated,))]

    def _response_create(self, event: dict[str, Any]) -> list[ev.Command]:
        if self._response is not None:
            raise InvalidEvent(
                "conversation_already_has_active_response: wait for response.done or cancel it"
            )
        if self._init_sent:
            raise InvalidEvent(
                "the duplex engine answers by itself in this session: responses on request "
                "need audio.input.turn_detection null, set before the first audio"
            )
        body = event.get("response") or {}
        if not isinstance(body, dict):
            raise self._bad("response", "'response' must be an object")
        s = self.settings
        modalities = s.output_modalities
        if body.get("output_modalities") is not None:
            modalities = self._modalities(body["output_modalities"], "response")
        # A field sent as null is the session's (LiveKit sends `instructions: null`).
        instructions = body.get("instructions")
        if instructions is None:
            instructions = s.instructions
        if not isinstance(instructions, str):
            raise self._bad("response.instructions", "instructions must be a string")
        cap = s.max_output_tokens
        if body.get("max_output_tokens") is not None:
            cap = self._max_tokens(body["max_output_tokens"], "response")
        output_format = s.output_format
        audio_cfg = fields.obj(fields.obj(body, "audio"), "output")
        if audio_cfg.get("format") is not None:
            output_format = _format(audio_cfg["format"], "response.audio.output.format")
        voice = audio_cfg.get("voice")
        if voice is None:
            voice = s.voice
        if not isinstance(voice, str):
            raise self._bad("response.audio.output.voice", "voice must be a string")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise self._bad("response.metadata", "metadata must be an object")
        items = self._response_items(body)
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        messages += [self._message(item) for item in items]
        if not messages or messages[-1]["role"] != "user":
            raise InvalidEvent("the conversation must end with a user item to answer")
        tts: dict[str, Any] = {"enabled": modalities == ("audio",)}
        ref = self._voice_audio(voice)
        if ref:
            tts["ref_audio_data"] = codec.b64encode(ref)
        chat: dict[str, Any] = {"messages": messages, "streaming": True, "tts": tts}
        if cap is not None:
            chat["generation"] = {"max_new_tokens": cap}
        item = Item(self._id("item"), "assistant", [], status="in_progress")
        self._response = Response(
            self._id("resp"),
            item,
            modalities == ("audio",),
            output_format,
            self._voice_name(voice),
            metadata=metadata,
        )
        return [ev.TurnCommand(chat)]

    def _response_items(self, body: dict[str, Any]) -> list[Item]:
        if body.get("input") is None:
            return [] if body.get("conversation") == "none" else list(self.items)
        if not isinstance(body["input"], list):
            raise self._bad("response.input", "response.input must be a list of items")
        items = []
        for i, entry in enumerate(body["input"]):
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                items.append(self.items[self._index(entry.get("id"), f"response.input[{i}].id")])
            elif isinstance(entry, dict):
                items.append(self._parse_item(entry, f"response.input[{i}]"))
            else:
                raise self._bad(f"response.input[{i}]", "an input entry must be an object")
        return items

    @staticmethod
    def _message(item: Item) -> dict[str, Any]:
        """An item as a chat message (edge.chat's request body)."""
        if item.role != "user":
            return {"role": item.role, "content": item.text()}
        content: list[dict[str, Any]] = []
        for part in item.parts:
            if part["type"] in ("input_text", "text"):
                content.append({"type": "text", "text": part["text"]})
            elif part["type"] == "input_image":
                data = part["image_url"].split(",", 1)[-1]
                content.append({"type": "image", "data": data})
        if item.audio:
            data = codec.b64encode(item.audio)
            content.append({"type": "audio", "data": data, "sample_rate": ENGINE_IN_RATE})
        return {"role": "user", "content": content}

    def _response_cancel(self, event: dict[str, Any]) -> list[ev.Command]:
        response = self._response
        if response is None:
            raise InvalidEvent("response_cancel_not_active: no response is in progress")
        done = self._finish("cancelled", "client_cancelled")
        if self._init_sent:  # a duplex reply: the next unit ends the engine's turn
            self._force_listen = True
            self._muted = True
            return [ev.SendCommand(tuple(done)), *self._pump(time.monotonic(), clock=False)]
        return [ev.CancelTurnCommand(), ev.SendCommand(tuple(done))]

    def _output_clear(self, event: dict[str, Any]) -> list[ev.Command]:
        response_id = self._response.id if self._response else None
        commands: list[ev.Command] = []
        if self._response is not None:
            commands = self._response_cancel(event)
        cleared = self._event("output_audio_buffer.cleared", response_id=response_id)
        return [*commands, ev.SendCommand((cleared,))]

    _HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.delete": _item_delete,
        "conversation.item.retrieve": _item_retrieve,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
        "output_audio_buffer.clear": _output_clear,
    }

    # ---- the duplex session's clock -------------------------------------------------------

    def tick(self, now: float) -> list[ev.Command]:
        return self._pump(now, clock=True)

    def _unit_bounds(self) -> tuple[int, int]:
        fewest, most = self.unit_bounds or (UNIT_SAMPLES, UNIT_SAMPLES)
        unit = min(max(UNIT_SAMPLES, fewest), most)
        return unit, most

    def _pump(self, now: float, clock: bool) -> list[ev.Command]:
        """The next unit for the engine, when one is due: a whole unit of the client's audio
        once the last unit was answered; on the clock, what came (or silence) once a unit's
        time passed without one; after a cancel, at once."""
        if not self._running or self._closed:
            return []
        unit, _ = self._unit_bounds()
        unit_s = unit / ENGINE_IN_RATE
        if self._in_flight and now - self._sent_at < IN_FLIGHT_UNITS * unit_s:
            return []
        rate = FORMATS[self.settings.input_format][0]
        n = unit * rate // ENGINE_IN_RATE
        if self._pending_n >= n:
            audio = self._take(n)
        elif self._force_listen or (clock and now - self._sent_at >= unit_s + FILL_GRACE_S):
            audio = self._take_all()  # a cancel ends the engine's turn now
        else:
            return []
        heard = pcm.resample(audio, rate, ENGINE_IN_RATE)
        if heard.size < unit:
            heard = np.concatenate([heard, np.zeros(unit - heard.size, np.float32)])
        self._sent_at = now
        force, self._force_listen = self._force_listen, False
        return [ev.AppendCommand(pcm=heard[:unit].astype("<f4").tobytes(), force_listen=force)]

    def appended(self, seq: int, cmd: ev.AppendCommand) -> None:
        self._in_flight = seq
        self._unit_start_ms[seq] = self._input_ms
        samples = np.frombuffer(cmd.pcm, "<f4")
        self._input_ms += samples.size * 1000 / ENGINE_IN_RATE
        if samples.size and float(np.sqrt(np.mean(samples**2))) > SPEECH_RMS:
            self._speech_seqs.add(seq)

    def after_output(self, event: ev.Output) -> list[ev.Command]:
        if self._in_flight and (
            event.seq >= self._in_flight or self._in_flight in event.dropped_seqs
        ):
            self._in_flight = 0
        return self._pump(time.monotonic(), clock=False)

    # ---- session events -> client ---------------------------------------------------------

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Created):
            self._running = True
            # The session's clock starts now: what the client sent while it waited for a
            # worker goes first, in whole units, before any silence is filled in.
            self._sent_at = time.monotonic()
            notes: list[Any] = []
            for note in event.notes:
                notes += self._unsupported(note.split(":", 1)[0] or note, note)
            return notes
        if isinstance(event, ev.Output):
            self._usage = event.usage
            return self._output(event)
        if isinstance(event, ev.Closed):
            return self._session_closed(event)
        if isinstance(event, ev.Expiring):
            message = f"the session's time limit ends it in {event.seconds_left} s"
            return [
                self._event(
                    NOTICE,
                    code="session_expiring",
                    seconds_left=event.seconds_left,
                    message=message,
                )
            ]
        return []  # queue events and pauses: nothing in this protocol

    def encode_turn(self, event: TurnEvent) -> list[Any]:
        if isinstance(event, TurnStarted):
            return self._begin()
        if isinstance(event, TurnDelta):
            return self._deltas(event.text, event.pcm) if self._response else []
        if isinstance(event, TurnDone):
            return self._turn_done(event)
        return []  # queued, leased, prefilled: nothing in this protocol

    def _output(self, out: ev.Output) -> list[Any]:
        messages: list[Any] = []
        heard = {seq for seq in self._speech_seqs if seq <= out.seq}
        self._speech_seqs -= heard
        for seq in [s for s in self._unit_start_ms if s < out.seq - 8]:
            del self._unit_start_ms[seq]
        if heard:
            last = max(heard)
            self._speech_end_ms = self._unit_start_ms.get(last, 0.0) + 1000.0
            if not self._user_speaking:
                self._user_speaking = True
                self._user_item = self._id("item")
                self._speech_start_ms = self._unit_start_ms.get(min(heard), 0.0)
                messages.append(
                    self._event(
                        "input_audio_buffer.speech_started",
                        audio_start_ms=int(self._speech_start_ms),
                        item_id=self._user_item,
                    )
                )
            if self._response is not None:
                self._response.heard_speech = True
        if out.is_listen:
            self._muted = False
            if self._response is not None:
                interrupted = self._response.heard_speech
                messages += self._finish(
                    "cancelled" if interrupted else "completed",
                    "turn_detected" if interrupted else None,
                )
            return messages
        if self._muted:
            return messages
        if self._response is None:
            messages += self._user_turn(out.input_transcript)
            self._response = Response(
                self._id("resp"),
                Item(self._id("item"), "assistant", [], status="in_progress"),
                "audio" in self.settings.output_modalities,
                self.settings.output_format,
                self._voice_name(self.settings.voice),
                usage_at_start=self._usage_at_end,
            )
            messages += self._begin()
        messages += self._deltas(out.text, out.pcm)
        if out.end_of_turn:
            messages += self._finish("completed", None)
        return messages

    def _user_turn(self, transcript: str) -> list[Any]:
        """The user's turn the engine answers: speech_stopped, committed and its item."""
        messages: list[Any] = []
        if not self._user_speaking:
            return messages
        self._user_speaking = False
        item = Item(
            self._user_item or self._id("item"),
            "user",
            [{"type": "input_audio", "transcript": transcript or None}],
        )
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        messages.append(
            self._event(
                "input_audio_buffer.speech_stopped",
                audio_end_ms=int(self._speech_end_ms),
                item_id=item.id,
            )
        )
        messages.append(
            self._event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)
        )
        messages += self._item_added(item, previous)
        if transcript:
            messages.append(
                self._event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=item.id,
                    content_index=0,
                    transcript=transcript,
                )
            )
        return messages

    def _response_json(self, response: Response, status: str, **extra: Any) -> dict[str, Any]:
        s = self.settings
        voice = response.voice
        return {
            "id": response.id,
            "object": "realtime.response",
            "status": status,
            "output": [response.item.json()] if status != "in_progress" else [],
            "output_modalities": ["audio" if response.audio else "text"],
            "audio": {"output": {"format": format_json(response.output_format), "voice": voice}},
            "max_output_tokens": "inf" if s.max_output_tokens is None else s.max_output_tokens,
            "conversation_id": self.session_id,
            "metadata": response.metadata,
            **extra,
        }

    def _begin(self) -> list[Any]:
        response = self._response
        if response is None:
            return []
        part = (
            {"type": "audio", "transcript": ""} if response.audio else {"type": "text", "text": ""}
        )
        response.item.parts = [
            {"type": "output_audio", "transcript": ""}
            if response.audio
            else {"type": "output_text", "text": ""}
        ]
        return [
            self._event("response.created", response=self._response_json(response, "in_progress")),
            self._event(
                "response.output_item.added",
                response_id=response.id,
                output_index=0,
                item={**response.item.json(), "content": []},
            ),
            # The assistant's item joins the conversation (LiveKit keeps its copy by these;
            # Pipecat opens the response's frames on it).
            self._event(
                "conversation.item.added",
                previous_item_id=self.items[-1].id if self.items else None,
                item={**response.item.json(), "content": []},
            ),
            self._event("response.content_part.added", **response.content_index(), part=part),
        ]

    def _deltas(self, text: str, audio: bytes) -> list[Any]:
        response = self._response
        assert response is not None
        part = response.item.parts[0]
        messages: list[Any] = []
        if response.audio:
            if audio:
                data = encode_audio(audio, response.output_format)
                response.audio_ms += len(audio) / 4 / ENGINE_OUT_RATE * 1000
                messages.append(
                    self._event(
                        "response.output_audio.delta",
                        **response.content_index(),
                        delta=codec.b64encode(data),
                    )
                )
            if text:
                part["transcript"] += text
                messages.append(
                    self._event(
                        "response.output_audio_transcript.delta",
                        **response.content_index(),
                        delta=text,
                    )
                )
        elif text:
            part["text"] += text
            messages.append(
                self._event("response.output_text.delta", **response.content_index(), delta=text)
            )
        return messages

    def _finish(
        self,
        status: str,
        reason: str | None,
        usage: ev.Usage | None = None,
        error: dict[str, Any] | None = None,
    ) -> list[Any]:
        """The response's closing events (response.done last)."""
        response, self._response = self._response, None
        if response is None:
            return []
        item = response.item
        item.status = "completed" if status == "completed" else "incomplete"
        messages: list[Any] = []
        ids = response.content_index()
        if item.parts:
            part = item.parts[0]
            if response.audio:
                transcript = part["transcript"]
                item.audio_ms = response.audio_ms
                messages += [
                    self._event("response.output_audio.done", **ids),
                    self._event(
                        "response.output_audio_transcript.done", **ids, transcript=transcript
                    ),
                    self._event(
                        "response.content_part.done",
                        **ids,
                        part={"type": "audio", "transcript": transcript},
                    ),
                ]
            else:
                text = part["text"]
                messages += [
                    self._event("response.output_text.done", **ids, text=text),
                    self._event(
                        "response.content_part.done", **ids, part={"type": "text", "text": text}
                    ),
                ]
            previous = self.items[-1].id if self.items else None
            self.items.append(item)
            messages.append(
                self._event(
                    "response.output_item.done",
                    response_id=response.id,
                    output_index=0,
                    item=item.json(),
                )
            )
            messages.append(
                self._event("conversation.item.done", previous_item_id=previous, item=item.json())
            )
        if usage is None:
            usage = _minus(self._usage, response.usage_at_start)
        self._usage_at_end = self._usage
        details: dict[str, Any] = {"type": status}
        if reason:
            details["reason"] = reason
        if error:
            details["error"] = error
        done = self._response_json(
            response,
            status,
            status_details=details if status != "completed" else None,
            usage=_usage_json(usage),
        )
        done["output"] = [item.json()] if item.parts else []
        messages.append(self._event("response.done", response=done))
        return messages

    def _turn_done(self, event: TurnDone) -> list[Any]:
        result = event.result
        if self._response is None:
            return []
        if result.reason == "max_tokens":
            return self._finish("incomplete", "max_output_tokens", result.usage)
        return self._finish("completed", None, result.usage)

    def turn_failed(self, err: EdgeError) -> list[Any]:
        failure = self.error(err)
        if self._response is None:
            return [failure]
        detail = {"type": failure["error"]["type"], "code": err.code, "message": err.message}
        return [failure, *self._finish("failed", None, ev.Usage(), detail)]

    def _session_closed(self, event: ev.Closed) -> list[Any]:
        self._closed = True
        messages: list[Any] = []
        if self._response is not None:
            messages += self._finish("incomplete", None)
        if event.reason in (ev.USER_STOP, ev.CLIENT_CLOSED):
            return messages
        if event.reason == ev.TIMEOUT:
            code, kind = "session_expired", "invalid_request_error"
        elif event.reason == ev.CONTEXT_FULL:
            code, kind = "context_length_exceeded", "invalid_request_error"
        elif event.reason == ev.SERVER_SHUTDOWN:
            code, kind = "server_shutdown", "server_error"
        else:
            code, kind = event.error_code or "server_error", "server_error"
        message = event.message or event.reason
        error = {"type": kind, "code": code, "message": message, "param": None, "event_id": None}
        messages.append(self._event("error", error=error))
        return messages


def _minus(a: ev.Usage, b: ev.Usage) -> ev.Usage:
    return ev.Usage(**{k: getattr(a, k) - getattr(b, k) for k in a.__dataclass_fields__})


def _usage_json(usage: ev.Usage) -> dict[str, Any]:
    """A response's usage in OpenAI's shape."""
    return {
        "total_tokens": usage.total_tokens,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "input_token_details": {
            "text_tokens": usage.input_text_tokens,
            "audio_tokens": usage.input_audio_tokens,
            "image_tokens": usage.input_image_tokens + usage.input_vision_tokens,
            "cached_tokens": usage.input_cached_tokens,
        },
        "output_token_details": {
            "text_tokens": usage.output_text_tokens,
            "audio_tokens": usage.output_audio_tokens,
        },
    }


__all__ = ["OpenAIRealtime"]
