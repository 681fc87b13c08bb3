"""One client session through the fabric, independent of the client's transport and
dialect: SessionCore for a duplex session, run_turn for one chat turn.

The core holds the scheduler lease (the Acquire stream) and the worker Session stream and
drives them; what goes over them is edge.worker_client's (the protobuf requests, the
replies' domain events, the gRPC statuses' edge errors). Adapters
(WebSocket JSON, gRPC RealtimeService) feed commands in and receive events through
`emit`, called from the core's own tasks in order.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from omnifabric.common import logs, telemetry
from omnifabric.common.close_reasons import close_message
from omnifabric.edge import events as ev
from omnifabric.edge.chat import ChatResult, TurnEvent, TurnLeased, TurnQueued
from omnifabric.edge.chat_input import ChatInput
from omnifabric.edge.errors import (
    ALREADY_INITIALIZED,
    NOT_STARTED,
    EdgeError,
    InvalidEvent,
    InvalidPayload,
    NotReady,
    WorkerConnectFailed,
)
from omnifabric.edge.fabric import Fabric, wait_for_lease
from omnifabric.edge.metrics import METRICS, EdgeMetrics
from omnifabric.edge.worker_client import (
    DUPLEX_MODES,
    LEASE_LOST,
    LEASE_MOVED,
    Buffered,
    EngineLimits,
    Lease,
    WorkerEnded,
    WorkerResumed,
    WorkerStarted,
    acquire_request,
    chat_request,
    check_slices,
    close_request,
    lease_news,
    read_chat,
    reattach_request,
    resume_error,
    resume_request,
    retry_on_new_channel,
    start_error,
    start_request,
    tool_output_request,
    unit_request,
    worker_event,
)

log = logging.getLogger("omnifabric.edge.session")
TRACER = telemetry.tracer("edge")

Event = ev.Queued | ev.QueueDone | ev.Created | ev.Output | ev.Closed | ev.Reattached | ev.Expiring
Emit = Callable[[Event], Awaitable[None]]


#: How long before a session's duration limit its client is told (session.expiring).
EXPIRING_NOTICE_S = 60.0

#: The unit watchdog waits at least this long past the worker's own engine timeout (its
#: SessionStarted.unit_timeout_ms): a slow unit of a healthy worker is the worker's to end.
WORKER_TIMEOUT_MARGIN_S = 1.0


def new_session_id(prefix: str = "rt_") -> str:
    """Opaque session id: {prefix}{timestamp_ms} plus a random suffix for uniqueness."""
    return f"{prefix}{int(time.time() * 1000)}_{secrets.token_hex(3)}"


def check_unit_length(samples: int, fewest: int, most: int) -> None:
    """A unit's length against what the worker serves. Raises InvalidPayload."""
    if not fewest <= samples <= most:
        raise InvalidPayload(
            f"audio: {samples} samples; this server takes {fewest} to {most} per unit"
        )


class SessionCore:
    """Lease, worker stream and lifecycle of one duplex session.

    States: new -> queued (acquire) -> leased -> active (start) -> closed. Exactly one
    `Closed` event is emitted, whatever ends the session.
    """

    def __init__(
        self,
        mode: str,
        fabric: Fabric,
        emit: Emit,
        *,
        start_timeout_s: float = 30.0,
        close_timeout_s: float = 5.0,
        session_id: str | None = None,
        unit_timeout_s: float = 6.0,
        metrics: EdgeMetrics = METRICS,
        resume_window_s: float = 0.0,
        owner: str = "",
        key_limit: int = 0,
        early_results: bool = False,
        speech_cuts: bool = False,
    ) -> None:
        if mode not in DUPLEX_MODES:
            raise ValueError(f"mode must be one of {sorted(DUPLEX_MODES)}")
        self.mode = mode
        self.session_id = session_id or new_session_id()
        self._fabric = fabric
        self._emit = emit
        self._start_timeout_s = start_timeout_s
        self._close_timeout_s = close_timeout_s
        self._unit_timeout_s = unit_timeout_s
        self.unit_samples: tuple[int, int] | None = None
        """(fewest, most) samples per unit the worker serves, from its SessionStarted."""
        self.units_as_sent = False
        """The worker's engine takes units as they come, not re-chunked into its own
        (SessionStarted.units_as_sent)."""
        self._early_results = early_results
        """The client takes output between units (SessionStart.early_results)."""
        self._speech_cuts = speech_cuts
        """The edge's cadence cuts a unit short where speech stops (SessionStart.speech_cuts)."""
        self._waiting: dict[int, float] = {}
        """Units sent and not yet answered (nor reported dropped): seq -> send time."""
        self._acquire_call: grpc.aio.UnaryStreamCall | None = None
        self._worker_call: grpc.aio.StreamStreamCall | None = None
        self._lease: Lease | None = None
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self._usage = ev.Usage()
        self._client_reason: str | None = None
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        # One trace per session: this span is the root; queue wait, the scheduler's
        # Acquire and the worker's unit spans hang under it (context in gRPC metadata).
        self.span = TRACER.start_span(
            "session", attributes={"session.id": self.session_id, "session.mode": mode}
        )
        self._trace = trace.set_span_in_context(self.span)
        self._unit_spans: dict[int, Span] = {}
        self.started = False
        self.init: ev.InitCommand | None = None
        """The client's init: waiting for the lease, then the one the session runs with."""
        self.started_event = asyncio.Event()
        """Set once the worker started the session (Created emitted) or the session ended."""
        self.units_sent = 0
        self._unit_sent_at: dict[int, float] = {}
        """perf_counter() when each unit in flight went to the worker (metrics)."""
        self._metrics = metrics
        self.resume_window_s = resume_window_s
        """> 0: the session is resumable (a token is issued with the lease)."""
        self._owner = owner
        self._key_limit = key_limit
        """The session limit of its API key (`owner`), kept across the fabric; 0: none."""
        self.resume_token = ""
        """The token a client resumes this session with (never logged)."""
        metrics.track(self)
        # Built in the transport's own task (one per connection or RPC): its log lines,
        # and those of the tasks started below, carry the session id.
        logs.bind_session(self.session_id)

    @property
    def trace_context(self) -> otel_context.Context:
        """The context whose current span is this session's root span."""
        return self._trace

    @property
    def leased(self) -> bool:
        return self._lease is not None

    @property
    def worker_id(self) -> str:
        return self._lease.worker_id if self._lease else ""

    @property
    def lease_id(self) -> str:
        return self._lease.lease_id if self._lease else ""

    @property
    def limits(self) -> EngineLimits | None:
        """What the leased worker's engine accepts, from the lease; None before the lease
        or when the scheduler passed on none."""
        return self._lease.limits if self._lease is not None else None

    @property
    def unit_bounds(self) -> tuple[int, int] | None:
        """(fewest, most) samples per unit the worker serves: from its SessionStarted, else
        from the lease; None when neither says (the worker alone decides)."""
        if self.unit_samples is not None:
            return self.unit_samples
        limits = self.limits
        if limits is not None and limits.max_unit_samples:
            return limits.min_unit_samples, limits.max_unit_samples
        return None

    # ---- what the session takes when: the one owner of these checks ----------

    def take_init(self, init: ev.InitCommand, already: str = ALREADY_INITIALIZED) -> None:
        """Accept the client's init; one sent while queued waits for the lease (`init`).
        InvalidEvent worded `already` (the dialect's text) for a second one."""
        if self.init is not None or self.started:
            raise InvalidEvent(already)
        self.init = init

    def refuse_init(self) -> None:
        """The init was refused before the session started: a corrected one may follow."""
        if not self.started:
            self.init = None

    def require_started(self, not_ready: str = NOT_STARTED) -> None:
        """Input needs a started, open session: NotReady worded `not_ready` (the
        dialect's text) before the start, NotReady once it is closed."""
        if not self.started or self._worker_call is None:
            raise NotReady(not_ready)
        if self.closed.is_set():
            raise NotReady("the session is closed")

    def check_init(self, init: ev.InitCommand) -> None:
        """An init against the leased worker's limits. Raises InvalidPayload, which leaves
        the session as it was: nothing was sent, a corrected init may follow."""
        check_slices(self.limits, init.max_slice_nums)

    # ---- queue and lease -------------------------------------------------------

    async def acquire(self) -> None:
        """Wait in the scheduler's queue for a worker slot, emitting Queued events.

        Raises QueueFull or ServiceUnavailable. Emits QueueDone once leased.
        """
        if self.resume_window_s > 0:
            self.resume_token = secrets.token_urlsafe(32)
        request = acquire_request(
            self.mode,
            self.session_id,
            self._owner,
            self._key_limit,
            self.resume_token if self.resume_window_s > 0 else "",
            self.resume_window_s,
        )
        queue_span = TRACER.start_span("queue", context=self._trace)
        call = self._fabric.scheduler.Acquire(
            request, metadata=telemetry.inject(trace.set_span_in_context(queue_span))
        )
        self._acquire_call = call
        started = time.monotonic()
        try:
            self._lease = await wait_for_lease(call, self._emit)
        finally:
            queue_span.end()
        self.span.set_attribute("worker.id", self._lease.worker_id)
        log.info(
            "session %s leased %s on %s after %.2fs",
            self.session_id,
            self._lease.lease_id,
            self._lease.worker_id,
            time.monotonic() - started,
        )
        self._tasks.append(asyncio.create_task(self._watch_lease(call)))
        self._metrics.leased(self.mode, time.monotonic() - started)
        await self._emit(ev.QueueDone(queue_wait_s=time.monotonic() - started))

    async def _watch_lease(self, call: grpc.aio.UnaryStreamCall) -> None:
        """End the session when the scheduler says its worker was lost.

        A live scheduler reports a lost worker in-band: `lease_lost`, then the stream's
        end. A broken stream (an error status: the scheduler was killed, restarts or
        drains) tells nothing about the worker; the session keeps its worker stream,
        which alone then ends it (and the edge's unit watchdog watches it).
        """
        try:
            while True:
                response = await call.read()
                news = LEASE_LOST if response is grpc.aio.EOF else lease_news(response)
                if news == LEASE_LOST:
                    break
                if news == LEASE_MOVED:
                    return  # resumed elsewhere: the worker stream ends it (superseded)
        except asyncio.CancelledError:
            return
        except grpc.aio.AioRpcError as err:
            if not self.closed.is_set():
                log.warning(
                    "session %s: scheduler stream ended (%s %s); the session goes on with "
                    "worker %s",
                    self.session_id,
                    err.code().name,
                    err.details() or "",
                    self.worker_id,
                )
            return
        if not self.closed.is_set():
            if self._lease is not None:
                self._fabric.forget_worker(self._lease.worker_address)
            await self._finish(self._closed(ev.ERROR, detail="the worker was lost"))

    # ---- worker session --------------------------------------------------------

    def sender_traits(self, init: ev.InitCommand) -> tuple[bool, bool]:
        """Whether the client takes output between units and whether its units are cut
        where speech stops (SessionStart.early_results, .speech_cuts): what its init asked
        (a gRPC client says so per session), else what its dialect and cadence do."""
        early = self._early_results if init.early_results is None else init.early_results
        cuts = self._speech_cuts if init.speech_cuts is None else init.speech_cuts
        return early, cuts

    async def start(self, init: ev.InitCommand, client_state: bytes = b"") -> ev.Created:
        """Open the worker's Session stream with the lease; emits and returns Created.

        Raises NotReady before the lease, InvalidEvent when already started, InvalidPayload
        outside the leased worker's limits (all three before anything is sent: `started`
        stays False and the session usable), WorkerConnectFailed when the worker refuses
        or cannot be reached.
        """
        if self._lease is None:
            raise NotReady("the session has no worker yet: wait for session.queue_done")
        if self.started:
            raise InvalidEvent(ALREADY_INITIALIZED)
        self.check_init(init)
        self.started = True
        address = self._lease.worker_address
        start = start_request(
            self._lease,
            self.session_id,
            self.mode,
            init,
            self.resume_window_s if self.resume_token else 0.0,
            client_state,
            *self.sender_traits(init),
        )
        for attempt in (1, 2):
            call = self._fabric.worker(address).Session(metadata=telemetry.inject(self._trace))
            self._worker_call = call
            try:
                await call.write(start)
                response = await asyncio.wait_for(call.read(), self._start_timeout_s)
                break
            except grpc.aio.AioRpcError as err:
                call.cancel()
                if attempt == 1 and retry_on_new_channel(err):
                    log.info(
                        "session %s: worker %s unreachable (%s); dialling it again",
                        self.session_id,
                        address,
                        err.details() or "",
                    )
                    await self._fabric.redial_worker(address)
                    continue
                raise start_error(err) from None
            except TimeoutError:
                call.cancel()
                raise WorkerConnectFailed(
                    "the worker did not start the session: timed out"
                ) from None
        started = None if response is grpc.aio.EOF else worker_event(response)
        if not isinstance(started, WorkerStarted):
            call.cancel()
            raise WorkerConnectFailed("the worker did not start the session")
        if started.unit_samples is not None:  # what this worker serves
            self.unit_samples = started.unit_samples
        self.units_as_sent = started.units_as_sent
        self._outwait_worker(started.unit_timeout_ms)
        created = ev.Created(
            self.session_id,
            started.prompt_length,
            started.notes,
            self.resume_token,
            self.resume_window_s if self.resume_token else 0.0,
            unit_samples=self.unit_bounds,
            units_as_sent=self.units_as_sent,
        )
        await self._emit(created)
        self.started_event.set()
        self._tasks.append(asyncio.create_task(self._pump(call)))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        self._warn_before_limit(started.duration_left_ms)
        return created

    async def resume(self, token: str) -> ev.Reattached:
        """Take over the resumable session of `token` (from any edge): its lease from the
        scheduler, its stream from the worker; emits and returns Reattached with every
        output the session made, then goes on like a started session.

        Raises ResumeUnknown, ResumeExpired, ResumeForbidden, ServiceUnavailable or
        WorkerConnectFailed.
        """
        call = self._fabric.scheduler.Reattach(
            reattach_request(token, self._owner), metadata=telemetry.inject(self._trace)
        )
        self._acquire_call = call
        self._lease = await wait_for_lease(call, self._emit)
        self._tasks.append(asyncio.create_task(self._watch_lease(call)))
        request = resume_request(self._lease)
        address = self._lease.worker_address
        worker_call = self._fabric.worker(address).Session(metadata=telemetry.inject(self._trace))
        self._worker_call = worker_call
        try:
            await worker_call.write(request)
            first = await asyncio.wait_for(worker_call.read(), self._start_timeout_s)
            resumed = None if first is grpc.aio.EOF else worker_event(first)
            if not isinstance(resumed, WorkerResumed):
                raise WorkerConnectFailed("the worker did not resume the session")
            outputs = []
            for _ in range(resumed.replay_count):
                response = await asyncio.wait_for(worker_call.read(), self._start_timeout_s)
                replayed = None if response is grpc.aio.EOF else worker_event(response)
                if not isinstance(replayed, ev.Output | Buffered):
                    raise WorkerConnectFailed("the worker's replay ended early")
                if isinstance(replayed, ev.Output):
                    outputs.append(replayed)
        except grpc.aio.AioRpcError as err:
            worker_call.cancel()
            raise resume_error(err) from None
        except TimeoutError:
            worker_call.cancel()
            raise WorkerConnectFailed("the worker did not resume the session: timed out") from None
        self.session_id = resumed.session_id
        logs.bind_session(self.session_id)
        self.span.set_attribute("session.resumed_id", self.session_id)
        self.resume_token = token
        self._seq = resumed.last_unit_seq
        self.started = True  # input is taken from here (before: not_ready)
        if resumed.unit_samples is not None:
            self.unit_samples = resumed.unit_samples
        self.units_as_sent = resumed.units_as_sent
        self._outwait_worker(resumed.unit_timeout_ms)
        if outputs:
            self._usage = outputs[-1].usage
        reattached = ev.Reattached(
            session_id=self.session_id,
            prompt_length=resumed.prompt_length,
            notes=resumed.notes,
            client_state=resumed.client_state,
            outputs=tuple(outputs),
            resume_token=token,
            resume_window_s=self.resume_window_s,
            last_input_seq=resumed.last_unit_seq,
        )
        log.info(
            "session %s resumed on worker %s: %d outputs replayed",
            self.session_id,
            self._lease.worker_id,
            len(outputs),
        )
        await self._emit(reattached)
        self.started_event.set()
        self._tasks.append(asyncio.create_task(self._pump(worker_call)))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        self._warn_before_limit(resumed.duration_left_ms)
        return reattached

    def _warn_before_limit(self, duration_left_ms: int) -> None:
        """Tell the client EXPIRING_NOTICE_S before the duration limit ends the session
        (Expiring; at once when less is left); nothing without a limit (0: none, or an
        older worker that does not say)."""
        if duration_left_ms:
            self._tasks.append(asyncio.create_task(self._expiring(duration_left_ms / 1000)))

    async def _expiring(self, left_s: float) -> None:
        await asyncio.sleep(max(0.0, left_s - EXPIRING_NOTICE_S))
        if not self.closed.is_set():
            await self._emit(ev.Expiring(seconds_left=round(min(left_s, EXPIRING_NOTICE_S))))

    def _outwait_worker(self, unit_timeout_ms: int) -> None:
        """Let the unit watchdog wait past the leased worker's own engine timeout (0: the
        worker sets none, or is older and does not say)."""
        if unit_timeout_ms:
            worker_s = unit_timeout_ms / 1000 + WORKER_TIMEOUT_MARGIN_S
            self._unit_timeout_s = max(self._unit_timeout_s, worker_s)

    async def _watchdog(self) -> None:
        """A worker that stops answering (hung process, stuck GPU) ends the session: the
        transport's keepalive would take far longer to notice a peer that is alive but stuck.

        It sleeps until the oldest unanswered unit would be overdue (a unit sent later is
        due later; with none waiting, one timeout), not on a fixed tick: a healthy session
        wakes it about once per timeout instead of twice a second."""
        while not self.closed.is_set():
            wait = self._unit_timeout_s
            if self._waiting:
                oldest = min(self._waiting.values())
                overdue = time.monotonic() - oldest - self._unit_timeout_s
                if overdue > 0:
                    log.warning(
                        "session %s: no result for %.1fs: the worker is not responding",
                        self.session_id,
                        self._unit_timeout_s + overdue,
                    )
                    await self._finish(
                        self._closed(ev.ERROR, detail="the worker stopped responding")
                    )
                    return
                wait = -overdue
            await asyncio.sleep(wait)

    async def _pump(self, call: grpc.aio.StreamStreamCall) -> None:
        """Worker responses -> events, until the session's end."""
        closed: ev.Closed | None = None
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                event = worker_event(response)
                if isinstance(event, ev.Output):
                    self._usage = event.usage
                    self._answered(event)
                    await self._emit(event)
                    self._metrics.output(self.mode, event, self._unit_sent_at)
                    self._end_unit_span(event)
                elif isinstance(event, Buffered):
                    self._buffered(event.seq, event.dropped_seqs)
                elif isinstance(event, WorkerEnded):
                    if event.usage is not None:
                        self._usage = event.usage
                    closed = self._closed(
                        event.reason, event.message, self._client_reason, event.error_code
                    )
                    break
        except grpc.aio.AioRpcError as err:
            if not self.closed.is_set():
                log.warning("session %s: worker stream failed: %s", self.session_id, err.code())
        except asyncio.CancelledError:
            return
        await self._finish(closed or self._closed(ev.ERROR, detail="the worker was lost"))

    def _buffered(self, seq: int, dropped_seqs: Iterable[int]) -> None:
        """The worker kept unit `seq`'s audio for its next model unit: answered, no event."""
        self._waiting.pop(seq, None)
        for dropped in dropped_seqs:
            self._waiting.pop(dropped, None)
        span = self._unit_spans.pop(seq, None)
        if span is not None:
            span.set_attribute("unit.buffered", True)
            span.end()

    def _answered(self, out: ev.Output) -> None:
        self._waiting.pop(out.seq, None)
        for seq in out.dropped_seqs:
            self._waiting.pop(seq, None)

    def _end_unit_span(self, out: ev.Output) -> None:
        span = self._unit_spans.pop(out.seq, None)
        if span is not None:
            span.set_attribute("unit.kind", "listen" if out.is_listen else "speak")
            span.end()
        for seq in out.dropped_seqs:
            dropped = self._unit_spans.pop(seq, None)
            if dropped is not None:
                dropped.set_attribute("unit.dropped", True)
                dropped.end()

    async def append(self, cmd: ev.AppendCommand) -> int:
        """Forward one unit to the worker; returns its seq. NotReady before start,
        InvalidPayload for a unit outside the worker's limits (not sent)."""
        self.require_started()
        call = self._worker_call
        assert call is not None  # started: the stream is open
        bounds = self.unit_bounds
        if bounds is not None:
            check_unit_length(len(cmd.pcm) // 4, *bounds)
        check_slices(self.limits, cmd.max_slice_nums)
        self._seq += 1
        self._waiting[self._seq] = time.monotonic()
        # Edge-side time of the unit: from the client's append to the result going out.
        # Only under a recorded session span: with tracing off (or the trace sampled out) a
        # unit span records nothing either, and making one costs ~36 us on a cold path.
        if self.span.is_recording():
            self._unit_spans[self._seq] = TRACER.start_span(
                "edge.unit", context=self._trace, attributes={"unit.seq": self._seq}
            )
        self._metrics.unit_forwarded(self.mode, self._seq, self._unit_sent_at)
        request = unit_request(self._seq, cmd)
        try:
            async with self._send_lock:
                await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The stream is gone; the pump reports the end.
            pass
        self.units_sent += 1
        return self._seq

    async def tool_output(self, cmd: ev.ToolOutputCommand) -> None:
        """Forward a function's output to the worker (NotReady before start)."""
        self.require_started()
        call = self._worker_call
        assert call is not None
        try:
            async with self._send_lock:
                await call.write(tool_output_request(cmd))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream is gone; the pump reports the end

    # ---- ending ----------------------------------------------------------------

    async def close(self, reason: str = ev.USER_STOP, client_reason: str | None = None) -> None:
        """End the session on the client's request; returns once Closed was emitted."""
        self._client_reason = client_reason
        if self.closed.is_set():
            return
        call = self._worker_call
        if call is None:
            await self._finish(self._closed(reason, client_reason=client_reason))
            return
        try:
            async with self._send_lock:
                await call.write(close_request(reason))
            await call.done_writing()
            await asyncio.wait_for(self.closed.wait(), self._close_timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._finish(self._closed(reason, client_reason=client_reason))

    async def abort(self, keep: bool = False) -> None:
        """The client is gone: drop the worker stream and the lease without events. A
        resumable session is kept for a resume when `keep` (the connection dropped);
        otherwise its worker is told to end it first (the client left)."""
        self._emit = _discard
        if self.resume_token and not keep and self.started and not self.closed.is_set():
            # Without a close the worker would keep the session for a resume.
            await self.close(ev.CLIENT_CLOSED)
            return
        if keep and self.resume_token:
            log.info(
                "session %s: the connection dropped; resumable for %.0f s",
                self.session_id,
                self.resume_window_s,
            )
        await self._finish(self._closed(ev.CLIENT_CLOSED))

    def _closed(
        self,
        reason: str,
        worded: str = "",
        client_reason: str | None = None,
        error_code: str = "",
        detail: str = "",
    ) -> ev.Closed:
        """The Closed event of an end with `reason`: as the worker `worded` it, else in the
        reason's sentence (common.close_reasons) with `detail`; the stop the edge asked for
        when a pause outlasted its timeout is worded as that."""
        if reason == ev.USER_STOP and client_reason == ev.PAUSE_TIMEOUT:
            message = close_message(ev.PAUSE_TIMEOUT)
        else:
            message = worded or close_message(reason, detail)
        return ev.Closed(reason, self._usage, message, client_reason, error_code)

    async def _finish(self, closed: ev.Closed) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.started_event.set()
        self._metrics.session_closed(self.mode, closed.reason)
        for span in self._unit_spans.values():
            span.end()
        self._unit_spans.clear()
        self.span.set_attribute("session.close_reason", closed.reason)
        self.span.end()
        # Cancelling the worker stream frees the engine session; cancelling Acquire
        # returns the lease (the scheduler frees the slot once the worker confirms).
        if self._worker_call is not None:
            self._worker_call.cancel()
        if self._acquire_call is not None:
            self._acquire_call.cancel()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        log.info("session %s closed: %s %s", self.session_id, closed.reason, closed.message)
        try:
            await self._emit(closed)
        except Exception:  # the transport may be gone already
            log.debug("session %s: closed event not delivered", self.session_id)


async def run_turn(
    fabric: Fabric,
    chat: ChatInput,
    session_id: str,
    emit: Callable[[TurnEvent], Awaitable[None]],
    owner: str = "",
    key_limit: int = 0,
) -> ChatResult:
    """Lease a chat slot, run the turn, stream its events to `emit` (TurnQueued while
    queued, TurnLeased, TurnPrefilled, TurnDelta...); the lease and the worker's call end
    with it, also when it is cancelled. Raises QueueFull, TooManySessions,
    ServiceUnavailable, WorkerConnectFailed, InvalidPayload, InferenceError."""
    acquire = fabric.scheduler.Acquire(acquire_request("chat", session_id, owner, key_limit))
    result = ChatResult()
    t0 = time.monotonic()
    waited = False

    async def queued(q: ev.Queued) -> None:
        nonlocal waited
        waited = True
        await emit(TurnQueued(q))

    try:
        lease = await wait_for_lease(acquire, queued)
        result.timings_ms["queue_ms"] = (time.monotonic() - t0) * 1000.0
        await emit(TurnLeased(waited))
        call = fabric.worker(lease.worker_address).Chat(
            chat_request(chat, lease.lease_id, session_id)
        )
        try:
            await read_chat(call, emit, result, chat.notes)
        finally:
            # A turn cancelled mid-stream (client gone, slow client, drain) must stop the
            # worker's generation now, not when the call object is collected.
            call.cancel()
    finally:
        acquire.cancel()
    result.timings_ms["wall_clock_ms"] = (time.monotonic() - t0) * 1000.0
    return result


async def _discard(_: Event) -> None:
    return None


__all__ = ["SessionCore", "EdgeError", "new_session_id"]
