"""Batched steps: one engine call serves one unit of every session that has one waiting.

StepBatcher is the UnitRunner of a worker whose engine offers a Stepper (Engine.stepper)
while batching is on (`--batching`). Sessions hand it their units (run) and their deferred
finalizes (finalize); one driver task on the event loop feeds the engine one call at a time:

- finalizes waiting go first, in one call (each fences its own session's next unit);
- otherwise the units waiting make a step. The oldest of them waits at most `window_s` for
  batch-mates, and not at all once every open session has a unit waiting; a unit that
  arrives during a step joins the next one.

Each call is bounded by the unit timeout from when it starts: past it, every session in the
call gets its EngineStuck (the engine thread cannot be interrupted; the worker reports
itself stuck). A row's own failure fails that row's session alone. For the real-time
headroom a unit is charged its share of its step (and a finalize its share of its call):
what one more session costs a batched engine is what it adds to the step, not a whole
unit's compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from omnifabric.worker.engine import (
    RunnerSession,
    StepOutcome,
    Stepper,
    StepRow,
    UnitRun,
    UnitRunner,
)
from omnifabric.worker.engine_call import EngineCall, Overran
from omnifabric.worker.units import UnitInput

log = logging.getLogger("omnifabric.worker.batcher")

#: How long the oldest waiting unit waits for batch-mates, unless configured (seconds).
WINDOW_S = 0.010

#: Called after each step: sessions in it, its phase times (ms), its wall time (s).
StepObserver = Callable[[int, dict[str, float], float], None]


@dataclass(slots=True)
class _Waiting:
    """A unit (row set) or a finalize (row None) handed in, and who waits for it."""

    session: RunnerSession
    row: StepRow | None
    seq: int
    future: asyncio.Future[Any]
    since: float


class StepBatcher(UnitRunner):
    """Runs the units of every session of a worker in batched steps on `executor`."""

    def __init__(
        self,
        stepper: Stepper,
        executor: Executor,
        unit_timeout_s: Callable[[], float | None],
        open_sessions: Callable[[], int],
        window_s: float = WINDOW_S,
        on_step: StepObserver | None = None,
    ) -> None:
        self.stepper = stepper
        self.executor = executor
        self.unit_timeout_s = unit_timeout_s
        """The unit timeout now (None: unbounded); asked at each call (worker.runtime's
        follows the engine's measures)."""
        self.window_s = max(0.0, window_s)
        self._open_sessions = open_sessions
        """How many sessions may hand in a unit (a full batch need not wait)."""
        self.on_step = on_step
        self._units: list[_Waiting] = []
        self._finalizes: list[_Waiting] = []
        self._arrived: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self.steps = 0
        """Steps run (for tests and logs)."""

    # ---- UnitRunner ------------------------------------------------------------------

    def run(
        self, session: RunnerSession, unit: UnitInput, force_listen: bool, max_slices: int
    ) -> Awaitable[UnitRun]:
        engine_session = session.engine_session
        assert engine_session is not None
        row = StepRow(engine_session, unit.pcm, unit.frames, max_slices, force_listen)
        return self._hand_in(self._units, session, row, unit.seq)

    def finalize(self, session: RunnerSession, seq: int) -> Awaitable[float]:
        return self._hand_in(self._finalizes, session, None, seq)

    # ---- the driver --------------------------------------------------------------------

    def _hand_in(
        self, queue: list[_Waiting], session: RunnerSession, row: StepRow | None, seq: int
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue.append(_Waiting(session, row, seq, future, time.perf_counter()))
        if self._arrived is None:
            self._arrived = asyncio.Event()
        self._arrived.set()
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        return future

    async def _drive(self) -> None:
        """Feed the engine while anything waits; ends when nothing does. A failure of the
        driver itself fails everyone waiting (none waits forever)."""
        current: list[_Waiting] = []
        try:
            while self._units or self._finalizes:
                if self._finalizes:
                    current, self._finalizes = _live(self._finalizes), []
                    if current:
                        await self._finalize_all(current)
                    continue
                await self._gather()
                if self._finalizes:
                    continue  # first: the sessions they fence may join this step
                current, self._units = _live(self._units), []
                if current:
                    await self._step(current)
        except Exception as exc:
            log.exception("batched steps: the driver failed")
            waiting = [*current, *self._units, *self._finalizes]
            self._units, self._finalizes = [], []
            failure = exc
            _fail(waiting, lambda _: failure)

    async def _gather(self) -> None:
        """Wait for batch-mates: until every open session has a unit waiting, a finalize
        comes, or the oldest unit has waited window_s."""
        arrived = self._arrived
        assert arrived is not None
        deadline = self._units[0].since + self.window_s
        while not self._finalizes and len(self._units) < self._open_sessions():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            arrived.clear()
            try:
                async with asyncio.timeout(left):
                    await arrived.wait()
            except TimeoutError:
                return

    async def _step(self, units: list[_Waiting]) -> None:
        rows = [w.row for w in units if w.row is not None]
        started = time.perf_counter()
        call = EngineCall(self.executor, self.stepper.step, rows)
        outcome: StepOutcome | None = await self._bounded(
            units, call, "unit {seq} (in a step of {n})"
        )
        if outcome is None:
            return
        took = time.perf_counter() - started
        self.steps += 1
        if len(outcome.rows) != len(units):
            error = RuntimeError(
                f"the engine's step gave {len(outcome.rows)} rows for {len(units)} units"
            )
            _fail(units, lambda _: error)
            return
        phases = outcome.phases_ms
        prefill_ms = phases.get("prefill", 0.0)
        generate_ms = phases.get("generate", max(0.0, took * 1000.0 - prefill_ms))
        share = took / len(units)
        for waiting, row in zip(units, outcome.rows, strict=True):
            if waiting.future.done():
                continue
            if isinstance(row, Exception):
                waiting.future.set_exception(row)
            else:
                costs, result = row
                waiting.future.set_result(
                    UnitRun(dict(costs), result, prefill_ms, generate_ms, started, share)
                )
        if self.on_step is not None:
            self.on_step(len(units), phases, took)

    async def _finalize_all(self, finalizes: list[_Waiting]) -> None:
        sessions = []
        for waiting in finalizes:
            engine_session = waiting.session.engine_session
            assert engine_session is not None  # a session frees only after its finalize
            sessions.append(engine_session)
        started = time.perf_counter()
        call = EngineCall(self.executor, self.stepper.finalize, sessions)
        failed: list[Exception | None] | None = await self._bounded(
            finalizes, call, "finalize of unit {seq} (with {n})"
        )
        if failed is None:
            return
        share = (time.perf_counter() - started) / len(finalizes)
        for waiting, error in zip(finalizes, failed, strict=True):
            if waiting.future.done():
                continue
            if error is not None:
                waiting.future.set_exception(error)
            else:
                waiting.future.set_result(share)

    async def _bounded(self, waiting: list[_Waiting], call: EngineCall, what: str) -> Any:
        """The call's result, or None once every waiter was failed: past the unit timeout
        from the call's start (worker.engine_call) with its session's EngineStuck (the call
        goes on in its thread), else with the call's own exception."""
        timeout = self.unit_timeout_s()
        try:
            return await call.bounded(timeout, asyncio.get_running_loop())
        except Overran:
            assert timeout is not None
            n = len(waiting)
            _fail(
                waiting,
                lambda w: w.session.stuck(what.format(seq=w.seq, n=n), call.future, timeout),
            )
        except Exception as exc:  # noqa: BLE001 - the call failed as a whole: so do its rows
            failure = exc
            _fail(waiting, lambda _: failure)
        return None


def _live(waiting: list[_Waiting]) -> list[_Waiting]:
    """Those still awaited (a session's task cancelled meanwhile cancelled its future)."""
    return [w for w in waiting if not w.future.done()]


def _fail(waiting: Sequence[_Waiting], error: Callable[[_Waiting], BaseException]) -> None:
    for w in waiting:
        if not w.future.done():
            w.future.set_exception(error(w))
