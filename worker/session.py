"""One duplex session's unit loop: prefill -> generate -> send -> deferred finalize.

A one-slot mailbox holds the next unit (the newest wins, worker.mailbox); the unit runner
(worker.runner, or the engine's batcher) runs it on the worker's engine threads; the
result goes to the sender at once through the session's journal (worker.journal) and
finalize runs behind it, fenced by an asyncio.Event barrier before the next prefill. Every
end frees the engine session and memory, then emits exactly one SessionEnd.

A half-duplex call (DuplexSettings.half_duplex) answers without the sender's units: from
the engine's first speaking unit until one ends its turn, the loop feeds the engine silent
units of its own, back to back (see _pumped), and streams each result as usual.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any

from omnifabric.common import close_reasons
from omnifabric.worker.engine import (
    INPUT_RATE,
    Engine,
    EngineSession,
    GenerateResult,
    UnitRunner,
)
from omnifabric.worker.engines import memory
from omnifabric.worker.errors import EngineFailure, EngineStuck
from omnifabric.worker.headroom import is_late
from omnifabric.worker.journal import Journal
from omnifabric.worker.mailbox import Intake, Mailbox
from omnifabric.worker.runner import TimeSliced
from omnifabric.worker.session_types import (
    CloseReason,
    SessionEnd,
    SessionLimits,
    SessionSpec,
    UnitOutput,
    UnitTimings,
    UnitTrace,
    Usage,
)
from omnifabric.worker.tracing import trace_unit
from omnifabric.worker.units import UnitInput

log = logging.getLogger("omnifabric.worker.session")
#: Late units a session logs one by one (where their time went); its end line counts them all.
LOGGED_LATE_UNITS = 3

#: What a served unit tells the worker's headroom (worker.headroom.Headroom.unit): the
#: session, seconds of input, engine seconds (prefill, generate and its finalize), wall
#: seconds (arrival to result), and whether it spoke (or its finalize started a reply).
UnitServed = Callable[["DuplexSession", float, float, float, bool], None]


@dataclass
class Answer:
    """A half-duplex answer the unit loop goes on with by itself (DuplexSession._pumped)."""

    seq: int
    """What the results of its silent units carry: the seq of the sender's unit that began
    the answer (answered already), or of the sender's force_listen unit taken since (the
    next result answers it). The sender's bookkeeping waits for neither."""
    tokens: int = 0
    """Output tokens of the answer so far (GenerateResult.n_tokens, from its first piece):
    at DuplexSettings.max_tokens, its next unit ends it."""
    ending: bool = False
    """The sender asked the answer to end (a force_listen unit): every further silent unit
    carries force_listen until the engine ends its turn."""


class DuplexSession:
    """The unit loop of one session. Feed it with submit()/close(); read journal.events()."""

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
        runner: UnitRunner | None = None,
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
        self._loop = asyncio.get_running_loop()
        self.runner = (
            runner
            if runner is not None
            else TimeSliced(executor, limits.unit_timeout_s, self._loop)
        )
        """Runs the units on the engine: the engine's batcher, else this session's own."""
        self.late_units = 0
        """Units whose result left later than one unit length after they arrived (a second
        at least: headroom.is_late)."""
        self._stuck: asyncio.Future[Any] | None = None
        self._late_free: asyncio.Task[None] | None = None
        self.prompt_length = 0
        self.notes: tuple[str, ...] = ()
        self.model_unit_samples = 0
        """The engine's own unit when it re-chunks the sender's units (later units' length:
        EngineSession.unit_samples), 0 when it takes them as they come."""
        self._tool_outputs: list[tuple[str, str]] = []
        """Function outputs from the sender, for the engine before the next unit."""
        """What the engine could not do as the session asked (for session.created)."""
        self.usage = Usage()
        self.units_served = 0
        self.ended: SessionEnd | None = None
        self._mailbox = Mailbox()
        self._intake = Intake(spec.session_id, self._mailbox, self._buffered)
        self._wake = asyncio.Event()
        self._finalized = asyncio.Event()
        self._finalized.set()
        self._finalize_task: asyncio.Task[None] | None = None
        self._finalize_error: BaseException | None = None
        self._computed_at = 0.0
        self._finalizing_seq = 0
        """The seq of the unit whose finalize runs (an early result carries it)."""
        """perf_counter() when the engine returned the latest unit's prefill and generate."""
        self._close_request: tuple[CloseReason, str] | None = None
        self.journal = (
            Journal(self._loop)
            if limits.journal_results is None
            else Journal(self._loop, limits.journal_results)
        )
        """Every event of the session, and which stream carries it."""
        self.last_unit_seq = 0
        self.engine_session: EngineSession | None = None
        self._deadline = 0.0
        self._half_duplex = spec.settings.half_duplex is True
        self.answer: Answer | None = None
        """A half-duplex call's answer in progress: the loop feeds it silent units itself."""

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def lease_id(self) -> str:
        return self.spec.lease_id

    def duration_left_ms(self) -> int:
        """Milliseconds before the duration limit ends the session; 0: no limit."""
        left = self._deadline - self._loop.time()
        if not math.isfinite(left):
            return 0
        return max(1, int(left * 1000))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking engine call on the engine threads (never on the event loop)."""
        return await self._loop.run_in_executor(self.executor, fn, *args)

    def stuck(self, what: str, call: Future[Any], timeout_s: float) -> EngineStuck:
        """An engine call of this session (`what`) overran the unit timeout: the thread
        cannot be interrupted, so the call is left running, and a new future follows it to
        its end (the engine session is freed only once it returns, see _free). Returns the
        EngineStuck its runner raises."""
        self._stuck = asyncio.wrap_future(call, loop=self._loop)
        detail = f"engine stuck: {what} of session {self.session_id} over {timeout_s:g} s"
        log.error("session %s: %s", self.session_id, detail)
        if self.on_stuck is not None:
            self.on_stuck(self, detail)
        return EngineStuck(f"the engine did not finish {what} within {timeout_s:g} s")

    async def open(self) -> int:
        """Open the engine session and prepare the prompt; returns the prompt length.

        The duration limit counts from here. Raises EngineFailure (engine session freed).
        """
        # No duration limit (0): the deadline never comes.
        self._deadline = self._loop.time() + (self.limits.duration_s or math.inf)
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
        return self.prompt_length

    def _open_blocking(self) -> int:
        """open_session + prepare on an engine thread; keeps the engine session for _free."""
        spec = self.spec
        self.engine_session = self.engine.open_session(spec.session_id, spec.mode)
        if spec.early_results and spec.settings.half_duplex is not True:
            # A half-duplex answer's units come back to back (the loop feeds them): there
            # is no wait for a finalize's output to save.
            self.engine_session.early_sink = self._early_sink
        self.engine_session.speech_cuts = spec.speech_cuts
        sizes = self.engine_session.unit_samples()
        self.model_unit_samples = sizes[1] if sizes else 0
        self._intake.configure(sizes, spec.settings.half_duplex is True)
        length = int(
            self.engine_session.prepare(
                spec.system_prompt, spec.ref_audio, spec.tts_ref_audio, spec.settings
            )
        )
        offered = self.engine_session.offer_tools(spec.tools, spec.tool_choice)
        self.notes = (*self.engine_session.notes, *offered)
        return length

    def _early_sink(self, result: GenerateResult) -> None:
        """EngineSession.early_sink: called on the finalize's engine thread; the result goes
        out from the loop, before the finalize's end is seen there (both are queued to the
        loop in the order they happen)."""
        self._loop.call_soon_threadsafe(self._emit_early, result, self._finalizing_seq)

    def _emit_early(self, result: GenerateResult, seq: int) -> None:
        """A finalize's output (UnitOutput.early), sent at once: it answers no unit."""
        if self.ended is not None:
            return
        self._add_usage(result)
        self.journal.emit(
            UnitOutput(
                seq=seq,
                result=result,
                timings=UnitTimings(engine_costs_ms=dict(result.costs_ms)),
                usage=replace(self.usage),
                dropped_seqs=[],
                early=True,
            )
        )

    def tool_output(self, call_id: str, output: str) -> None:
        """A function's output from the sender: the engine takes it before the next unit."""
        self._tool_outputs.append((call_id, output))

    def submit(self, unit: UnitInput) -> None:
        """Hand a unit to the loop; a unit still waiting is replaced (newest wins), except
        in a re-chunked session or a half-duplex call (see Mailbox.join)."""
        if self._close_request is not None or self.ended is not None:
            return
        self.last_unit_seq = max(self.last_unit_seq, unit.seq)
        self._mailbox.put(unit)
        self._wake.set()

    def close(self, reason: CloseReason, detail: str = "") -> None:
        """Ask the loop to end after the unit in progress; the first request wins. `detail`:
        what exactly ended it, added to the reason's sentence (none for a plain close)."""
        if self._close_request is None:
            self._close_request = (reason, detail)
        self._wake.set()

    def resume_left_s(self) -> float | None:
        """Seconds left to resume a detached session; None while a stream carries it."""
        return self.journal.resume_left_s()

    def detach(self) -> None:
        """The stream is gone without close: wait resume_grace_s for a resume, then end as
        a client close. Units still waiting are served; their results are kept."""
        if self.ended is not None or self.journal.detached:
            return
        grace = self.spec.resume_grace_s
        log.info("session %s detached: resumable for %.0f s", self.session_id, grace)
        self.journal.detach(
            grace, self.close, CloseReason.CLIENT_CLOSED, "its resume window passed"
        )

    def requests_ended(self, attachment: int, broken: bool = False) -> None:
        """The requests of the stream of `attachment` ended without close (half-closed, or
        `broken`). A resumable session ends only with close (the edge always sends one):
        the stream is let go, and the session is left to the stream's end (detached); a
        broken stream is left to it as it is. Any other session closes as the client's.
        Nothing when another stream carries the session."""
        if self.spec.resume_grace_s > 0:
            if not broken and self.journal.attachment == attachment:
                self.journal.let_go(attachment)
            return
        if self.journal.attachment == attachment:
            self.close(CloseReason.CLIENT_CLOSED)

    def stream_ended(self, attachment: int) -> None:
        """The stream of `attachment` is over (its call ended, cancelled or not). Without
        a close, a resumable session's sender is gone (client dropped, edge lost): the
        session stays detached for its resume grace, and the unit loop frees it when that
        passes. Otherwise it closes as the client's (also on a client's cancellation: the
        unit loop frees the engine session). Nothing when the session ended or another
        stream carries it."""
        if self.ended is not None or self.journal.attachment != attachment:
            return
        if self.spec.resume_grace_s > 0 and self._close_request is None:
            self.detach()
        else:
            self.close(CloseReason.CLIENT_CLOSED)

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
            if self.answer is not None:
                # A half-duplex answer goes on at once, with or without the sender's units.
                for piece in self._pumped(units):
                    end = await self._serve_piece(piece)
                    if end is not None:
                        return end
                    if self.answer is None:
                        break
                continue
            if not units:
                self._wake.clear()
                try:
                    # asyncio.timeout, not wait_for: no task per wait (3.11's wait_for
                    # wraps the wait in one, two more loop turns before a unit starts).
                    async with asyncio.timeout(remaining if math.isfinite(remaining) else None):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            pieces = self._intake.model_units(units)
            for i, piece in enumerate(pieces):
                end = await self._serve_piece(piece)
                if end is not None:
                    return end
                if self.answer is not None:
                    # The answer began: the audio that waited behind it is not heard.
                    self._ignore(pieces[i + 1 :], piece.seq)
                    break

    async def _serve_piece(self, piece: UnitInput) -> tuple[CloseReason, str] | None:
        """Serve one model unit and follow a half-duplex answer; the session's end when the
        unit filled the context or a close came meanwhile, else None."""
        result = await self._serve_unit(piece)
        if self._half_duplex:
            self._follow(piece, result)
        cap = self._context_cap()
        if result.kv_cache_length >= cap:
            return CloseReason.CONTEXT_FULL, f"{cap} tokens"
        return self._close_request

    def _follow(self, unit: UnitInput, result: GenerateResult) -> None:
        """A half-duplex call's answer, as its sender sees it: from a speaking unit that
        did not end the turn until a unit that ends it (speaking or not)."""
        answer = self.answer
        if answer is None:
            if not result.is_listen and not result.end_of_turn:
                self.answer = Answer(seq=unit.seq, tokens=result.n_tokens)
        elif result.end_of_turn:
            self.answer = None
        else:
            answer.tokens += result.n_tokens

    def _pumped(self, units: list[UnitInput]) -> list[UnitInput]:
        """The next unit of a half-duplex answer: silence the worker feeds the engine itself
        (the sender sends none, so the answer costs it no round trip per piece). The
        sender's units taken meanwhile are not heard (the user's input while the model
        answers, as the call's protocol says): they are reported dropped with the next
        result, except the newest force_listen unit (an external stop), whose seq the
        next result carries and which ends the answer. Once the answer's tokens reached
        DuplexSettings.max_tokens (a half-duplex call's cap per answer) the unit carries
        force_listen too."""
        answer = self.answer
        assert answer is not None
        received_at = time.perf_counter()
        stop: UnitInput | None = None
        for unit in units:
            if unit.force_listen:
                if stop is not None:
                    self._mailbox.drop(stop.seq)
                stop = unit
            else:
                self._mailbox.drop(unit.seq)
        if stop is not None:
            answer.seq, answer.ending, received_at = stop.seq, True, stop.received_at
        cap = self.spec.settings.max_tokens
        capped = cap is not None and cap > 0 and answer.tokens >= cap
        return self._intake.silence(answer.seq, answer.ending or capped, received_at)

    def _ignore(self, pieces: list[UnitInput], answered: int) -> None:
        """Model units that waited behind the one that began a half-duplex answer: not
        heard; their client units (but `answered`'s) are reported dropped."""
        for seq in sorted({p.seq for p in pieces} - {answered}):
            self._mailbox.drop(seq)

    def _buffered(self, unit: UnitInput) -> None:
        """Answer a unit whose audio waits for more (it filled no model unit yet)."""
        self.journal.emit(
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
        while self._tool_outputs and self.engine_session is not None:
            call_id, said = self._tool_outputs.pop(0)
            await self._call(self.engine_session.tool_output, call_id, said)
        force_listen = unit.force_listen or self._output_cap_reached()
        max_slices = unit.max_slice_nums or self.spec.settings.max_slice_nums or 1
        run = await self.runner.run(self, unit, force_listen, max_slices)
        self._computed_at = time.perf_counter()
        self.units_served += 1
        result = run.result
        self._add_usage(result)
        timings = UnitTimings(
            prefill_ms=run.prefill_ms,
            generate_ms=run.generate_ms,
            finalize_wait_ms=finalize_wait_ms,
            queue_ms=(taken - unit.received_at) * 1000.0,
            engine_busy_ms=engine_busy_ms,
            engine_costs_ms={**run.costs_ms, **result.costs_ms},
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
        output.late = is_late(timings.wall_clock_ms / 1000.0, length_s)
        if output.late:
            self.late_units += 1
            if self.late_units <= LOGGED_LATE_UNITS:
                self._log_late(unit.seq, length_s, timings)
        self.journal.emit(output)
        # Deferred finalize: the result is already on its way; the barrier fences the next prefill.
        self._finalized.clear()
        self._finalize_task = asyncio.ensure_future(
            self._finalize(UnitTrace(unit.received_at, run.started, output, length_s, run.engine_s))
        )
        return result

    def _log_late(self, seq: int, length_s: float, timings: UnitTimings) -> None:
        """Where a late unit's time went, for the operator (the end line counts them all)."""
        costs = ", ".join(f"{k} {v:.0f}" for k, v in timings.engine_costs_ms.items() if v >= 1)
        log.info(
            "session %s: unit %d late: answered %.2f s after it came, for %.2f s of audio "
            "(ms: queued %.0f, of it behind the session's earlier unit %.0f; waiting for its "
            "finalize %.0f; prefill %.0f, generate %.0f%s)",
            self.session_id,
            seq,
            timings.wall_clock_ms / 1000.0,
            length_s,
            timings.queue_ms,
            timings.engine_busy_ms,
            timings.finalize_wait_ms,
            timings.prefill_ms,
            timings.generate_ms,
            f"; engine: {costs}" if costs else "",
        )

    async def _finalize(self, unit: UnitTrace) -> None:
        f0 = time.perf_counter()
        spent_s: float | None = None
        self._finalizing_seq = unit.output.seq
        try:
            spent_s = await self.runner.finalize(self, unit.output.seq)
        except EngineStuck as exc:
            self._finalize_error = exc
            self._wake.set()
        except Exception as exc:  # surfaces at the next unit as an engine failure
            log.exception("session %s: finalize failed", self.session_id)
            self._finalize_error = exc
        finally:
            self._finalized.set()
            trace_unit(self.spec, unit, f0, time.perf_counter())
            if spent_s is not None and self.on_unit is not None:
                engine_s = unit.engine_s + spent_s
                engine_session = self.engine_session
                speaking = not unit.output.result.is_listen or (
                    engine_session is not None and engine_session.replying
                )
                wall_s = unit.output.timings.wall_clock_ms / 1000.0
                self.on_unit(self, unit.length_s, engine_s, wall_s, speaking)

    def _output_cap_reached(self) -> bool:
        """The session's output cap (DuplexSettings.max_tokens) is reached; in a half-duplex
        call the cap is each answer's instead (see _pumped)."""
        cap = self.spec.settings.max_tokens
        if self._half_duplex:
            return False
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
        self.journal.cancel_detach()
        self.journal.emit(self.ended)
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
        engine_session, self.engine_session = self.engine_session, None
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
