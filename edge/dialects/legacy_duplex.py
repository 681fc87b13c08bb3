"""The legacy duplex endpoint `/ws/duplex/{session_id}`, kept for deployed pages and scripts.

It speaks the reference server's flat message set (spec README, "Legacy endpoints"):
client `prepare`, `audio_chunk`, `pause`, `resume`, `stop`; server
`queued`/`queue_update`/`queue_done`, `prepared`, one `result` per chunk, `paused`,
`resumed`, `stopped`, `timeout`, `error{error}`.

Choices where the spec leaves room (they follow the reference server's documentation):
- An id starting `adx_` is an audio session; any other id is omni (mode video). The id is
  the session id everywhere (scheduler, worker, logs).
- `prepared.recording_session_id` names the session's recording (`/api/sessions/{id}`)
  when the edge records (`--record-dir`), and is null otherwise: nothing to fetch.
- `result.audio_data` is base64 float32 24 kHz PCM, and "" when the unit has no audio
  (listening, or text only); `text` is "" when listening. `cost_llm_ms`/`cost_tts_ms` are
  the engine's own costs (0 when it reports none), `cost_all_ms` = prefill + generate,
  `current_time` is the input audio received up to that unit in ms, and
  `server_send_ts` is the unix time of the send in **seconds** (a float, as the reference
  documents it; clients subtract it from their own clock for latency).
- Ends: `stop` -> `stopped{session_id}`; a pause outlasting its timeout ->
  `timeout{reason:"pause_timeout"}`; the worker's time limit or a full context ->
  `timeout{reason:"timeout"|"context_full"}`; an engine failure, a lost worker or a
  server shutdown -> `error{error}` with the close's sentence (common.close_reasons).
  Each is followed by close 1000.
- Client mistakes (unknown type, missing or invalid fields, input before `prepared`)
  answer `error{error:"<text>"}` and the connection stays open; text that is not JSON
  closes it with 1003; errors that end the connection (queue full, worker start failed:
  close 1013; slow client: 1008) name their code first (`"queue_full: ..."`). `error`
  events also carry the text as `message`, which the reference's own pages read.
- Accepted aliases from the reference's documentation: `prefix_system_prompt` for
  `system_prompt`, `audio` for `audio_base64`, config `generate_audio` for `tts_enabled`;
  `client_diagnostic` messages are accepted and ignored.
- `audio_chunk` while paused is forwarded and leaves the pause (and its watchdog) as is:
  only `resume` resumes. Frames sent to an `adx_` session are ignored.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from omnifabric.common.close_reasons import close_message
from omnifabric.edge import events as ev
from omnifabric.edge import fields, pcm
from omnifabric.edge.dialects.base import DuplexDialect, Traits
from omnifabric.edge.errors import (
    EdgeError,
    InvalidPayload,
    MissingField,
    UnknownEvent,
)

#: Session ids starting with this are audio-only sessions; any other id is omni.
AUDIO_PREFIX = "adx_"
#: Pause timeout when `pause` names none, and the largest one accepted, seconds.
DEFAULT_PAUSE_TIMEOUT_S = 60.0
MAX_PAUSE_TIMEOUT_S = 3600.0
#: Input sample rate of `audio_chunk`, Hz (for `current_time`).
INPUT_RATE = 16000
#: What a session id in the path may look like (it ends up in logs and worker requests).
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
#: Messages the reference's pages send that carry nothing for the session.
_IGNORED_TYPES = frozenset({"client_diagnostic"})


def error_json(text: str) -> dict[str, Any]:
    """The reference server's flat `error` message (`message` too: its pages read it)."""
    return {"type": "error", "error": text, "message": text}


def error_text(err: EdgeError) -> str:
    """An error's text in the flat messages: errors that end the connection name their code."""
    return err.message if err.close_code is None else f"{err.code}: {err.message}"


def path_id_refusal(session_id: str | None) -> EdgeError | None:
    """The refusal of a session id taken from the URL path that may not be used (it ends up
    in logs and worker requests); None for a good one."""
    if not _SESSION_ID.fullmatch(session_id or ""):
        return InvalidPayload(
            "the session id must be 1-128 letters, digits or _.:-", close_code=1008
        )
    return None


def prepare_command(event: dict[str, Any]) -> ev.InitCommand:
    """A `prepare` message -> InitCommand; raises InvalidPayload for bad fields."""
    prompt = event.get("system_prompt", event.get("prefix_system_prompt"))
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidPayload("'system_prompt' must be a string")
    cfg = fields.obj(event, "config")
    settings = fields.duplex_settings(cfg)
    generate_audio = fields.flag(cfg, "generate_audio")
    if generate_audio is not None and settings.tts_enabled is None:
        settings = dataclasses.replace(settings, tts_enabled=generate_audio)
    slices = fields.slice_count(event.get("max_slice_nums"), "'max_slice_nums'") or 1
    if cfg.get("vision_hd") is True:
        slices = 2
    ref = event.get("ref_audio_base64")
    tts = event.get("tts_ref_audio_base64")
    return ev.InitCommand(
        dialect=ev.Dialect.CURRENT,
        system_prompt=prompt,
        config=settings,
        ref_audio=pcm.reference_audio(ref, "ref_audio_base64") if ref else b"",
        tts_ref_audio=pcm.reference_audio(tts, "tts_ref_audio_base64") if tts else b"",
        max_slice_nums=slices,
        ref_audio_id=fields.voice_id((event,), "ref_audio_id", "ref_audio_base64"),
        tts_ref_audio_id=fields.voice_id((event,), "tts_ref_audio_id", "tts_ref_audio_base64"),
    )


def chunk_command(event: dict[str, Any], frames_allowed: bool) -> ev.AppendCommand:
    """An `audio_chunk` message -> AppendCommand; MissingField or InvalidPayload.

    Frames are validated and carried only when `frames_allowed` (omni sessions).
    """
    audio = event.get("audio_base64", event.get("audio"))
    if audio is None:
        raise MissingField("'audio_base64' is required")
    unit = pcm.unit_pcm(audio, "audio_base64")
    frames: tuple[bytes, ...] = ()
    if frames_allowed:
        listed = fields.frame_list(event.get("frame_base64_list"), "frame_base64_list")
        frames = tuple(pcm.jpeg_frame(f, f"frame_base64_list[{i}]") for i, f in enumerate(listed))
    force = event.get("force_listen")
    if force is not None and not isinstance(force, bool):
        raise InvalidPayload("'force_listen' must be true or false")
    return ev.AppendCommand(pcm=unit, frames=frames, force_listen=bool(force))


def pause_timeout(event: dict[str, Any]) -> float:
    """The `timeout` of a `pause` message in seconds (default 60); InvalidPayload."""
    problem = f"'timeout' must be a number of seconds above 0 and at most {MAX_PAUSE_TIMEOUT_S:g}"
    try:
        value = fields.number_field(event, "timeout", 0.0, MAX_PAUSE_TIMEOUT_S, "pause")
    except InvalidPayload:
        raise InvalidPayload(problem) from None
    if value is None:
        return DEFAULT_PAUSE_TIMEOUT_S
    if value <= 0:
        raise InvalidPayload(problem)
    return value


def result_json(out: ev.Output, current_time_ms: int) -> dict[str, Any]:
    """One unit's output as the legacy `result` message (server_send_ts set here, as the
    message is made to be sent)."""
    t = out.timings_ms
    return {
        "type": "result",
        "is_listen": out.is_listen,
        "text": out.text,
        "audio_data": pcm.encode_pcm(out.pcm) if out.pcm else "",
        "end_of_turn": out.end_of_turn,
        "kv_cache_length": out.kv_cache_length,
        "current_time": current_time_ms,
        "wall_clock_ms": round(t.get("wall_clock_ms", 0.0), 2),
        "cost_llm_ms": round(t.get("cost_llm_ms", 0.0), 2),
        "cost_tts_ms": round(t.get("cost_tts_ms", 0.0), 2),
        "cost_all_ms": round(t.get("prefill_ms", 0.0) + t.get("generate_ms", 0.0), 2),
        "n_tokens": out.n_tokens,
        "n_tts_tokens": out.n_tts_tokens,
        "server_send_ts": time.time(),
    }


def queue_json(event: ev.Queued | ev.QueueDone) -> dict[str, Any]:
    """The reference server's flat queue messages: queued, queue_update, queue_done."""
    if isinstance(event, ev.QueueDone):
        return {"type": "queue_done"}
    wait = round(event.estimated_wait_s, 1)
    return {
        "type": "queued" if event.first else "queue_update",
        "position": event.position,
        "estimated_wait_s": wait,
        "eta_seconds": wait,
        "ticket_id": event.ticket_id,
        "queue_length": event.queue_length,
    }


def end_json(closed: ev.Closed) -> dict[str, Any]:
    """The last message of a session the server (not the client) ended: its limits as
    `timeout{reason}`, anything else as `error` with the close's sentence."""
    if closed.reason in (ev.TIMEOUT, ev.CONTEXT_FULL):
        return {"type": "timeout", "reason": closed.reason}
    return error_json(closed.message or close_message(closed.reason))


class LegacyDuplex(DuplexDialect):
    """/ws/duplex/{session_id}."""

    name = "legacy_duplex"
    traits = Traits(recorded=True, already_initialized="the session is already prepared")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.mode = "audio" if session_id.startswith(AUDIO_PREFIX) else "video"
        self._stopping = False
        #: Input received up to each unit still in flight, ms, by seq.
        self._input_ms: dict[int, int] = {}
        self._input_total_ms = 0

    def refusal(self) -> EdgeError | None:
        return path_id_refusal(self.session_id)

    def not_ready(self, cmd: ev.Command) -> str:
        what = {
            ev.AppendCommand: "audio_chunk",
            ev.PauseCommand: "pause",
            ev.ResumeCommand: "resume",
        }.get(type(cmd), "input")
        return f"send prepare and wait for prepared before {what}"

    def decode(self, message: Any) -> list[ev.Command]:
        if isinstance(message, bytes):
            raise InvalidPayload("binary frames are not part of the protocol")
        event = fields.parse_frame(message)
        kind = event["type"]
        if kind == "audio_chunk":
            return [chunk_command(event, frames_allowed=self.mode == "video")]
        if kind == "prepare":
            return [prepare_command(event)]
        if kind == "pause":
            return [ev.PauseCommand(pause_timeout(event))]
        if kind == "resume":
            return [ev.ResumeCommand()]
        if kind == "stop":
            self._stopping = True
            return [ev.CloseCommand()]
        if kind in _IGNORED_TYPES:
            return []
        raise UnknownEvent(f"unknown message type {kind[:64]!r}")

    def appended(self, seq: int, cmd: ev.AppendCommand) -> None:
        self._input_total_ms += len(cmd.pcm) // 4 * 1000 // INPUT_RATE
        self._input_ms[seq] = self._input_total_ms

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Queued | ev.QueueDone):
            return [queue_json(event)]
        if isinstance(event, ev.Created):
            return [
                {
                    "type": "prepared",
                    "prompt_length": event.prompt_length,
                    "recording_session_id": event.recording_id,
                }
            ]
        if isinstance(event, ev.Output):
            for seq in event.dropped_seqs:
                self._input_ms.pop(seq, None)
            current = self._input_ms.pop(event.seq, self._input_total_ms)
            return [result_json(event, current)]
        if isinstance(event, ev.Paused):
            return [{"type": "paused", "timeout": event.timeout_s}]
        if isinstance(event, ev.Resumed):
            return [{"type": "resumed"}]
        if isinstance(event, ev.Expiring):
            return []  # the reference server's protocol has no such event
        assert isinstance(event, ev.Closed)
        if event.client_reason == ev.PAUSE_TIMEOUT:
            return [{"type": "timeout", "reason": ev.PAUSE_TIMEOUT}]
        if self._stopping:
            return [{"type": "stopped", "session_id": self.session_id}]
        return [end_json(event)]

    def error(self, err: EdgeError) -> dict[str, Any]:
        return error_json(error_text(err))
