"""The legacy duplex endpoint `/ws/duplex/{session_id}`, kept for deployed pages and scripts.

One `LegacyDuplexConnection` per client drives a SessionCore, like `edge.ws.Connection`
does for /v1/realtime, and speaks the reference server's flat message set (spec README,
"Legacy endpoints"): client `prepare`, `audio_chunk`, `pause`, `resume`, `stop`; server
`queued`/`queue_update`/`queue_done`, `prepared`, one `result` per chunk, `paused`,
`resumed`, `stopped`, `timeout`, `error{error}`.

Choices where the spec leaves room (they follow the reference server's documentation):
- An id starting `adx_` is an audio session; any other id is omni (mode video). The id is
  the session id everywhere (scheduler, worker, logs).
- `prepared.recording_session_id` is null: sessions are not recorded yet, and a null id
  tells a client there is nothing to fetch (an id would point at no recording).
- `result.audio_data` is base64 float32 24 kHz PCM, and "" when the unit has no audio
  (listening, or text only); `text` is "" when listening. `cost_llm_ms`/`cost_tts_ms` are
  the engine's own costs (0 when it reports none), `cost_all_ms` = prefill + generate,
  `current_time` is the input audio received up to that unit in ms, and
  `server_send_ts` is the unix time of the send in **seconds** (a float, as the reference
  documents it; clients subtract it from their own clock for latency).
- Ends: `stop` -> `stopped{session_id}`; a pause outlasting its timeout ->
  `timeout{reason:"pause_timeout"}`; the worker's time limit or a full context ->
  `timeout{reason:"timeout"|"context_full"}`; an engine failure, a lost worker or a
  server shutdown -> `error{error}`. Each is followed by close 1000.
- Client mistakes (unknown type, missing or invalid fields, input before `prepared`)
  answer `error{error:"<text>"}` and the connection stays open; text that is not JSON
  closes it with 1003; queue and worker-start failures send `error` and close 1013.
  `error` events also carry the text as `message`, which the reference's own pages read.
- Accepted aliases from the reference's documentation: `prefix_system_prompt` for
  `system_prompt`, `audio` for `audio_base64`, config `generate_audio` for `tts_enabled`;
  `client_diagnostic` messages are accepted and ignored.
- `audio_chunk` while paused is forwarded and leaves the pause (and its watchdog) as is:
  only `resume` resumes. Frames sent to an `adx_` session are ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from edge import events as ev
from edge import pcm, protocol
from edge.errors import (
    EdgeError,
    InferenceError,
    InvalidEvent,
    InvalidPayload,
    MissingField,
    NotReady,
    UnknownEvent,
    legacy_error_event,
)
from edge.metrics import METRICS
from edge.session import SessionCore
from edge.ws import finish_timeout_s, outbox_for, shutdown_core

if TYPE_CHECKING:
    from edge.ws import EdgeApp

log = logging.getLogger("omnifabric.edge.legacy_duplex")

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


def _error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": message, "message": message}


def prepare_command(event: dict[str, Any]) -> ev.InitCommand:
    """A `prepare` message -> InitCommand; raises InvalidPayload for bad fields."""
    prompt = event.get("system_prompt", event.get("prefix_system_prompt"))
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidPayload("'system_prompt' must be a string")
    cfg = event.get("config")
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        raise InvalidPayload("'config' must be an object")
    settings = protocol.duplex_settings(cfg)
    generate_audio = cfg.get("generate_audio")
    if generate_audio is not None:
        if not isinstance(generate_audio, bool):
            raise InvalidPayload("config.generate_audio must be true or false")
        if settings.tts_enabled is None:
            settings = dataclasses.replace(settings, tts_enabled=generate_audio)
    slices = protocol.slices_field(event.get("max_slice_nums"), "'max_slice_nums'") or 1
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
        listed = event.get("frame_base64_list") or []
        if not isinstance(listed, list):
            raise InvalidPayload("'frame_base64_list' must be a list of base64 JPEG strings")
        if len(listed) > protocol.MAX_FRAMES_PER_UNIT:
            raise InvalidPayload(f"at most {protocol.MAX_FRAMES_PER_UNIT} frames per chunk")
        frames = tuple(pcm.jpeg_frame(f, f"frame_base64_list[{i}]") for i, f in enumerate(listed))
    force = event.get("force_listen")
    if force is None:
        force = False
    if not isinstance(force, bool):
        raise InvalidPayload("'force_listen' must be true or false")
    return ev.AppendCommand(pcm=unit, frames=frames, force_listen=force)


def pause_timeout(event: dict[str, Any]) -> float:
    """The `timeout` of a `pause` message in seconds (default 60); InvalidPayload."""
    value = event.get("timeout")
    if value is None:
        return DEFAULT_PAUSE_TIMEOUT_S
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_PAUSE_TIMEOUT_S
    ):
        raise InvalidPayload(
            f"'timeout' must be a number of seconds above 0 and at most {MAX_PAUSE_TIMEOUT_S:g}"
        )
    return float(value)


def result_json(out: ev.Output, current_time_ms: int) -> dict[str, Any]:
    """One unit's output as the legacy `result` message (server_send_ts set at send)."""
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


def end_json(closed: ev.Closed) -> dict[str, Any]:
    """The last message of a session the server (not the client) ended."""
    if closed.reason in (ev.TIMEOUT, ev.CONTEXT_FULL):
        return {"type": "timeout", "reason": closed.reason}
    if closed.reason == ev.SERVER_SHUTDOWN:
        return _error("the server is shutting down")
    if closed.error_code == InferenceError.code:
        return _error(f"inference failed: {closed.message or 'engine error'}")
    return _error(f"session closed: {closed.message or closed.reason}")


class LegacyDuplexConnection:
    """One /ws/duplex client: the legacy message set around a SessionCore."""

    def __init__(self, app: EdgeApp, ws: ServerConnection, session_id: str) -> None:
        self.app = app
        self.ws = ws
        self.session_id = session_id
        self.mode = "audio" if session_id.startswith(AUDIO_PREFIX) else "video"
        self.core = SessionCore(
            self.mode,
            app.fabric,
            self._on_event,
            start_timeout_s=app.config.worker_start_timeout_s,
            close_timeout_s=app.config.close_timeout_s,
            unit_timeout_s=app.config.unit_timeout_s,
            session_id=session_id,
        )
        self._pending: ev.InitCommand | None = None
        self._prepare_seen = False
        self._leased = asyncio.Event()
        self._done = asyncio.Event()
        #: The message that confirms an end this side asked for (stop, pause timeout).
        self._ending: dict[str, Any] | None = None
        self._watchdog: asyncio.Task | None = None
        self.outbox = outbox_for(app, ws, self.core, self._done, legacy_error_event)
        self.finished = asyncio.Event()
        """Set once the connection is over and its last frames went out (drain waits)."""
        #: Input received up to each unit still in flight, ms, by seq.
        self._input_ms: dict[int, int] = {}
        self._input_total_ms = 0

    @property
    def paused(self) -> bool:
        return self._watchdog is not None

    async def send(self, event: dict[str, Any]) -> None:
        """Queue one message for the client (never waits on the client's socket)."""
        self.outbox.send(event)

    # ---- session events --------------------------------------------------------

    async def _on_event(self, event: Any) -> None:
        if isinstance(event, ev.Queued):
            await self.send(
                {
                    "type": "queued" if event.first else "queue_update",
                    "position": event.position,
                    "estimated_wait_s": round(event.estimated_wait_s, 1),
                    "eta_seconds": round(event.estimated_wait_s, 1),
                    "ticket_id": event.ticket_id,
                    "queue_length": event.queue_length,
                }
            )
        elif isinstance(event, ev.QueueDone):
            await self.send({"type": "queue_done"})
        elif isinstance(event, ev.Created):
            await self.send(
                {
                    "type": "prepared",
                    "prompt_length": event.prompt_length,
                    "recording_session_id": None,
                }
            )
        elif isinstance(event, ev.Output):
            for seq in event.dropped_seqs:
                self._input_ms.pop(seq, None)
            current = self._input_ms.pop(event.seq, self._input_total_ms)
            await self.send(result_json(event, current))
        elif isinstance(event, ev.Closed):
            self._stop_watchdog()
            self._done.set()
            await self.send(self._ending or end_json(event))
            self.outbox.close(1000, event.reason)

    async def fail(self, err: EdgeError) -> None:
        """Tell the client; errors with a close code also close the connection."""
        METRICS.client_error(err.code)
        await self.send(_error(err.message))
        if err.close_code is not None:
            self._done.set()
            self.outbox.close(err.close_code, err.code)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: end the session with server_shutdown (see edge.ws.shutdown_core)."""
        await shutdown_core(self.core, self._on_event, timeout_s)

    # ---- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        """Serve the client until either side ends; the lease is always returned."""
        if not _SESSION_ID.fullmatch(self.session_id):
            await self.send(_error("the session id must be 1-128 letters, digits or _.:-"))
            self.outbox.close(1008, "invalid session id")
            await self.outbox.finish(self._finish_timeout_s())
            self.finished.set()
            return
        # Registered so that a draining edge ends this session like a realtime one
        # (the drain only touches `.core`).
        self.app.connections.add(self)  # type: ignore[arg-type]
        acquire = asyncio.create_task(self._acquire())
        try:
            await self._read()
        finally:
            self.app.connections.discard(self)  # type: ignore[arg-type]
            acquire.cancel()
            self._stop_watchdog()
            if not self.core.closed.is_set():
                await self.core.abort()
            await self.outbox.finish(self._finish_timeout_s())
            self.finished.set()

    def _finish_timeout_s(self) -> float:
        return finish_timeout_s(self.app.config)

    async def _acquire(self) -> None:
        try:
            await self.core.acquire()
        except EdgeError as err:
            if not self.core.closed.is_set():  # not the client's own stop while queued
                await self.fail(err)
            return
        self._leased.set()
        if self._pending is not None:
            await self._start(self._pending)

    async def _start(self, init: ev.InitCommand) -> None:
        try:
            await self.core.start(init)
        except EdgeError as err:
            await self.fail(err)
            if not self.core.started:
                # Refused before the worker was asked (outside its limits): the session
                # stays as it was, and a corrected prepare may follow.
                self._prepare_seen, self._pending = False, None
            elif err.close_code is None and not self.core.closed.is_set():
                await self.core.close(ev.USER_STOP)

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if self._done.is_set():
                    break
                if isinstance(message, bytes):
                    await self.fail(InvalidPayload("binary frames are not part of the protocol"))
                    continue
                try:
                    await self._handle(protocol.parse_frame(message))
                except protocol.InvalidJson:
                    self.outbox.close(1003, "invalid JSON")
                    return
                except EdgeError as err:
                    await self.fail(err)
        except ConnectionClosed:
            pass

    # ---- client messages -------------------------------------------------------

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "audio_chunk":
            await self._chunk(event)
        elif kind == "prepare":
            await self._prepare(event)
        elif kind == "pause":
            await self._pause(event)
        elif kind == "resume":
            await self._resume()
        elif kind == "stop":
            await self._stop()
        elif kind not in _IGNORED_TYPES:
            raise UnknownEvent(f"unknown message type {kind[:64]!r}")

    async def _prepare(self, event: dict[str, Any]) -> None:
        if self._prepare_seen:
            raise InvalidEvent("the session is already prepared")
        init = prepare_command(event)
        self._prepare_seen = True
        if not self._leased.is_set():
            # Sent during the queue: kept and applied once a worker is assigned.
            self._pending = init
            return
        await self._start(init)

    async def _chunk(self, event: dict[str, Any]) -> None:
        if not self.core.started:
            raise NotReady("send prepare and wait for prepared before audio_chunk")
        cmd = chunk_command(event, frames_allowed=self.mode == "video")
        seq = await self.core.append(cmd)
        self._input_total_ms += len(cmd.pcm) // 4 * 1000 // INPUT_RATE
        self._input_ms[seq] = self._input_total_ms

    async def _pause(self, event: dict[str, Any]) -> None:
        timeout = pause_timeout(event)
        if not self.core.started:
            raise NotReady("send prepare and wait for prepared before pause")
        # A second pause restarts the watchdog with its own timeout.
        self._stop_watchdog()
        self._watchdog = asyncio.create_task(self._expire(timeout))
        log.info("session %s paused for at most %.1fs", self.session_id, timeout)
        await self.send({"type": "paused", "timeout": timeout})

    async def _resume(self) -> None:
        if not self.core.started:
            raise NotReady("send prepare and wait for prepared before resume")
        # Resuming a session that is not paused is harmless: confirm it all the same.
        self._stop_watchdog()
        await self.send({"type": "resumed"})

    async def _stop(self) -> None:
        if self.core.closed.is_set():
            return
        self._ending = {"type": "stopped", "session_id": self.session_id}
        await self.core.close(ev.USER_STOP)

    async def _expire(self, timeout: float) -> None:
        """The pause watchdog: a pause that outlasts its timeout ends the session."""
        await asyncio.sleep(timeout)
        log.info("session %s: pause timeout after %.1fs", self.session_id, timeout)
        self._ending = {"type": "timeout", "reason": "pause_timeout"}
        await self.core.close(ev.USER_STOP)

    def _stop_watchdog(self) -> None:
        task, self._watchdog = self._watchdog, None
        # The watchdog itself may be ending the session: it must not cancel itself.
        if task is not None and task is not asyncio.current_task():
            task.cancel()
