"""One duplex session's unit loop: prefill -> generate -> send -> deferred finalize.

A one-slot mailbox holds the next unit (the newest wins); engine calls run on the worker's
engine threads; the result goes to the sender at once and finalize runs behind it, fenced
by an asyncio.Event barrier before the next prefill. Every end frees the engine session and
memory, then emits exactly one SessionEnd.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from omnifabric.common import close_reasons, telemetry
from omnifabric.worker.engine import (
    INPUT_RATE,
    DuplexSettings,
    Engine,
    EngineSession,
    GenerateResult,
)
from omnifabric.worker.engines import memory
from omnifabric.worker.errors import EngineFailure, EngineStuck
from omnifabric.worker.rechunk import Rechunker
from omnifabric.worker.units import UnitInput

log = logging.getLogger("omnifabric.worker.session")
TRACER = telemetry.tracer("worker")


class CloseReason(enum.Enum):
    """Why a session ended (common.proto CloseReason; its sentence: common.close_reasons)."""

    USER_STOP = close_reasons.USER_STOP
    TIMEOUT = close_reasons.TIMEOUT
    CONTEXT_FULL = close_reasons.CONTEXT_FULL
    SERVER_SHUTDOWN = close_reasons.SERVER_SHUTDOWN
    ERROR = close_reasons.ERROR
    CLIENT_CLOSED = close_reasons.CLIENT_CLOSED


@dataclass(frozen=True)
class SessionSpec:
    """What a session starts with (SessionStart, decoded)."""

    session_id: str
    lease_id: str
    mode: str
    system_prompt: str = ""
    ref_audio: np.ndarray | None = None
    tts_ref_audio: np.ndarray | None = None
    settings: DuplexSettings = field(default_factory=DuplexSettings)
    trace_context: Any = None
    """OpenTelemetry context of the caller (the edge's session span), or None."""
    resume_grace_s: float = 0.0
    """> 0: a stream that ends without close leaves the session detached this long."""
    client_state: bytes = b""
    """The sender's own state, handed back on resume (opaque here)."""


@dataclass
class Usage:
    """Token usage of a session so far."""

    input_text_tokens: int = 0
    input_audio_tokens: int = 0
    input_vision_tokens: int = 0
    output_text_tokens: int = 0
    output_audio_tokens: int = 0

    @property
    def input_tokens(self) -> int:
        return self.input_text_tokens + self.input_audio_tokens + self.input_vision_tokens

    @property
    def output_tokens(self) -> int:
        return self.output_text_tokens + self.output_audio_tokens

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class UnitTimings:
    """Milliseconds spent on one unit (common.proto UnitTimings)."""

    prefill_ms: float = 0.0
    generate_ms: float = 0.0
    finalize_wait_ms: float = 0.0
    wall_clock_ms: float = 0.0
    queue_ms: float = 0.0
    engine_busy_ms: float = 0.0
    """Of queue_ms, the time the engine still computed this session's earlier unit."""
    engine_costs_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class UnitOutput:
    """The result of one served unit, as handed to the sender."""

    seq: int
    result: GenerateResult
    timings: UnitTimings
    usage: Usage
    """Cumulative snapshot after this unit."""
    dropped_seqs: list[int]
    buffered: bool = False
    """The unit's audio waits for the next model unit (re-chunking) or was heard with a
    later unit (a half-duplex join): no model step ran for it."""
    late: bool = False
    """Its result left later than one unit length after the unit arrived."""
    audio_dropped: bool = False
    """Kept for a replay without its speech (beyond JOURNAL_AUDIO_RESULTS)."""


@dataclass
class SessionEnd:
    """The session is over and freed; always the last event."""

    reason: CloseReason
    message: str
    """The reason's sentence (common.close_reasons), with the detail of this end if any."""
    usage: Usage
    units_served: int
    units_dropped: int
    error_code: str = ""
    """Public error code: "inference_error" when the engine failed on a unit."""
    late_units: int = 0
    """Units whose result left later than one unit length after they arrived."""


@dataclass(frozen=True)
class UnitTrace:
    """What a unit's spans are built from once its finalize is done."""

    received_at: float
    started: float
    output: UnitOutput
    length_s: float
    """Seconds of input the unit carried."""


#: What a served unit tells the worker's headroom (worker.headroom.Headroom.unit): the
#: session, seconds of input, engine seconds (prefill, generate and its finalize), wall
#: seconds (arrival to result), and whether it spoke.
UnitServed = Callable[["DuplexSession", float, float, float, bool], None]
#: perf_counter -> epoch nanoseconds, for spans built from measured times.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _ns(perf: float) -> int:
    return int(perf * 1e9) + _EPOCH_OFFSET_NS


@dataclass(frozen=True)
class SessionLimits:
    """Limits of one session: duration from its start, the context cap in tokens, and the
    longest engine call of one unit (None: unbounded)."""

    duration_s: float
    max_context_tokens: int
    unit_timeout_s: float | None = None


class Mailbox:
    """The next unit: one slot where a unit that arrives while one waits replaces it (the
    newest wins); with `join`, every waiting unit is kept instead (for the re-chunker, or
    to be heard as one unit in a half-duplex call)."""

    def __init__(self) -> None:
        self._units: list[UnitInput] = []
        self.join = False
        self.dropped: list[int] = []
        """Seqs replaced since the last take_dropped()."""
        self.dropped_total = 0

    def put(self, unit: UnitInput) -> None:
        if self._units and not self.join:
            self.drop(self._units.pop().seq)
        self._units.append(unit)

    def drop(self, seq: int) -> None:
        self.dropped.append(seq)
        self.dropped_total += 1

    def take_all(self) -> list[UnitInput]:
        units, self._units = self._units, []
        return units

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def discard(self) -> None:
        """Count units still waiting at the end as dropped."""
        self.dropped_total += len(self._units)
        self._units = []


#: Results whose speech the session keeps for a resumed stream's replay (the newest); older
#: results are kept without it (~96 KB a second of speech: ~11 MB per session at most).
JOURNAL_AUDIO_RESULTS = 120

#: Re-chunked sessions: model units that may wait at once; older audio beyond them is
#: dropped (counted) so an engine slower than real time builds no backlog. A half-duplex
#: call's model units may wait up to HALF_DUPLEX_JOIN_SAMPLES of audio instead: its turn
#: is heard whole, late rather than in pieces.
MAX_WAITING_MODEL_UNITS = 4

#: Half-duplex calls on engines that take client units as they come: the units that
#: arrived while the engine was busy are heard as one unit (a turn is heard whole, as the
#: reference server buffers it), of this much audio at most (16 kHz samples, 30 s); older
#: units beyond it are dropped (counted).
HALF_DUPLEX_JOIN_SAMPLES = 30 * 16000


class DuplexSession:
    """The unit loop of one session. Feed it with submit()/close(); read events()."""

    def __init__(
        self,
        spec: SessionSpec,
        engine: Engine,
        executor: Executor,
        limits: SessionLimits,
        on_freed: Callable[[DuplexSession, memory.MemoryReport | None], None] | None = None,
        on_stuck: Callable[[DuplexSession, str], None] | None = None,
        on_unstuck: Callable[[DuplexSession, memory.MemoryReport | None], None] | None = None,
        on_unit: UnitServed | None = None,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.executor = executor
        self.limits = limits
        self.on_freed = on_freed
        self.on_stuck = on_stuck
        """Called with a detail when an engine call overran the unit timeout."""
        self.on_unstuck = on_unstuck
        """Called once that call returned and the engine session was freed after all."""
        self.on_unit = on_unit
        """Called once each served unit's finalize is done (the worker's headroom)."""
        self.late_units = 0
        """Units whose result left later than one unit length after they arrived."""
        self._stuck: asyncio.Future[Any] | None = None
        self._late_free: asyncio.Task[None] | None = None
        self.prompt_length = 0
        self.notes: tuple[str, ...] = ()
        """What the engine could not do as the session asked (for session.created)."""
        self.usage = Usage()
        self.units_served = 0
        self.ended: SessionEnd | None = None
        self._mailbox = Mailbox()
        self._wake = asyncio.Event()
        self._finalized = asyncio.Event()
        self._finalized.set()
        self._finalize_task: asyncio.Task[None] | None = None
        self._finalize_error: BaseException | None = None
        self._computed_at = 0.0
        """perf_counter() when the engine returned the latest unit's prefill and generate."""
        self._close_request: tuple[CloseReason, str] | None = None
        self._journal: list[UnitOutput | SessionEnd] = []
        """Every event of the session, in order: streams read it by index (a resumed
        stream from the start)."""
        self._readers: set[asyncio.Future[None]] = set()
        """One future per stream waiting for the journal to grow: setting it wakes that
        stream's task directly (one loop turn; a shared future behind asyncio.shield takes
        two, and the result would queue behind the unit's finalize)."""
        self.attachment = 0
        """Which stream carries the session: each attach (start, resume) counts one."""
        self._let_go: set[int] = set()
        """Attachments whose sender ended its stream without close (they read no more)."""
        self.last_unit_seq = 0
        self._detach_timer: asyncio.TimerHandle | None = None
        self._engine_session: EngineSession | None = None
        self._chunker: Rechunker | None = None
        """Set when the engine needs exact unit lengths: client units are re-chunked."""
        self._joins = False
        """A half-duplex call without a chunker: units that waited are heard as one."""
        self._max_waiting = MAX_WAITING_MODEL_UNITS
        """Re-chunked: the model units that may wait at once (more in a half-duplex call)."""
        self._deadline = 0.0
        self._loop = asyncio.get_running_loop()

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def lease_id(self) -> str:
        return self.spec.lease_id

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking engine call on the engine threads (never on the event loop)."""
        return await self._loop.run_in_executor(self.executor, fn, *args)

    async def _watched(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """An engine call bounded by the unit timeout. Raises EngineStuck when it overruns:
        the thread cannot be interrupted, so the call is left running (and the engine
        session is freed only once it returns, see _free)."""
        timeout = self.limits.unit_timeout_s
        call = self.executor.submit(fn, *args)
        if timeout is None:
            return await asyncio.wrap_future(call, loop=self._loop)
        # The task awaits the call's own future: its result wakes the task in one loop
        # turn (asyncio.wait would add a waiter future and a turn to every engine call).
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await asyncio.wrap_future(call, loop=self._loop)
        except TimeoutError:
            if not deadline.expired():
                raise  # the engine's own TimeoutError
        # Expired: the awaited future was cancelled; the call goes on in its thread, and a
        # new future follows it to its end.
        self._stuck = asyncio.wrap_future(call, loop=self._loop)
        detail = f"engine stuck: {what} of session {self.session_id} over {timeout:g} s"
        log.error("session %s: %s", self.session_id, detail)
        if self.on_stuck is not None:
            self.on_stuck(self, detail)
        raise EngineStuck(f"the engine did not finish {what} within {timeout:g} s")

    async def open(self) -> int:
        """Open the engine session and prepare the prompt; returns the prompt length.

        The duration limit counts from here. Raises EngineFailure (engine session freed).
        """
        self._deadline = self._loop.time() + self.limits.duration_s
        opening = self._loop.run_in_executor(self.executor, self._open_blocking)
        try:
            self.prompt_length = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The engine call goes on in its thread: let it finish, then free what it opened.
            await asyncio.gather(opening, return_exceptions=True)
            await self._free()
            raise
        except Exception as exc:
            log.exception("session %s: engine failed to open", self.session_id)
            await self._free()
            raise EngineFailure("the engine failed to start the session") from exc
        self.usage.input_text_tokens = self.prompt_length
        self.notes = tuple(self._engine_session.notes) if self._engine_session else ()
        return self.prompt_length

    def _open_blocking(self) -> int:
        """open_session + prepare on an engine thread; keeps the engine session for _free."""
        spec = self.spec
        self._engine_session = self.engine.open_session(spec.session_id, spec.mode)
        sizes = self._engine_session.unit_samples()
        self._chunker = Rechunker(*sizes) if sizes else None
        self._joins = self._chunker is None and spec.settings.half_duplex is True
        if self._chunker is not None and spec.settings.half_duplex is True:
            self._max_waiting = max(
                MAX_WAITING_MODEL_UNITS, HALF_DUPLEX_JOIN_SAMPLES // self._chunker.size
            )
        self._mailbox.join = self._chunker is not None or self._joins
        return int(
            self._engine_session.prepare(
                spec.system_prompt, spec.ref_audio, spec.tts_ref_audio, spec.settings
            )
        )

    def submit(self, unit: UnitInput) -> None:
        """Hand a unit to the loop; a unit still waiting is replaced (newest wins), except
        in a re-chunked session or a half-duplex call (see Mailbox.join)."""
        if self._close_request is not None or self.ended is not None:
            return
        self.last_unit_seq = max(self.last_unit_seq, unit.seq)
        self._mailbox.put(unit)
        self._wake.set()

    @property
    def close_requested(self) -> tuple[CloseReason, str] | None:
        """The first close asked for, if any."""
        return self._close_request

    def close(self, reason: CloseReason, detail: str = "") -> None:
        """Ask the loop to end after the unit in progress; the first request wins. `detail`:
        what exactly ended it, added to the reason's sentence (none for a plain close)."""
        if self._close_request is None:
            self._close_request = (reason, detail)
        self._wake.set()

    async def events(self, attachment: int = 0) -> AsyncIterator[UnitOutput | SessionEnd]:
        """Every event from the first, in order, then exactly one SessionEnd; returns early
        when another stream attached after `attachment` (superseded)."""
        index = 0
        while True:
            if attachment and (self.attachment != attachment or attachment in self._let_go):
                return
            if index < len(self._journal):
                event = self._journal[index]
                index += 1
                yield event
                if isinstance(event, SessionEnd):
                    return
                continue
            await self._journal_grew()

    async def _journal_grew(self) -> None:
        waiter = self._loop.create_future()
        self._readers.add(waiter)
        try:
            await waiter
        finally:  # cancelled: only this stream's future goes
            self._readers.discard(waiter)

    def _emit(self, event: UnitOutput | SessionEnd) -> None:
        self._journal.append(event)
        old = len(self._journal) - 1 - JOURNAL_AUDIO_RESULTS
        if old >= 0:
            kept = self._journal[old]
            if isinstance(kept, UnitOutput) and kept.result.audio.size:
                audio = np.zeros(0, dtype=np.float32)
                self._journal[old] = replace(
                    kept, result=replace(kept.result, audio=audio), audio_dropped=True
                )
        self._wake_streams()

    def _wake_streams(self) -> None:
        for waiter in self._readers:
            if not waiter.done():
                waiter.set_result(None)
        self._readers.clear()

    @property
    def journal_length(self) -> int:
        return len(self._journal)

    def attach(self) -> int:
        """A stream takes the session (its start, or a resume): the previous one, if any,
        stops reading; a detached session stops waiting to expire. Returns the stream's
        attachment number."""
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None
        self.attachment += 1
        self._wake_streams()
        return self.attachment

    def let_go(self, attachment: int) -> None:
        """The stream of `attachment` ended without close: it stops reading events."""
        self._let_go.add(attachment)
        self._wake_streams()

    @property
    def detached(self) -> bool:
        return self._detach_timer is not None

    def detach(self) -> None:
        """The stream is gone without close: wait resume_grace_s for a resume, then end as
        a client close. Units still waiting are served; their results are kept."""
        if self.ended is not None or self._detach_timer is not None:
            return
        grace = self.spec.resume_grace_s
        log.info("session %s detached: resumable for %.0f s", self.session_id, grace)
        self._detach_timer = self._loop.call_later(
            grace, self.close, CloseReason.CLIENT_CLOSED, "its resume window passed"
        )

    async def run(self) -> SessionEnd:
        """Serve units until an end; frees everything and emits SessionEnd. Never raises."""
        reason, detail, code = CloseReason.ERROR, "internal error", ""
        try:
            reason, detail = await self._serve()
        except asyncio.CancelledError:
            reason, detail = CloseReason.SERVER_SHUTDOWN, ""
            raise
        except EngineStuck as exc:
            reason, detail, code = CloseReason.ERROR, str(exc), close_reasons.INFERENCE_ERROR
        except Exception:
            log.exception("session %s: engine failure", self.session_id)
            reason, detail, code = CloseReason.ERROR, "", close_reasons.INFERENCE_ERROR
        finally:
            end = await asyncio.shield(self._end(reason, detail, code))
        return end

    async def _serve(self) -> tuple[CloseReason, str]:
        while True:
            if isinstance(self._finalize_error, EngineStuck):
                raise self._finalize_error  # at once: no unit may follow a stuck finalize
            if self._close_request is not None:
                return self._close_request
            remaining = self._deadline - self._loop.time()
            if remaining <= 0:
                return CloseReason.TIMEOUT, f"{self.limits.duration_s:g} s"
            units = self._mailbox.take_all()
            if not units:
                self._wake.clear()
                try:
                    # asyncio.timeout, not wait_for: no task per wait (3.11's wait_for
                    # wraps the wait in one, two more loop turns before a unit starts).
                    async with asyncio.timeout(remaining):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            for piece in self._model_units(units):
                result = await self._serve_unit(piece)
                cap = self._context_cap()
                if result.kv_cache_length >= cap:
                    return CloseReason.CONTEXT_FULL, f"{cap} tokens"
                if self._close_request is not None:
                    return self._close_request

    def _model_units(self, units: list[UnitInput]) -> list[UnitInput]:
        """The model units to serve for the client units taken: the units themselves, or
        re-chunked (client units that complete none are answered as buffered; beyond
        MAX_WAITING_MODEL_UNITS, or a half-duplex call's 30 s, the oldest audio is dropped
        and its units reported)."""
        if self._chunker is None:
            return self._joined(units) if self._joins and len(units) > 1 else units
        pieces: list[UnitInput] = []
        for unit in units:
            made = self._chunker.push(unit)
            if not made:
                self._buffered(unit)
            pieces += made
        excess = len(pieces) - self._max_waiting
        if excess > 0:
            dropped, pieces = pieces[:excess], pieces[excess:]
            kept = {p.seq for p in pieces}
            for seq in sorted({p.seq for p in dropped} - kept):
                self._mailbox.drop(seq)
            log.warning(
                "session %s: %d s of audio behind: the oldest %d dropped",
                self.session_id,
                excess + len(pieces),
                excess,
            )
        return pieces

    def _joined(self, units: list[UnitInput]) -> list[UnitInput]:
        """A half-duplex call's units that waited while the engine was busy, as one unit
        under the newest's seq: the others are answered as buffered, and those beyond
        HALF_DUPLEX_JOIN_SAMPLES (the oldest) as dropped. An engine slower than real time
        then hears the whole question instead of its newest half-second."""
        kept: list[UnitInput] = []
        samples = 0
        for unit in reversed(units):
            samples += len(unit.pcm)
            if kept and samples > HALF_DUPLEX_JOIN_SAMPLES:
                break
            kept.append(unit)
        kept.reverse()
        for unit in units[: len(units) - len(kept)]:
            self._mailbox.drop(unit.seq)
        if len(kept) < len(units):
            log.warning(
                "session %s: %d units waited: the oldest %d dropped",
                self.session_id,
                len(units),
                len(units) - len(kept),
            )
        for unit in kept[:-1]:
            self._buffered(unit)
        newest = kept[-1]
        joined = replace(
            newest,
            pcm=np.concatenate([u.pcm for u in kept]),
            frames=[f for u in kept for f in u.frames],
            force_listen=any(u.force_listen for u in kept),
        )
        return [joined]

    def _buffered(self, unit: UnitInput) -> None:
        """Answer a unit whose audio waits for more (it filled no model unit yet)."""
        self._emit(
            UnitOutput(
                seq=unit.seq,
                result=GenerateResult(is_listen=True),
                timings=UnitTimings(),
                usage=replace(self.usage),
                dropped_seqs=self._mailbox.take_dropped(),
                buffered=True,
            )
        )

    def _context_cap(self) -> int:
        cap = self.limits.max_context_tokens
        if self.spec.settings.max_kv_tokens:
            cap = min(cap, self.spec.settings.max_kv_tokens)
        return cap

    async def _serve_unit(self, unit: UnitInput) -> GenerateResult:
        taken = time.perf_counter()
        # What of its wait the engine spent on this session's earlier unit (the rest is the
        # loop's own hand-over).
        engine_busy_ms = max(0.0, min(taken, self._computed_at) - unit.received_at) * 1000.0
        await self._finalized.wait()
        finalize_wait_ms = (time.perf_counter() - taken) * 1000.0
        if self._finalize_error is not None:
            raise self._finalize_error
        force_listen = unit.force_listen or self._output_cap_reached()
        max_slices = unit.max_slice_nums or self.spec.settings.max_slice_nums or 1
        costs, result, prefill_ms, generate_ms, started = await self._watched(
            f"unit {unit.seq}", self._infer, unit, force_listen, max_slices
        )
        self._computed_at = time.perf_counter()
        self.units_served += 1
        self._add_usage(result)
        timings = UnitTimings(
            prefill_ms=prefill_ms,
            generate_ms=generate_ms,
            finalize_wait_ms=finalize_wait_ms,
            queue_ms=(taken - unit.received_at) * 1000.0,
            engine_busy_ms=engine_busy_ms,
            engine_costs_ms={**costs, **result.costs_ms},
        )
        output = UnitOutput(
            seq=unit.seq,
            result=result,
            timings=timings,
            usage=replace(self.usage),
            dropped_seqs=self._mailbox.take_dropped(),
        )
        timings.wall_clock_ms = (time.perf_counter() - unit.received_at) * 1000.0
        length_s = len(unit.pcm) / INPUT_RATE
        output.late = timings.wall_clock_ms > length_s * 1000.0
        if output.late:
            self.late_units += 1
        self._emit(output)
        # Deferred finalize: the result is already on its way; the barrier fences the next prefill.
        self._finalized.clear()
        self._finalize_task = asyncio.ensure_future(
            self._finalize(UnitTrace(unit.received_at, started, output, length_s))
        )
        return result

    def _infer(
        self, unit: UnitInput, force_listen: bool, max_slices: int
    ) -> tuple[dict[str, float], GenerateResult, float, float, float]:
        """Prefill then generate, on an engine thread; returns costs, both durations (ms)
        and when prefill started (perf_counter)."""
        assert self._engine_session is not None
        t0 = time.perf_counter()
        costs = self._engine_session.prefill(unit.pcm, unit.frames, max_slices) or {}
        t1 = time.perf_counter()
        result = self._engine_session.generate(force_listen)
        t2 = time.perf_counter()
        return dict(costs), result, (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, t0

    def _finalize_timed(self) -> float:
        """The engine's finalize, on an engine thread; returns the seconds it took there
        (a wait for a free engine thread left out)."""
        assert self._engine_session is not None
        t0 = time.perf_counter()
        self._engine_session.finalize()
        return time.perf_counter() - t0

    async def _finalize(self, unit: UnitTrace) -> None:
        f0 = time.perf_counter()
        spent_s: float | None = None
        try:
            spent_s = await self._watched(
                f"finalize of unit {unit.output.seq}", self._finalize_timed
            )
        except EngineStuck as exc:
            self._finalize_error = exc
            self._wake.set()
        except Exception as exc:  # surfaces at the next unit as an engine failure
            log.exception("session %s: finalize failed", self.session_id)
            self._finalize_error = exc
        finally:
            self._finalized.set()
            self._trace_unit(unit, f0, time.perf_counter())
            if spent_s is not None and self.on_unit is not None:
                timings = unit.output.timings
                engine_s = (timings.prefill_ms + timings.generate_ms) / 1000.0 + spent_s
                speaking = not unit.output.result.is_listen
                wall_s = timings.wall_clock_ms / 1000.0
                self.on_unit(self, unit.length_s, engine_s, wall_s, speaking)

    def _trace_unit(self, unit: UnitTrace, f0: float, f1: float) -> None:
        """One span per unit (receive -> finalize done) under the session's trace, with
        prefill / generate / finalize children, built from the measured times."""
        parent = self.spec.trace_context
        if parent is None:
            return
        span = TRACER.start_span("unit", context=parent, start_time=_ns(unit.received_at))
        if not span.is_recording():
            return  # tracing off here, or the trace sampled out: its children would be too
        out = unit.output
        result, timings = out.result, out.timings
        attributes: dict[str, AttributeValue] = {
            "session.id": self.session_id,
            "unit.seq": out.seq,
            "unit.kind": "listen" if result.is_listen else "speak",
            "unit.kv_cache_length": result.kv_cache_length,
            "unit.n_tokens": result.n_tokens,
            "unit.n_tts_tokens": result.n_tts_tokens,
            "unit.end_of_turn": result.end_of_turn,
            "unit.deadline_missed": out.late,
            "unit.dropped_before": len(out.dropped_seqs),
        }
        span.set_attributes(attributes)
        ctx = trace.set_span_in_context(span)
        p1 = unit.started + timings.prefill_ms / 1000.0
        g1 = p1 + timings.generate_ms / 1000.0
        for name, a, b in (
            ("prefill", unit.started, p1),
            ("generate", p1, g1),
            ("finalize", f0, f1),
        ):
            TRACER.start_span(name, context=ctx, start_time=_ns(a)).end(end_time=_ns(b))
        span.end(end_time=_ns(f1))

    def _output_cap_reached(self) -> bool:
        cap = self.spec.settings.max_tokens
        return cap is not None and cap > 0 and self.usage.output_tokens >= cap

    def _add_usage(self, result: GenerateResult) -> None:
        self.usage.input_audio_tokens += result.input_audio_tokens
        self.usage.input_vision_tokens += result.input_vision_tokens
        self.usage.output_text_tokens += result.n_tokens
        self.usage.output_audio_tokens += result.n_tts_tokens

    async def _end(self, reason: CloseReason, detail: str, error_code: str = "") -> SessionEnd:
        """Free the engine session and memory, then emit the one SessionEnd, worded by its
        reason (an engine failure's: by its error code) with `detail`."""
        if self.ended is not None:
            return self.ended
        report = await self._free()
        self._mailbox.discard()
        self.ended = SessionEnd(
            reason=reason,
            message=close_reasons.close_message(error_code or reason.value, detail),
            usage=replace(self.usage),
            units_served=self.units_served,
            units_dropped=self._mailbox.dropped_total,
            error_code=error_code,
            late_units=self.late_units,
        )
        log.info(
            "session %s ended: %s (%s), %d units served, %d dropped, %d late",
            self.session_id,
            reason.value,
            self.ended.message,
            self.units_served,
            self._mailbox.dropped_total,
            self.late_units,
        )
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None
        self._emit(self.ended)
        if self.on_freed is not None:
            try:
                self.on_freed(self, report)
            except Exception:
                log.exception("session %s: on_freed failed", self.session_id)
        return self.ended

    async def _free(self) -> memory.MemoryReport | None:
        """stop() and close() the engine session, then clean memory. Never raises.

        After a stuck engine call this returns None at once and frees the engine session
        once that call returns (the engine must not be called while it runs)."""
        if self._finalize_task is not None:
            await self._finalize_task
        engine_session, self._engine_session = self._engine_session, None
        if self._stuck is not None:
            if self._late_free is None:
                self._late_free = asyncio.ensure_future(
                    self._free_after(self._stuck, engine_session)
                )
            return None
        return await self._release(engine_session)

    async def _free_after(
        self, stuck: asyncio.Future[Any], engine_session: EngineSession | None
    ) -> None:
        """Free the engine session once the stuck call returned (it may never)."""
        started = self._loop.time()
        await asyncio.wait({stuck})
        if not stuck.cancelled():
            stuck.exception()  # retrieved: its outcome no longer matters
        log.warning(
            "session %s: the stuck engine call returned after %.1f s more; freeing it",
            self.session_id,
            self._loop.time() - started,
        )
        report = await self._release(engine_session)
        if self.on_unstuck is not None:
            self.on_unstuck(self, report)

    async def _release(self, engine_session: EngineSession | None) -> memory.MemoryReport | None:
        """stop() and close() `engine_session`, then clean memory. Never raises."""
        report = None
        try:
            if engine_session is not None:
                await self._call(_stop_and_close, engine_session, self.session_id)
            report = await self._call(memory.cleanup)
            log.info(
                "session %s memory cleanup (%s): %.1f MiB -> %.1f MiB",
                self.session_id,
                report.device,
                report.before_bytes / 2**20,
                report.after_bytes / 2**20,
            )
        except Exception:
            log.exception("session %s: cleanup failed", self.session_id)
        return report


def _stop_and_close(engine_session: EngineSession, session_id: str) -> None:
    """stop() then close(); close() runs even when stop() raises."""
    try:
        engine_session.stop()
    except Exception:
        log.exception("session %s: engine stop failed", session_id)
    finally:
        engine_session.close()
