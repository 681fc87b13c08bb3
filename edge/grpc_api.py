"""RealtimeService: the public session events in protobuf, for internal gRPC clients.

Same state machine and session core as the WebSocket path; audio travels as raw
bytes. Fatal errors end the call with a status code (UNAUTHENTICATED without a valid
`authorization: Bearer KEY` when keys are configured, RESOURCE_EXHAUSTED for a full
queue, a key at its session limit, or a client too slow to read (`slow_client`: responses
are bounded like a WebSocket client's outbox), UNAVAILABLE for no service,
INVALID_ARGUMENT for a bad first message, INTERNAL with a generic message for anything
unexpected); client mistakes during a session arrive as `error` events and the stream
stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from edge import events as ev
from edge import pcm
from edge.access import KeySessions, key_digest
from edge.config import EdgeConfig
from edge.errors import (
    EdgeError,
    InferenceError,
    InvalidPayload,
    MissingField,
    QueueFull,
    ServiceUnavailable,
    SlowClient,
)
from edge.fabric import Fabric
from edge.metrics import METRICS
from edge.protocol import MAX_FRAMES_PER_UNIT
from edge.session import SessionCore, reason_name, usage_to
from omni.realtime.v1 import common_pb2
from omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

log = logging.getLogger("omnifabric.edge.grpc")

_MODE_NAMES = {common_pb2.MODE_AUDIO: "audio", common_pb2.MODE_VIDEO: "video"}
_STATUS = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # Only from core.start: an init outside the leased worker's limits.
    InvalidPayload: grpc.StatusCode.INVALID_ARGUMENT,
}


def _settings(msg: common_pb2.DuplexConfig) -> ev.DuplexSettings:
    return ev.DuplexSettings(
        **{f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if msg.HasField(f.name)}
    )


def _init(msg: rt_pb.SessionInit) -> ev.InitCommand:
    def voice(raw: bytes, what: str) -> bytes:
        if raw[:4] == b"RIFF":
            return pcm.wav_to_pcm16k(raw, what)
        if len(raw) % 4:
            raise InvalidPayload(f"{what}: not a WAV file and not float32 PCM")
        return raw

    return ev.InitCommand(
        dialect=ev.Dialect.CURRENT,
        system_prompt=msg.system_prompt,
        config=_settings(msg.config),
        ref_audio=voice(msg.ref_audio, "ref_audio") if msg.ref_audio else b"",
        tts_ref_audio=voice(msg.tts_ref_audio, "tts_ref_audio") if msg.tts_ref_audio else b"",
        max_slice_nums=msg.max_slice_nums or 1,
    )


def _append(msg: rt_pb.InputAppend) -> ev.AppendCommand:
    if not msg.audio:
        raise MissingField("'audio' is required")
    if len(msg.video_frames) > MAX_FRAMES_PER_UNIT:
        raise InvalidPayload(f"at most {MAX_FRAMES_PER_UNIT} video frames per unit")
    for i, frame in enumerate(msg.video_frames):
        pcm.check_jpeg(frame, f"video_frames[{i}]")
    return ev.AppendCommand(
        pcm=pcm.check_unit_pcm(msg.audio),
        frames=tuple(msg.video_frames),
        force_listen=msg.force_listen,
        max_slice_nums=msg.max_slice_nums,
    )


def _event(event: object, session_id: str) -> rt_pb.ConnectResponse:
    if isinstance(event, ev.Queued):
        q = rt_pb.QueueEvent(
            position=event.position,
            estimated_wait_s=event.estimated_wait_s,
            ticket_id=event.ticket_id,
            queue_length=event.queue_length,
        )
        return (
            rt_pb.ConnectResponse(queued=q)
            if event.first
            else rt_pb.ConnectResponse(queue_update=q)
        )
    if isinstance(event, ev.QueueDone):
        return rt_pb.ConnectResponse(queue_done=rt_pb.QueueDone())
    if isinstance(event, ev.Created):
        return rt_pb.ConnectResponse(
            created=rt_pb.SessionCreated(
                session_id=event.session_id,
                prompt_length=event.prompt_length,
                notes=list(event.notes),
            )
        )
    if isinstance(event, ev.Output):
        t = event.timings_ms
        timings = common_pb2.UnitTimings(
            prefill_ms=t.get("prefill_ms", 0.0),
            generate_ms=t.get("generate_ms", 0.0),
            finalize_wait_ms=t.get("finalize_wait_ms", 0.0),
            wall_clock_ms=t.get("wall_clock_ms", 0.0),
            queue_ms=t.get("queue_ms", 0.0),
        )
        return rt_pb.ConnectResponse(
            output=rt_pb.OutputUnit(
                seq=event.seq,
                is_listen=event.is_listen,
                text=event.text,
                audio=event.pcm,
                end_of_turn=event.end_of_turn,
                kv_cache_length=event.kv_cache_length,
                timings=timings,
                usage=usage_to(event.usage),
                dropped_seqs=list(event.dropped_seqs),
                input_transcript=event.input_transcript,
            )
        )
    assert isinstance(event, ev.Closed)
    value = common_pb2.CloseReason.Value("CLOSE_REASON_" + event.reason.upper())
    return rt_pb.ConnectResponse(
        closed=rt_pb.SessionClosed(
            session_id=session_id,
            reason=value,
            reason_text=event.client_reason or reason_name(value),
            usage=usage_to(event.usage),
        )
    )


def _error(err: EdgeError) -> rt_pb.ConnectResponse:
    METRICS.client_error(err.code)
    return rt_pb.ConnectResponse(
        error=rt_pb.ErrorEvent(code=err.code, message=err.message, type=err.kind)
    )


class Outbound:
    """Responses to one RealtimeService client, bounded in messages and serialized bytes
    by the same limits as a WebSocket client's outbox (edge.outbox).

    `put` never blocks. A client that stops reading stops the call's writes (HTTP/2 flow
    control), then fills this queue: past its bound the queue is dropped, `on_overflow`
    runs once, and `get` answers OVERFLOW from then on.
    """

    OVERFLOW = object()
    """What `get` returns once the bound was passed."""

    def __init__(self, max_messages: int, max_bytes: int, on_overflow: Callable[[], None]) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.on_overflow = on_overflow
        self.overflowed = False
        self._items: deque[tuple[rt_pb.ConnectResponse | None, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def put(self, item: rt_pb.ConnectResponse | None) -> None:
        """Queue one response (None: the stream's end, which always fits, as one response
        always fits an empty queue)."""
        if self.overflowed:
            return
        size = 0 if item is None else item.ByteSize()
        if (
            item is not None
            and self._items
            and (len(self._items) >= self.max_messages or self._bytes + size > self.max_bytes)
        ):
            self._overflow()
            return
        self._items.append((item, size))
        self._bytes += size
        self._ready.set()

    async def get(self) -> rt_pb.ConnectResponse | None | object:
        """The next response, None at the end, or OVERFLOW."""
        while not self._items and not self.overflowed:
            self._ready.clear()
            await self._ready.wait()
        if self.overflowed:
            return self.OVERFLOW
        item, size = self._items.popleft()
        self._bytes -= size
        return item

    def _overflow(self) -> None:
        log.warning(
            "gRPC client not reading: %d messages (%d bytes) waiting, bound %d messages / "
            "%d bytes: ending the call with RESOURCE_EXHAUSTED",
            len(self._items),
            self._bytes,
            self.max_messages,
            self.max_bytes,
        )
        self.overflowed = True
        # What was queued is what costs memory, and the client will not get it.
        self._items.clear()
        self._bytes = 0
        self._ready.set()
        self.on_overflow()


def _authorization(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return ""


class RealtimeServicer(rt_grpc.RealtimeServiceServicer):
    """Thin servicer: protobuf <-> session commands and events."""

    def __init__(self, fabric: Fabric, config: EdgeConfig, keys: KeySessions) -> None:
        self._fabric = fabric
        self._config = config
        self._keys = keys
        self._live: dict[SessionCore, Any] = {}
        """Open sessions and their emit callbacks (the drain ends them)."""

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: end every open session with server_shutdown (see edge.ws.shutdown_core)."""
        from edge.ws import shutdown_core

        await asyncio.gather(
            *(shutdown_core(core, emit, timeout_s) for core, emit in list(self._live.items())),
            return_exceptions=True,
        )

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        digest = key_digest(self._config, _authorization(context))
        if digest is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        if digest and not self._keys.take(digest):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "this API key holds as many open sessions as its limit allows",
            )
        try:
            # aclosing: the session's cleanup runs at once, whichever way the call ends.
            async with contextlib.aclosing(self._connect(request_iterator, context)) as stream:
                async for response in stream:
                    yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:
            # Internals (exception text, paths) stay in the log, not in the status.
            log.exception("RealtimeService.Connect failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if digest:
                self._keys.give_back(digest)

    async def _connect(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "init":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must be init")
        mode = _MODE_NAMES.get(first.init.mode)
        if mode is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "init.mode must be AUDIO or VIDEO"
            )
        try:
            init = _init(first.init)
        except EdgeError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err.message)

        holder: list[SessionCore] = []
        ending: list[asyncio.Future] = []
        slow = SlowClient(
            f"the client is not reading: over {self._config.outbound_queue_max} messages or "
            f"{self._config.outbound_queue_bytes} bytes were waiting to be sent"
        )

        def overflowed() -> None:
            # The session ends now (worker stream and lease dropped); the status goes out
            # once the client takes what its HTTP/2 window already holds.
            METRICS.client_error(slow.code)
            driver.cancel()
            ending.append(asyncio.ensure_future(holder[0].abort()))

        out = Outbound(
            self._config.outbound_queue_max, self._config.outbound_queue_bytes, overflowed
        )

        async def emit(event: object) -> None:
            if isinstance(event, ev.Closed) and event.error_code == InferenceError.code:
                out.put(_error(InferenceError(event.message or "inference failed")))
            out.put(_event(event, holder[0].session_id))
            if isinstance(event, ev.Closed):
                out.put(None)

        core = SessionCore(
            mode,
            self._fabric,
            emit,
            start_timeout_s=self._config.worker_start_timeout_s,
            close_timeout_s=self._config.close_timeout_s,
            unit_timeout_s=self._config.unit_timeout_s,
        )
        holder.append(core)
        self._live[core] = emit

        async def drive() -> None:
            await core.acquire()
            await core.start(init)
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                try:
                    if kind == "append":
                        await core.append(_append(request.append))
                    elif kind == "close":
                        await core.close(ev.USER_STOP, request.close.reason or None)
                        return
                    else:
                        raise InvalidPayload("init may be sent only once")
                except EdgeError as err:
                    out.put(_error(err))
            await core.close(ev.CLIENT_CLOSED)

        async def too_slow() -> None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{slow.code}: {slow.message}")

        driver = asyncio.create_task(drive())
        try:
            while True:
                getter = asyncio.create_task(out.get())
                done, _ = await asyncio.wait({getter, driver}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    item = getter.result()
                    if item is Outbound.OVERFLOW:
                        await too_slow()
                    if item is None:
                        return
                    yield item
                    continue
                getter.cancel()
                if out.overflowed:  # the overflow cancelled the driver
                    await too_slow()
                exc = driver.exception()
                if isinstance(exc, EdgeError):
                    code = _STATUS.get(type(exc), grpc.StatusCode.UNAVAILABLE)
                    if not isinstance(exc, (QueueFull, ServiceUnavailable, InvalidPayload)):
                        code = grpc.StatusCode.UNAVAILABLE
                    await context.abort(code, f"{exc.code}: {exc.message}")
                if exc is not None:
                    log.error("RealtimeService.Connect failed", exc_info=exc)
                    await context.abort(grpc.StatusCode.INTERNAL, "internal error")
                # The driver returned: drain what is left until Closed.
                while (item := await out.get()) is not None:
                    if item is Outbound.OVERFLOW:
                        await too_slow()
                    yield item
                return
        finally:
            self._live.pop(core, None)
            driver.cancel()
            if not core.closed.is_set():
                await core.abort()
