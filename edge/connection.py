"""The connection drivers: the one loop every transport and dialect runs through.

A driver receives client messages from its transport, has its dialect translate them into
commands, acquires the lease and drives the worker stream (SessionCore for duplex,
edge.session.run_turn for chat), has the dialect render each result and hands the messages
to the transport, and ends the connection with the right reason. Dialects
(edge.dialects) hold no I/O; transports (edge.transports) hold no protocol.

A transport provides:
- `bind(on_overflow, render_error)`: called once by the driver before anything is sent;
- `await receive()`: the next client message, or None when the client's input ended;
- `input_end_closes`: True when the end of input is a request to end the session with
  the output still open (a gRPC half-close), False when the client is gone (WebSocket);
- `send(message)`, `close(code, reason)`: queue, never block;
- `await finish()`: flush what is queued (within the transport's own bound), then stop;
- `path`: the request path (recordings);
- `owner`: the digest of the client's API key ("" without keys);
- `dropped`: the client went away without a close (a resumable session is kept).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry import context as otel_context

from omnifabric.edge import cadence as cadences
from omnifabric.edge import events as ev
from omnifabric.edge.access import KeySessions
from omnifabric.edge.apps import Apps
from omnifabric.edge.chat import (
    SHUTDOWN_MESSAGE,
    ChatClose,
    ChatOpen,
    ChatTurn,
    Shutdown,
    TurnDone,
    TurnEvent,
    TurnStarted,
    parse_chat,
)
from omnifabric.edge.chat_input import ChatInput
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.dialects.base import ChatDialect, DuplexDialect, SessionFacts
from omnifabric.edge.errors import (
    AppDisabled,
    EdgeError,
    InternalError,
    InvalidEvent,
    InvalidPayload,
)
from omnifabric.edge.fabric import Fabric
from omnifabric.edge.fields import InvalidJson
from omnifabric.edge.metrics import EdgeMetrics
from omnifabric.edge.presets import Presets
from omnifabric.edge.recording import SessionRecorder
from omnifabric.edge.session import SessionCore, new_session_id, run_turn
from omnifabric.edge.sessions_api import Recordings
from omnifabric.edge.voices import VoiceRegistry

log = logging.getLogger("omnifabric.edge.connection")

#: Close code and reason of a frame that is not JSON text.
INVALID_JSON_CLOSE = (1003, "invalid JSON")


class EdgeContext(Protocol):
    """What a driver needs of the edge it runs in (edge.app.EdgeApp provides it)."""

    config: EdgeConfig
    fabric: Fabric
    metrics: EdgeMetrics
    key_sessions: KeySessions
    apps: Apps
    recordings: Recordings
    presets: Presets
    voices: VoiceRegistry
    connections: set[DuplexConnection]
    chats: set[ChatConnection]
    http_tasks: set[asyncio.Task]
    draining: bool


class Transport(Protocol):
    path: str
    input_end_closes: bool
    owner: str
    dropped: bool

    def bind(
        self, on_overflow: Callable[[], None], render_error: Callable[[EdgeError], Any]
    ) -> None: ...

    async def receive(self) -> Any | None: ...

    def send(self, message: Any) -> None: ...

    def send_all(self, messages: list[Any]) -> None:
        """Send messages in order; a transport may write them together."""

    def close(self, code: int, reason: str) -> None: ...

    async def finish(self) -> None: ...


async def shutdown_core(core: SessionCore, emit: Any, timeout_s: float) -> None:
    """End a session with server_shutdown, confirmed by its worker; if the worker does not
    confirm within timeout_s, drop the worker stream and emit the Closed event here."""
    if core.closed.is_set():
        return
    try:
        await asyncio.wait_for(core.close(ev.SERVER_SHUTDOWN), timeout_s)
    except TimeoutError:
        pass
    if not core.closed.is_set():
        log.warning("session %s: no end confirmed by the worker: closed here", core.session_id)
        await core.abort()
        await emit(ev.Closed(ev.SERVER_SHUTDOWN, ev.Usage(), SHUTDOWN_MESSAGE))


class DuplexConnection:
    """One duplex session over any transport: queue, init, units, pause, close."""

    def __init__(self, app: EdgeContext, transport: Transport, dialect: DuplexDialect) -> None:
        self.app = app
        self.transport = transport
        self.dialect = dialect
        self.core: SessionCore | None = None
        self.recorder: SessionRecorder | None = None
        self._leased = asyncio.Event()
        self._done = asyncio.Event()
        """The session's end is queued for the client: no more input is read."""
        self._pause: asyncio.Task | None = None
        self._aborting: asyncio.Future | None = None
        self._acquiring: asyncio.Task | None = None
        """Waiting in the queue (or resuming), then starting the session."""
        self.cadence = cadences.for_traits(dialect.traits.cadence)
        """How the client's stream of audio becomes units (edge.cadence), when the dialect's
        client does not send whole units."""
        self._ticker: asyncio.Task | None = None
        """The cadence's clock."""
        self._turn: asyncio.Task | None = None
        """A chat turn beside the session (ev.TurnCommand)."""
        self.finished = asyncio.Event()
        """Set once the connection is over and its last messages went out (drain waits)."""
        transport.bind(self._overflowed, self._render_error)

    @property
    def mode(self) -> str | None:
        return self.dialect.mode

    # ---- out ------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._send_all([message])

    def _send_all(self, messages: list[Any]) -> None:
        """One event's messages (a unit's text, audio and end of turn): written together."""
        if self.recorder is not None:
            for message in messages:
                if isinstance(message, dict):
                    self.recorder.outbound(message)
        self.transport.send_all(messages)

    def _render_error(self, err: EdgeError) -> Any:
        self.app.metrics.client_error(err.code)
        return self.dialect.error(err)

    def fail(self, err: EdgeError) -> None:
        """Tell the client about an error; fatal ones end the connection with their code."""
        self._send(self._render_error(err))
        if err.close_code is not None:
            self._done.set()
            self.transport.close(err.close_code, err.code)

    def _overflowed(self) -> None:
        # The transport already queued slow_client and its end: the session ends now.
        self._done.set()
        if self.core is not None:
            # Held: the loop keeps only a weak reference to a task.
            self._aborting = asyncio.ensure_future(self.core.abort())

    async def _emit(self, event: ev.SessionEvent) -> None:
        """Session events (SessionCore's emit, the pause watchdog) -> the client."""
        if isinstance(event, ev.Created | ev.Reattached) and self.core is not None:
            if self.cadence is not None:  # units of the leased worker's lengths from now
                core = self.core
                self.cadence.start(core.unit_bounds, time.monotonic(), core.units_as_sent)
        if isinstance(event, ev.Created) and self.recorder is not None:
            event = dataclasses.replace(event, recording_id=self.recorder.recording_id)
        if isinstance(event, ev.Reattached):
            # ResumeExpired: _resume fails it
            self._send_all(list(self.dialect.replay(event)))
            return
        if isinstance(event, ev.Closed):
            self._stop_pause()
            self._done.set()
            if self.cadence is not None:
                self.cadence.close()
            if event.error_code:
                self.app.metrics.client_error(event.error_code)
        elif isinstance(event, ev.Output) and self.recorder is not None:
            self.recorder.output(event)
        self._send_all(self.dialect.encode(event))
        if isinstance(event, ev.Closed):
            self.transport.close(1000, event.reason)
        elif isinstance(event, ev.Output):
            try:
                for cmd in self.dialect.after_output(event):
                    await self._handle(cmd)
                if self.cadence is not None:  # the next unit may go once this was answered
                    self.cadence.answered(event)
                    for unit in self.cadence.due(time.monotonic(), clock=False):
                        await self._append(unit, self.cadence)
            except EdgeError as err:  # the session ended meanwhile: nothing to feed
                log.debug("a command after an output dropped: %s", err)

    async def stop_turn(self) -> bool:
        """End the model's turn now (POST /api/half_duplex/stop); False when the dialect has
        nothing to stop (no answer in progress)."""
        commands = self.dialect.stop_turn()
        for cmd in commands:
            await self._handle(cmd)
        return bool(commands)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: end the session with server_shutdown (see shutdown_core)."""
        if self.core is not None:
            await shutdown_core(self.core, self._emit, timeout_s)

    # ---- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the client until either side ends; the lease is always returned."""
        try:
            refusal = self.dialect.refusal()
            if refusal is not None:
                self.fail(refusal)
                return
            first: list[ev.Command] = []
            if self.dialect.mode is None:  # the first message names the mode (gRPC)
                message = await self.transport.receive()
                if message is None or not self._decode(message, first):
                    return
            await self._serve(first)
        finally:
            await self.transport.finish()
            self.finished.set()

    async def _serve(self, first: list[ev.Command]) -> None:
        assert self.dialect.mode is not None
        traits = self.dialect.traits
        kind = traits.app_mode or self.dialect.mode
        if not self.app.apps.enabled(kind):
            self.fail(AppDisabled(f"{kind} sessions are switched off"))
            return
        config = self.app.config
        owner = self.transport.owner
        core = self.core = SessionCore(
            self.dialect.mode,
            self.app.fabric,
            self._emit,
            start_timeout_s=config.worker_start_timeout_s,
            close_timeout_s=config.close_timeout_s,
            unit_timeout_s=config.unit_timeout_s,
            session_id=self.dialect.session_id,
            metrics=self.app.metrics,
            resume_window_s=config.resume_window_s if traits.resumable else 0.0,
            owner=owner,
            key_limit=self.app.key_sessions.limit(owner) if owner else 0,
            early_results=traits.early_results,
            speech_cuts=self.cadence is not None and self.cadence.speech_cuts,
        )
        self.dialect.bind(SessionFacts(core.session_id, self.app.voices.pcm))
        if traits.recorded and not self.dialect.resume_token:
            # opt-in (--record-dir); a disabled recorder ignores all
            self.recorder = SessionRecorder.for_session(
                config, core.session_id, self.dialect.mode, self.transport.path
            )
        self.app.connections.add(self)
        # The session span is current for everything this connection does (log lines
        # carry its trace id; tasks created below inherit it).
        token = otel_context.attach(core.trace_context)
        self._send_all(self.dialect.opening())
        if self.dialect.resume_token:
            self._acquiring = asyncio.create_task(self._resume())
        elif not traits.lease_on_init:
            self._acquiring = asyncio.create_task(self._acquire())
        if self.cadence is not None and self.cadence.tick_s > 0:
            self._ticker = asyncio.create_task(self._tick(self.cadence))
        try:
            for cmd in first:
                await self._handle(cmd)
            await self._read()
        finally:
            self.app.connections.discard(self)
            for task in (self._acquiring, self._ticker, self._turn):
                if task is not None:
                    task.cancel()
            self._stop_pause()
            if not core.closed.is_set():
                # A dropped connection (no close frame) keeps a resumable session.
                await core.abort(keep=self.transport.dropped)
            if self.recorder is not None:
                self.recorder.finish(core.worker_id)
            otel_context.detach(token)

    def _decode(self, message: Any, into: list[ev.Command]) -> bool:
        """Translate one message into `into`; False when the connection is over."""
        try:
            into.extend(self.dialect.decode(message))
        except InvalidJson:
            self._done.set()
            self.transport.close(*INVALID_JSON_CLOSE)
            return False
        except EdgeError as err:
            self.fail(err)
        return not self._done.is_set()

    async def _read(self) -> None:
        assert self.core is not None
        while not self._done.is_set():
            if self.dialect.traits.holds_input_until_started and self.core.init is not None:
                await self._until_started()
                if self._done.is_set():
                    return
            message = await self.transport.receive()
            if message is None:
                if (
                    self.transport.input_end_closes
                    and not self.transport.dropped
                    and not self.core.closed.is_set()
                ):
                    await self.core.close(ev.CLIENT_CLOSED)
                return
            if self._done.is_set():
                return
            commands: list[ev.Command] = []
            if not self._decode(message, commands):
                return
            for cmd in commands:
                try:
                    await self._handle(cmd)
                except EdgeError as err:
                    self.fail(err)

    async def _until_started(self) -> None:
        assert self.core is not None
        while not self.core.started_event.is_set() and not self._done.is_set():
            done = asyncio.ensure_future(self._done.wait())
            started = asyncio.ensure_future(self.core.started_event.wait())
            try:
                await asyncio.wait({done, started}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                done.cancel()
                started.cancel()

    async def _acquire(self) -> None:
        assert self.core is not None
        try:
            await self.core.acquire()
        except EdgeError as err:
            if not self.core.closed.is_set():  # not the client's own close while queued
                self.fail(err)
            return
        except Exception:
            log.exception("session %s: the queue failed", self.core.session_id)
            self.fail(InternalError("internal error"))
            return
        self._leased.set()
        if self.core.init is not None:
            await self._start(self.core.init)

    async def _resume(self) -> None:
        """Take over the session of the client's resume token instead of a new one."""
        assert self.core is not None
        try:
            await self.core.resume(self.dialect.resume_token)
        except EdgeError as err:
            if not self.core.closed.is_set():
                self.fail(err)
                await self.core.abort(keep=True)
            return
        except Exception:
            log.exception("session %s: the resume failed", self.core.session_id)
            self.fail(InternalError("internal error"))
            await self.core.abort(keep=True)
            return
        self._leased.set()

    def _with_voices(self, init: ev.InitCommand) -> ev.InitCommand:
        """The init with its registered voices (ref_audio_id) filled in as audio; an unknown
        id is refused like any bad init field."""

        def voice(field: str, voice_id: str, sent: bytes) -> bytes:
            if not voice_id:
                return sent
            audio = self.app.voices.pcm(voice_id)
            if audio is None:
                raise InvalidPayload(f"{field}_id: no registered reference audio {voice_id!r}")
            return audio

        return dataclasses.replace(
            init,
            ref_audio=voice("ref_audio", init.ref_audio_id, init.ref_audio),
            tts_ref_audio=voice("tts_ref_audio", init.tts_ref_audio_id, init.tts_ref_audio),
        )

    async def _start(self, init: ev.InitCommand) -> None:
        assert self.core is not None
        try:
            # Outside the leased worker's limits: refused before anything is sent or
            # recorded; the session stays as it was and a corrected init may follow.
            self.core.check_init(init)
        except EdgeError as err:
            self.core.refuse_init()
            self.fail(self.dialect.init_refused(err))
            return
        if self.recorder is not None:
            self.recorder.start(init)
        try:
            await self.core.start(init, self.dialect.client_state())
        except EdgeError as err:
            self.fail(err)
            if err.close_code is None and not self.core.started:
                self.core.refuse_init()  # refused, not failed: a corrected init may follow
        except Exception:
            log.exception("session %s: the start failed", self.core.session_id)
            self.fail(InternalError("internal error"))

    # ---- commands ---------------------------------------------------------------------

    async def _handle(self, cmd: ev.Command) -> None:
        core = self.core
        assert core is not None
        if isinstance(cmd, ev.CloseCommand):
            if self.recorder is not None:
                self.recorder.close_command(cmd)
            await core.close(ev.USER_STOP, cmd.reason)
        elif isinstance(cmd, ev.InitCommand):
            core.take_init(cmd, self.dialect.traits.already_initialized)
            try:
                cmd = core.init = self._with_voices(cmd)
            except EdgeError:
                core.refuse_init()
                raise
            if self._leased.is_set():
                await self._start(cmd)
            elif self._acquiring is None:  # the dialect queues from its first init
                self._acquiring = asyncio.create_task(self._acquire())
            # Sent during the queue: applied once a worker is assigned (_acquire).
        elif isinstance(cmd, ev.AppendCommand):
            await self._append(cmd)
        elif isinstance(cmd, ev.AudioCommand | ev.EndTurnCommand | ev.ClearAudioCommand):
            await self._stream(cmd)
        elif isinstance(cmd, ev.ToolOutputCommand):
            await core.tool_output(cmd)
        elif isinstance(cmd, ev.PauseCommand):
            core.require_started(self.dialect.not_ready(cmd))
            # A second pause restarts the watchdog with its own timeout.
            self._stop_pause()
            self._pause = asyncio.create_task(self._expire(cmd.timeout_s))
            if not cmd.idle:
                log.info("session %s paused for at most %.1fs", core.session_id, cmd.timeout_s)
                await self._emit(ev.Paused(cmd.timeout_s))
        elif isinstance(cmd, ev.ResumeCommand):
            core.require_started(self.dialect.not_ready(cmd))
            # Resuming a session that is not paused is harmless: confirmed all the same.
            self._stop_pause()
            await self._emit(ev.Resumed())
        elif isinstance(cmd, ev.SendCommand):
            self._send_all(list(cmd.messages))
        elif isinstance(cmd, ev.TurnCommand):
            if self._turn is not None and not self._turn.done():
                raise InvalidEvent("a response is still being generated")
            chat = cmd.chat
            if chat is None:
                # Off the loop: decoding and resampling a turn's audio takes milliseconds.
                chat = await asyncio.to_thread(parse_chat, cmd.body or {})
            if not self._done.is_set():
                self._turn = asyncio.create_task(self._chat_turn(chat))
        elif isinstance(cmd, ev.CancelTurnCommand):
            if self._turn is not None:
                self._turn.cancel()
        else:
            raise InvalidEvent(f"unsupported command {type(cmd).__name__}")

    async def _append(self, cmd: ev.AppendCommand, cadence: cadences.Cadence | None = None) -> None:
        """One unit to the worker (`cadence`: the one that made it)."""
        core = self.core
        assert core is not None
        core.require_started(self.dialect.not_ready(cmd))
        if self.recorder is not None:
            self.recorder.append(cmd, core.init.dialect if core.init else None)
        seq = await core.append(cmd)
        if cadence is not None:
            cadence.sent(seq, time.monotonic())
        self.dialect.appended(seq, cmd)

    async def _stream(
        self, cmd: ev.AudioCommand | ev.EndTurnCommand | ev.ClearAudioCommand
    ) -> None:
        """The client's stream of audio, through the cadence, to the units it makes."""
        cadence = self.cadence
        if cadence is None:
            raise InvalidEvent(f"{type(cmd).__name__}: this protocol sends whole units")
        assert self.core is not None
        if not cadence.holds_before_start:
            self.core.require_started(self.dialect.not_ready(cmd))
        if isinstance(cmd, ev.AudioCommand):
            cadence.push(cmd.samples, cmd.rate)
            units = cadence.due(time.monotonic(), clock=False)
        elif isinstance(cmd, ev.EndTurnCommand):
            units = cadence.end_turn() + cadence.due(time.monotonic(), clock=False)
        else:
            cadence.clear()
            units = []
        for unit in units:
            await self._append(unit, cadence)

    async def _chat_turn(self, chat: ChatInput) -> None:
        """One chat turn beside the session (ev.TurnCommand): its events to the dialect."""
        assert self.core is not None

        async def emit(event: TurnEvent) -> None:
            self._send_all(self.dialect.encode_turn(event))

        owner = self.transport.owner
        try:
            await emit(TurnStarted(chat.streaming, chat.speech))
            done = await run_turn(
                self.app.fabric,
                chat,
                self.core.session_id,
                emit,
                owner,
                self.app.key_sessions.limit(owner) if owner else 0,
            )
        except EdgeError as err:
            self.app.metrics.client_error(err.code)
            self._send_all(self.dialect.turn_failed(err))
            return
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("session %s: a chat turn failed", self.core.session_id)
            self._send_all(self.dialect.turn_failed(InternalError("internal error")))
            return
        await emit(TurnDone(done))

    async def _tick(self, cadence: cadences.Cadence) -> None:
        """The cadence's clock: the units it makes due, every tick_s, until the end."""
        while not self._done.is_set():
            await asyncio.sleep(cadence.tick_s)
            for unit in cadence.due(time.monotonic(), clock=True):
                try:
                    await self._append(unit, cadence)
                except EdgeError as err:
                    self.fail(err)

    async def _expire(self, timeout_s: float) -> None:
        """The pause watchdog: a pause that outlasts its timeout ends the session."""
        assert self.core is not None
        await asyncio.sleep(timeout_s)
        log.info("session %s: pause timeout after %.1fs", self.core.session_id, timeout_s)
        await self.core.close(ev.USER_STOP, ev.PAUSE_TIMEOUT)

    def _stop_pause(self) -> None:
        task, self._pause = self._pause, None
        # The watchdog itself may be ending the session: it must not cancel itself.
        if task is not None and task is not asyncio.current_task():
            task.cancel()


# ---- chat ---------------------------------------------------------------------------


class ChatConnection:
    """Turn-based chat over any transport: each request is one turn that holds a worker
    slot only while it is generated (edge.chat)."""

    def __init__(self, app: EdgeContext, transport: Transport, dialect: ChatDialect) -> None:
        self.app = app
        self.transport = transport
        self.dialect = dialect
        dialect.session_id = new_session_id(dialect.id_prefix)
        self.turn: asyncio.Task | None = None
        self.ended = False
        """The end is queued (client close, fatal error, overflow, drain): no more turns."""
        self.draining = False
        self._drained = asyncio.Event()
        """The drain's end (the dialect's shutdown message and close) is queued."""
        self.finished = asyncio.Event()
        """Set once the connection is over and its last messages went out (drain waits)."""
        transport.bind(self._overflowed, self._render_error)

    def _render_error(self, err: EdgeError) -> Any:
        self.app.metrics.client_error(err.code)
        return self.dialect.error(err)

    def _send_all(self, messages: list[Any]) -> None:
        self.transport.send_all(messages)

    def _overflowed(self) -> None:
        # The transport already queued slow_client and its end. The turn would only fill
        # it again: cancel it so its worker slot comes back now.
        self.ended = True
        if self.turn is not None:
            self.turn.cancel()

    def _end(self, messages: list[Any], code: int, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self._send_all(messages)
        self.transport.close(code, reason)

    def fail(self, err: EdgeError) -> None:
        """Tell the client; errors with a close code (and any error of a one-request
        dialect) end the connection."""
        if self.ended:
            return
        message = self._render_error(err)
        if err.close_code is not None or self.dialect.one_request:
            self._end([message], err.close_code or 1000, err.code)
        else:
            self.transport.send(message)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: a turn in progress gets up to timeout_s to finish (its last message goes
        out), then the dialect's shutdown message and close 1001."""
        self.draining = True
        task = self.turn
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout_s)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._end(self.dialect.encode(Shutdown()), Shutdown.close_code, Shutdown.reason)
        self._drained.set()

    async def run(self) -> None:
        """Serve the client until either side ends; a turn in progress is cancelled (its
        worker slot returned) when the client goes away."""
        self.app.chats.add(self)
        try:
            if not self.app.apps.enabled("chat"):
                self.fail(AppDisabled("chat sessions are switched off"))
                return
            self._send_all(self.dialect.opening())
            await self._read()
            if self.turn is not None and self.dialect.one_request:
                # One request served: wait for its turn, or for the client to leave.
                gone = asyncio.ensure_future(self._until_gone())
                await asyncio.wait({self.turn, gone}, return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
                if self.draining:  # the drain cut the turn: its end goes out first
                    await self._drained.wait()
        finally:
            self.app.chats.discard(self)
            self.ended = True
            if self.turn is not None:
                self.turn.cancel()
                await asyncio.gather(self.turn, return_exceptions=True)
            await self.transport.finish()
            self.finished.set()

    async def _until_gone(self) -> None:
        """Read (and drop) what a one-request client sends after its request, until its
        input ends."""
        while await self.transport.receive() is not None:
            pass

    async def _receive(self) -> Any | None:
        if not self.dialect.one_request:
            return await self.transport.receive()
        limit = self.app.config.open_timeout_s * 6
        try:
            return await asyncio.wait_for(self.transport.receive(), limit)
        except TimeoutError:
            self.fail(InvalidEvent("no request received"))
            return None

    async def _read(self) -> None:
        while not self.ended:
            message = await self._receive()
            if message is None or self.ended:
                return
            try:
                commands = self.dialect.decode(message)
            except InvalidJson:
                self._end([], *INVALID_JSON_CLOSE)
                return
            except EdgeError as err:
                self.fail(err)
                continue
            for cmd in commands:
                try:
                    if isinstance(cmd, ChatOpen):
                        self._send_all(self.dialect.encode(cmd))
                    elif isinstance(cmd, ChatTurn):
                        await self._begin(cmd)
                    elif isinstance(cmd, ChatClose):
                        if self.turn is not None:
                            self.turn.cancel()
                        self._end(self.dialect.encode(cmd), 1000, cmd.reason)
                        return
                except EdgeError as err:
                    self.fail(err)
            if self.dialect.one_request and self.turn is not None:
                return

    async def _begin(self, cmd: ChatTurn) -> None:
        if self.draining:
            raise InvalidEvent(SHUTDOWN_MESSAGE)
        if self.turn is not None and not self.turn.done():
            raise InvalidEvent("a turn is still being generated: wait for response.done")
        # Off the loop: base64, audio resampling and video decoding take milliseconds to
        # seconds, and other sessions share this loop.
        chat = await asyncio.to_thread(parse_chat, cmd.body)
        # The connection may have ended, or the drain begun, while it was decoded.
        if self.ended:
            return
        if self.draining:
            raise InvalidEvent(SHUTDOWN_MESSAGE)
        self.turn = asyncio.create_task(self._turn(chat))

    async def _turn(self, chat: ChatInput) -> None:
        async def emit(event: TurnEvent) -> None:
            self._send_all(self.dialect.encode(event))

        await emit(TurnStarted(chat.streaming, chat.speech))
        try:
            owner = self.transport.owner
            done = await run_turn(
                self.app.fabric,
                chat,
                self.dialect.session_id,
                emit,
                owner,
                self.app.key_sessions.limit(owner) if owner else 0,
            )
        except EdgeError as err:
            self.fail(err)
            return
        except Exception:
            log.exception("chat turn failed")
            self.fail(InternalError("internal error"))
            return
        messages = self.dialect.encode(TurnDone(done))
        if self.dialect.one_request:
            self._end(messages, 1000, "done")
        else:
            self._send_all(messages)


def connection_for(
    app: EdgeContext, transport: Transport, dialect: DuplexDialect | ChatDialect
) -> DuplexConnection | ChatConnection:
    """The driver of a dialect's kind."""
    if isinstance(dialect, ChatDialect):
        return ChatConnection(app, transport, dialect)
    return DuplexConnection(app, transport, dialect)
