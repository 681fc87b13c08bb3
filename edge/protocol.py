"""The public Realtime JSON protocol: parse client frames into commands, render session
events as JSON in the client's dialect. No I/O here."""

from __future__ import annotations

import json
import math
from typing import Any

from edge import pcm
from edge.errors import InvalidPayload, MissingField, UnknownEvent
from edge.events import (
    CONTEXT_FULL,
    AppendCommand,
    CloseCommand,
    Closed,
    Created,
    Dialect,
    DuplexSettings,
    InitCommand,
    Output,
    Queued,
    Usage,
)

#: At most this many video frames in one unit (the model takes ~1 frame per second).
MAX_FRAMES_PER_UNIT = 4
#: The largest value a uint32 protobuf field carries.
MAX_UINT32 = (1 << 32) - 1
#: The model's fixed context, tokens.
MAX_CONTEXT_TOKENS = 8192
#: Reason strings of the first dialect (audio-duplex-protocol.txt).
_FIRST_REASONS = {"user_stop": "stopped", "client_closed": "stopped"}


class InvalidJson(Exception):
    """The frame is not JSON text at all: the connection closes with 1003."""


class _NonFinite(Exception):
    pass


def _reject_constant(name: str) -> float:
    raise _NonFinite(name)


def parse_frame(text: str) -> dict[str, Any]:
    """Decode one text frame into an event object.

    Raises InvalidJson (close 1003) for text that is not JSON, InvalidPayload for JSON
    that is too deep, uses NaN/Infinity, or is not an object, MissingField without `type`.
    """
    event = parse_object(text)
    if "type" not in event:
        raise MissingField("event has no 'type'")
    if not isinstance(event["type"], str):
        raise InvalidPayload("'type' must be a string")
    return event


def parse_object(text: str) -> dict[str, Any]:
    """Decode a JSON object (no `type` needed); errors as parse_frame."""
    try:
        event = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidPayload("JSON nesting too deep") from None
    except _NonFinite as exc:
        raise InvalidPayload(f"{exc} is not allowed in events") from None
    except json.JSONDecodeError as exc:
        raise InvalidJson(str(exc)) from None
    except ValueError:
        # Valid JSON all the same: an integer past Python's digit limit (4300 digits).
        raise InvalidPayload("a number in the event is too long") from None
    if not isinstance(event, dict):
        raise InvalidPayload("an event must be a JSON object")
    return event


INIT_TYPES = {"session.update": Dialect.FIRST, "session.init": Dialect.CURRENT}
APPEND_TYPES = ("input_audio_buffer.append", "input.append")
CLOSE_TYPES = ("session.close",)
KNOWN_TYPES = set(INIT_TYPES) | set(APPEND_TYPES) | set(CLOSE_TYPES)


def command(event: dict[str, Any]) -> InitCommand | AppendCommand | CloseCommand:
    """Turn a parsed event into a command; UnknownEvent, MissingField, InvalidPayload."""
    kind = event["type"]
    if kind in INIT_TYPES:
        return _init(event, INIT_TYPES[kind])
    if kind in APPEND_TYPES:
        return _append(event, nested=kind == "input.append")
    if kind in CLOSE_TYPES:
        reason = event.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise InvalidPayload("'reason' must be a string")
        return CloseCommand(reason=reason)
    raise UnknownEvent(f"unknown event type {kind[:64]!r}")


def _obj(event: dict[str, Any], key: str, required: bool) -> dict[str, Any]:
    value = event.get(key)
    if value is None:
        if required:
            raise MissingField(f"'{key}' is required")
        return {}
    if not isinstance(value, dict):
        raise InvalidPayload(f"'{key}' must be an object")
    return value


def number_field(
    cfg: dict[str, Any], key: str, lo: float, hi: float, where: str = "config"
) -> float | None:
    """``cfg[key]`` as a float in [lo, hi], None when absent; InvalidPayload naming
    ``where.key`` otherwise. The one number check of every dialect."""
    value = cfg.get(key)
    if value is None:
        return None
    # An int is compared as it is: math.isfinite() overflows on one beyond float range.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise InvalidPayload(f"{where}.{key} must be a number")
    if not lo <= value <= hi:
        raise InvalidPayload(f"{where}.{key} must be in [{lo}, {hi}]")
    return float(value)


def integer_field(
    cfg: dict[str, Any], key: str, lo: int, hi: int, where: str = "config"
) -> int | None:
    """``cfg[key]`` as an int in [lo, hi], None when absent; InvalidPayload otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidPayload(f"{where}.{key} must be an integer")
    if not lo <= value <= hi:
        raise InvalidPayload(f"{where}.{key} must be in [{lo}, {hi}]")
    return value


def _flag(cfg: dict[str, Any], key: str) -> bool | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidPayload(f"config.{key} must be true or false")
    return value


def duplex_settings(cfg: dict[str, Any]) -> DuplexSettings:
    """Validate a duplex `config` object, mapping the SDK's own keys; others ignored."""
    return DuplexSettings(
        length_penalty=number_field(cfg, "length_penalty", 0.0, 10.0),
        temperature=number_field(cfg, "temperature", 0.0, 5.0),
        top_k=integer_field(cfg, "top_k", 1, 1000),
        top_p=number_field(cfg, "top_p", 0.0, 1.0),
        listen_prob_scale=number_field(cfg, "listen_prob_scale", 0.0, 100.0),
        force_listen_count=integer_field(cfg, "force_listen_count", 0, 100),
        max_new_speak_tokens_per_chunk=integer_field(cfg, "max_new_speak_tokens_per_chunk", 1, 200),
        max_kv_tokens=integer_field(cfg, "max_kv_tokens", 64, MAX_CONTEXT_TOKENS),
        tts_enabled=_flag(cfg, "tts_enabled"),
        max_tokens=integer_field(cfg, "max_tokens", 1, 1 << 20),
    )


def slices_field(value: Any, where: str = "max_slice_nums") -> int:
    """A max_slice_nums as sent (0 when absent): a positive integer that fits the wire
    (uint32). Only its form is checked here; the range a model takes comes from the
    leased worker (SessionCore checks it against the lease's limits)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidPayload(f"{where} must be a positive integer")
    if value > MAX_UINT32:
        raise InvalidPayload(f"{where} is far too large")
    return value


def _init(event: dict[str, Any], dialect: Dialect) -> InitCommand:
    if dialect is Dialect.FIRST:
        body = _obj(event, "session", required=False)
        voice = body
        ref_key, tts_key = "ref_audio", "tts_ref_audio"
        cfg = _obj(body, "config", required=False)
    else:
        body = _obj(event, "payload", required=True)
        voice = _obj(body, "voice", required=False)
        ref_key, tts_key = "ref_audio_base64", "tts_ref_audio_base64"
        cfg = _obj(body, "config", required=False)
    prompt = body.get("system_prompt", body.get("instructions", ""))
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidPayload("the system prompt must be a string")
    settings = duplex_settings(cfg)
    slices = slices_field(body.get("max_slice_nums")) or 1
    if cfg.get("vision_hd") is True:
        slices = 2
    ref = voice.get(ref_key) or body.get(ref_key)
    tts = voice.get(tts_key) or body.get(tts_key)
    return InitCommand(
        dialect=dialect,
        system_prompt=prompt,
        config=settings,
        ref_audio=pcm.reference_audio(ref, ref_key) if ref else b"",
        tts_ref_audio=pcm.reference_audio(tts, tts_key) if tts else b"",
        max_slice_nums=slices,
    )


def _append(event: dict[str, Any], nested: bool) -> AppendCommand:
    body = _obj(event, "input", required=True) if nested else event
    if "audio" not in body or body["audio"] is None:
        raise MissingField("'audio' is required")
    audio = pcm.unit_pcm(body["audio"])
    frames = body.get("video_frames") or []
    if not isinstance(frames, list):
        raise InvalidPayload("'video_frames' must be a list of base64 JPEG strings")
    if len(frames) > MAX_FRAMES_PER_UNIT:
        raise InvalidPayload(f"at most {MAX_FRAMES_PER_UNIT} video frames per unit")
    decoded = tuple(pcm.jpeg_frame(f, f"video_frames[{i}]") for i, f in enumerate(frames))
    force = body.get("force_listen", False)
    if force is None:
        force = False
    if not isinstance(force, bool):
        raise InvalidPayload("'force_listen' must be true or false")
    return AppendCommand(
        pcm=audio,
        frames=decoded,
        force_listen=force,
        max_slice_nums=slices_field(body.get("max_slice_nums")),
    )


# ---- server events ------------------------------------------------------------------


def usage_json(usage: Usage) -> dict[str, Any]:
    """The SDK's usage object."""
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "input_tokens_details": {
            "text_tokens": usage.input_text_tokens,
            "audio_tokens": usage.input_audio_tokens,
            "vision_tokens": usage.input_vision_tokens,
            "image_tokens": usage.input_image_tokens,
            "video_tokens": usage.input_video_tokens,
            "cached_tokens": usage.input_cached_tokens,
        },
        "output_tokens_details": {
            "text_tokens": usage.output_text_tokens,
            "audio_tokens": usage.output_audio_tokens,
        },
    }


def queued_json(event: Queued) -> dict[str, Any]:
    return {
        "type": "session.queued" if event.first else "session.queue_update",
        "position": event.position,
        "estimated_wait_s": round(event.estimated_wait_s, 1),
        "ticket_id": event.ticket_id,
        "queue_length": event.queue_length,
    }


def queue_done_json() -> dict[str, Any]:
    return {"type": "session.queue_done"}


def created_json(event: Created, dialect: Dialect, mode: str) -> dict[str, Any]:
    if dialect is Dialect.FIRST:
        created: dict[str, Any] = {
            "type": "session.created",
            "session_id": event.session_id,
            "prompt_length": event.prompt_length,
        }
    else:
        created = {
            "type": "session.created",
            "session_id": event.session_id,
            "mode": "full_duplex",
            "metrics": {
                "prompt_length": event.prompt_length,
                "kv_cache_length": event.prompt_length,
            },
        }
    if event.notes:
        created["notes"] = list(event.notes)
    return created


def metrics_json(out: Output) -> dict[str, Any]:
    """Per-unit metrics as the reference server sends them."""
    t = out.timings_ms
    metrics: dict[str, Any] = {
        "seq": out.seq,
        "kv_cache_length": out.kv_cache_length,
        "prefill_ms": round(t.get("prefill_ms", 0.0), 2),
        "generate_ms": round(t.get("generate_ms", 0.0), 2),
        "wall_clock_ms": round(t.get("wall_clock_ms", 0.0), 2),
        "n_tokens": out.n_tokens,
        "n_tts_tokens": out.n_tts_tokens,
    }
    if out.dropped_seqs:
        metrics["dropped_seqs"] = list(out.dropped_seqs)
    return metrics


class OutputRenderer:
    """Renders unit outputs of one session as JSON events in its dialect."""

    def __init__(self, dialect: Dialect, session_id: str) -> None:
        self.dialect = dialect
        self.session_id = session_id
        self._turn = 0
        self._in_turn = False

    def render(self, out: Output) -> list[dict[str, Any]]:
        """The events for one unit's output, in send order. What the engine heard the user
        say rides on the unit's first event as `input_transcript`."""
        events = self._first(out) if self.dialect is Dialect.FIRST else self._current(out)
        if out.input_transcript and events:
            events[0]["input_transcript"] = out.input_transcript
        return events

    def _first(self, out: Output) -> list[dict[str, Any]]:
        if out.is_listen:
            event: dict[str, Any] = {
                "type": "response.listen",
                "kv_cache_length": out.kv_cache_length,
                "metrics": metrics_json(out),
            }
            if out.end_of_turn:
                event["end_of_turn"] = True
            return [event]
        return [
            {
                "type": "response.output_audio.delta",
                "text": out.text,
                "audio": pcm.encode_pcm(out.pcm),
                "end_of_turn": out.end_of_turn,
                "kv_cache_length": out.kv_cache_length,
                "metrics": metrics_json(out),
                "usage": usage_json(out.usage),
            }
        ]

    def _current(self, out: Output) -> list[dict[str, Any]]:
        input_id = f"input_{out.seq}"
        metrics = metrics_json(out)
        if out.is_listen:
            self._in_turn = False
            return [self._delta("listen", input_id, metrics, text="")]
        if not self._in_turn:
            self._in_turn = True
            self._turn += 1
        events = []
        if out.text:
            events.append(self._delta("text", input_id, metrics, text=out.text))
        if out.pcm:
            events.append(
                self._delta(
                    "audio",
                    input_id,
                    metrics,
                    audio=pcm.encode_pcm(out.pcm),
                    usage=usage_json(out.usage),
                )
            )
        if out.end_of_turn:
            self._in_turn = False
            events.append(self._delta("listen", input_id, metrics, text=""))
        return events

    def _delta(self, kind: str, input_id: str, metrics: dict, **fields: Any) -> dict[str, Any]:
        event = {
            "type": "response.output.delta",
            "kind": kind,
            "session_id": self.session_id,
            "response_id": f"resp_{self.session_id}_{self._turn}",
            "input_id": input_id,
            "metrics": metrics,
        }
        event.update(fields)
        return event


def closed_json(event: Closed, dialect: Dialect | None, session_id: str | None) -> dict[str, Any]:
    """session.closed: the first dialect confirms a client stop as "stopped", the
    current one echoes the client's reason (default user_stop)."""
    reason = event.reason
    if event.reason in ("user_stop", "client_closed"):
        if dialect is Dialect.FIRST:
            reason = _FIRST_REASONS[event.reason]
        elif event.client_reason:
            reason = event.client_reason
    body: dict[str, Any] = {"type": "session.closed", "reason": reason}
    if session_id:
        body["session_id"] = session_id
    if event.message and event.reason not in ("user_stop", CONTEXT_FULL):
        body["message"] = event.message
    body["usage"] = usage_json(event.usage)
    return body
