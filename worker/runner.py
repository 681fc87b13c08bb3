"""The worker's unit runner: each session's units one by one on the engine threads.

Sessions take turns on the engine (time-sliced): a unit's prefill and generate run as one
call on an engine thread, its finalize as another, each bounded by the unit timeout from
when an engine thread takes it up (worker.engine_call). The unit loop (worker.session)
hands its units here unless the engine steps sessions together (Engine.stepper,
worker.batcher).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from omnifabric.worker.engine import RunnerSession, UnitRun, UnitRunner
from omnifabric.worker.engine_call import EngineCall, Overran
from omnifabric.worker.units import UnitInput


class TimeSliced(UnitRunner):
    """One session's units, one engine call at a time on `executor`, each bounded by
    `unit_timeout_s` (None: unbounded)."""

    def __init__(
        self, executor: Executor, unit_timeout_s: float | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.executor = executor
        self.unit_timeout_s = unit_timeout_s
        self._loop = loop

    def run(
        self, session: RunnerSession, unit: UnitInput, force_listen: bool, max_slices: int
    ) -> Awaitable[UnitRun]:
        return self._watched(
            session, f"unit {unit.seq}", _infer, session, unit, force_listen, max_slices
        )

    def finalize(self, session: RunnerSession, seq: int) -> Awaitable[float]:
        return self._watched(session, f"finalize of unit {seq}", _finalize_timed, session)

    async def _watched(
        self, session: RunnerSession, what: str, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """An engine call bounded by the unit timeout from when it starts
        (worker.engine_call). Raises EngineStuck (session.stuck) when it overruns: the
        thread cannot be interrupted, so the call is left running."""
        call = EngineCall(self.executor, fn, *args)
        try:
            return await call.bounded(self.unit_timeout_s, self._loop)
        except Overran:
            assert self.unit_timeout_s is not None
            raise session.stuck(what, call.future, self.unit_timeout_s) from None


def _infer(session: RunnerSession, unit: UnitInput, force_listen: bool, max_slices: int) -> UnitRun:
    """Prefill then generate, on an engine thread; returns costs, both durations (ms)
    and when prefill started (perf_counter)."""
    engine_session = session.engine_session
    assert engine_session is not None
    t0 = time.perf_counter()
    costs = engine_session.prefill(unit.pcm, unit.frames, max_slices) or {}
    t1 = time.perf_counter()
    result = engine_session.generate(force_listen)
    t2 = time.perf_counter()
    return UnitRun(dict(costs), result, (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, t0, t2 - t0)


def _finalize_timed(session: RunnerSession) -> float:
    """The engine's finalize, on an engine thread; returns the seconds it took there
    (a wait for a free engine thread left out)."""
    engine_session = session.engine_session
    assert engine_session is not None
    t0 = time.perf_counter()
    engine_session.finalize()
    return time.perf_counter() - t0
