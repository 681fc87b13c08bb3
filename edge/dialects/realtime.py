"""The Realtime API's duplex dialects on /v1/realtime?mode=audio|video: the first dialect
(`session.update`, audio-duplex-protocol.txt) and the current one (`session.init`,
realtime-overview.txt), chosen by the client's first init. Also the JSON shapes the
realtime chat dialect shares (usage, queue events, errors)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from omnifabric.edge import events as ev
from omnifabric.edge import fields, pcm
from omnifabric.edge.dialects.base import DuplexDialect, Traits
from omnifabric.edge.errors import (
    EdgeError,
    InferenceError,
    InvalidPayload,
    MissingField,
    ResumeExpired,
    UnknownEvent,
)
from omnifabric.edge.events import Dialect

#: Reason strings of the first dialect (audio-duplex-protocol.txt).
_FIRST_REASONS = {"user_stop": "stopped", "client_closed": "stopped"}

INIT_TYPES = {"session.update": Dialect.FIRST, "session.init": Dialect.CURRENT}
APPEND_TYPES = ("input_audio_buffer.append", "input.append")
CLOSE_TYPES = ("session.close",)


# ---- client events ----------------------------------------------------------------


def command(event: dict[str, Any]) -> ev.InitCommand | ev.AppendCommand | ev.CloseCommand:
    """A parsed event (fields.parse_frame) -> a command; UnknownEvent, MissingField,
    InvalidPayload."""
    kind = event["type"]
    if kind in INIT_TYPES:
        return _init(event, INIT_TYPES[kind])
    if kind in APPEND_TYPES:
        return _append(event, nested=kind == "input.append")
    if kind in CLOSE_TYPES:
        return ev.CloseCommand(reason=fields.string(event, "reason"))
    raise UnknownEvent(f"unknown event type {kind[:64]!r}")


def _init(event: dict[str, Any], dialect: Dialect) -> ev.InitCommand:
    if dialect is Dialect.FIRST:
        body = fields.obj(event, "session")
        voice = body
        ref_key, tts_key = "ref_audio", "tts_ref_audio"
    else:
        body = fields.obj(event, "payload", required=True)
        voice = fields.obj(body, "voice")
        ref_key, tts_key = "ref_audio_base64", "tts_ref_audio_base64"
    cfg = fields.obj(body, "config")
    prompt = body.get("system_prompt", body.get("instructions", ""))
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidPayload("the system prompt must be a string")
    settings = fields.duplex_settings(cfg)
    slices = fields.slice_count(body.get("max_slice_nums")) or 1
    if cfg.get("vision_hd") is True:
        slices = 2
    ref = voice.get(ref_key) or body.get(ref_key)
    tts = voice.get(tts_key) or body.get(tts_key)
    return ev.InitCommand(
        dialect=dialect,
        system_prompt=prompt,
        config=settings,
        ref_audio=pcm.reference_audio(ref, ref_key) if ref else b"",
        tts_ref_audio=pcm.reference_audio(tts, tts_key) if tts else b"",
        max_slice_nums=slices,
        ref_audio_id=fields.voice_id((voice, body), "ref_audio_id", ref_key),
        tts_ref_audio_id=fields.voice_id((voice, body), "tts_ref_audio_id", tts_key),
        speech_cuts=fields.flag(cfg, "speech_cuts"),
    )


def _append(event: dict[str, Any], nested: bool) -> ev.AppendCommand:
    body = fields.obj(event, "input", required=True) if nested else event
    if body.get("audio") is None:
        raise MissingField("'audio' is required")
    audio = pcm.unit_pcm(body["audio"])
    frames = fields.frame_list(body.get("video_frames"), "video_frames")
    decoded = tuple(pcm.jpeg_frame(f, f"video_frames[{i}]") for i, f in enumerate(frames))
    force = body.get("force_listen")
    if force is not None and not isinstance(force, bool):
        raise InvalidPayload("'force_listen' must be true or false")
    return ev.AppendCommand(
        pcm=audio,
        frames=decoded,
        force_listen=bool(force),
        max_slice_nums=fields.slice_count(body.get("max_slice_nums")),
    )


# ---- server events ----------------------------------------------------------------


def error_json(err: EdgeError) -> dict[str, Any]:
    """The `error` event (same shape in both dialects and in chat)."""
    return {"type": "error", "error": {"code": err.code, "message": err.message, "type": err.kind}}


def usage_json(usage: ev.Usage) -> dict[str, Any]:
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


def queued_json(event: ev.Queued) -> dict[str, Any]:
    return {
        "type": "session.queued" if event.first else "session.queue_update",
        "position": event.position,
        "estimated_wait_s": round(event.estimated_wait_s, 1),
        "ticket_id": event.ticket_id,
        "queue_length": event.queue_length,
    }


def queue_done_json() -> dict[str, Any]:
    return {"type": "session.queue_done"}


def created_json(event: ev.Created, dialect: Dialect, mode: str) -> dict[str, Any]:
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
        if event.unit_samples is not None:
            fewest, most = event.unit_samples
            created["input_units"] = {
                "min_samples": fewest,
                "max_samples": most,
                "as_sent": event.units_as_sent,
            }
    if event.notes:
        created["notes"] = list(event.notes)
    return created


def metrics_json(out: ev.Output) -> dict[str, Any]:
    """Per-unit metrics as the reference server sends them."""
    t = out.timings_ms
    metrics: dict[str, Any] = {
        "seq": out.seq,
        "kv_cache_length": out.kv_cache_length,
        "prefill_ms": round(t.get("prefill_ms", 0.0), 2),
        "generate_ms": round(t.get("generate_ms", 0.0), 2),
        # Waiting for the engine to finish this session's earlier unit (its compute, then
        # its deferred finalize): the engine's time, not the fabric's (clients take both
        # out of the round trip with prefill and generate).
        "engine_busy_ms": round(t.get("engine_busy_ms", 0.0), 2),
        "finalize_wait_ms": round(t.get("finalize_wait_ms", 0.0), 2),
        "wall_clock_ms": round(t.get("wall_clock_ms", 0.0), 2),
        "n_tokens": out.n_tokens,
        "n_tts_tokens": out.n_tts_tokens,
    }
    if out.dropped_seqs:
        metrics["dropped_seqs"] = list(out.dropped_seqs)
    if out.early:  # the reply's start, sent once made: it answers no unit (`seq` listened)
        metrics["early"] = True
    return metrics


class OutputRenderer:
    """Renders unit outputs of one session as JSON events in its dialect."""

    def __init__(self, dialect: Dialect, session_id: str) -> None:
        self.dialect = dialect
        self.session_id = session_id
        self._turn = 0
        self._in_turn = False

    def render(self, out: ev.Output) -> list[dict[str, Any]]:
        """The events for one unit's output, in send order. What the engine heard the user
        say rides on the unit's first event as `input_transcript`."""
        events = self._first(out) if self.dialect is Dialect.FIRST else self._current(out)
        if out.input_transcript and events:
            events[0]["input_transcript"] = out.input_transcript
        return events

    def _first(self, out: ev.Output) -> list[dict[str, Any]]:
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

    def _current(self, out: ev.Output) -> list[dict[str, Any]]:
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


def closed_json(
    event: ev.Closed, dialect: Dialect | None, session_id: str | None
) -> dict[str, Any]:
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
    if event.message and event.reason not in ("user_stop", ev.CONTEXT_FULL):
        body["message"] = event.message
    body["usage"] = usage_json(event.usage)
    return body


class RealtimeDuplex(DuplexDialect):
    """/v1/realtime?mode=audio|video, both dialects."""

    name = "realtime"
    traits = Traits(recorded=True, resumable=True, early_results=True)
    #: The URL's ?mode=, known before any message (never None here, unlike the gRPC dialect).
    mode: str

    def __init__(self, mode: str, resume_token: str = "", last_seq: str = "") -> None:
        self.mode = mode
        self.variant: Dialect | None = None
        """The dialect the client's first init chose."""
        self._renderer: OutputRenderer | None = None
        self.resume_token = resume_token
        self._last_seq_text = last_seq
        self._event_seq = 0
        """The seq of the last session event sent (session.created is 1)."""

    def refusal(self) -> EdgeError | None:
        if self.mode not in ev.MODES:
            return InvalidPayload(
                f"unknown mode {self.mode[:32]!r}: use chat, audio or video", close_code=1008
            )
        if self.resume_token:
            text = self._last_seq_text or "0"
            if not text.isdigit() or len(text) > 12:
                return InvalidPayload(
                    "last_seq must be the seq of the last event received (an integer >= 0)",
                    close_code=1008,
                )
            self.last_seq = int(text)
        return None

    def client_state(self) -> bytes:
        variant = self.variant or Dialect.CURRENT
        return json.dumps({"variant": variant.value}).encode()

    def _numbered(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Session events carry `seq`, from 1 without gaps (what a resume counts by)."""
        for message in messages:
            self._event_seq += 1
            message["seq"] = self._event_seq
        return messages

    def replay(self, event: ev.Reattached) -> list[Any]:
        try:
            state = json.loads(event.client_state or b"{}")
            variant = Dialect(state.get("variant", Dialect.CURRENT.value))
        except (ValueError, AttributeError):
            variant = Dialect.CURRENT
        self.variant = variant
        self.session_id = event.session_id
        self._renderer = OutputRenderer(variant, event.session_id)
        # The events the session sent so far, rebuilt in order (the renderer is
        # deterministic): session.created, then each output's events.
        self._event_seq = 1
        missed: list[dict[str, Any]] = []
        for out in event.outputs:
            # An output whose speech is no longer kept still made its audio event.
            shown = replace(out, pcm=b"\0\0\0\0") if out.audio_dropped else out
            for message in self._numbered(self._renderer.render(shown)):
                if message["seq"] <= self.last_seq:
                    continue
                if out.pruned or (out.audio_dropped and "audio" in message):
                    raise ResumeExpired(
                        f"events after seq {self.last_seq} are no longer kept: resume sooner"
                    )
                missed.append(message)
        resumed = {
            "type": "session.resumed",
            "session_id": event.session_id,
            "last_seq": self.last_seq,
            "replayed": len(missed),
            "last_input_seq": event.last_input_seq,
            "resume_token": event.resume_token,
            "resume_window_s": event.resume_window_s,
        }
        return [resumed, *missed]

    def not_ready(self, cmd: ev.Command) -> str:
        return "send session.init (or session.update) after session.queue_done"

    def decode(self, message: Any) -> list[ev.Command]:
        if isinstance(message, bytes):
            raise InvalidPayload("binary frames are not part of the protocol")
        cmd = command(fields.parse_frame(message))
        if isinstance(cmd, ev.InitCommand) and self._renderer is None:
            self.variant = cmd.dialect
        return [cmd]

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Queued):
            return [queued_json(event)]
        if isinstance(event, ev.QueueDone):
            return [queue_done_json()]
        if isinstance(event, ev.Created):
            variant = self.variant or Dialect.CURRENT
            self._renderer = OutputRenderer(variant, event.session_id)
            created = created_json(event, variant, self.mode or "audio")
            if event.resume_token:
                created["resume_token"] = event.resume_token
                created["resume_window_s"] = event.resume_window_s
            return self._numbered([created])
        if isinstance(event, ev.Output):
            assert self._renderer is not None, "an output before session.created"
            return self._numbered(self._renderer.render(event))
        if isinstance(event, ev.Closed):
            sent = []
            if event.error_code == InferenceError.code:
                sent.append(error_json(InferenceError(event.message or "inference failed")))
            sent.append(closed_json(event, self.variant, self.session_id))
            return self._numbered(sent)
        if isinstance(event, ev.Expiring):
            # Not numbered: a resume replays the session's numbered events only.
            return [{"type": "session.expiring", "seconds_left": event.seconds_left}]
        return []  # no pause in this protocol

    def error(self, err: EdgeError) -> dict[str, Any]:
        return error_json(err)
