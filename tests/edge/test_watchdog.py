"""The edge's unit watchdog (SessionCore): a unit left unanswered past the unit timeout
ends the session with error, at its deadline; units answered in time never do."""

from __future__ import annotations

import asyncio
import time

from omnifabric.common.close_reasons import close_message
from omnifabric.edge import events as ev
from omnifabric.edge.session import SessionCore

TIMEOUT_S = 0.4


def core_with(closed: list[ev.Closed]) -> SessionCore:
    async def emit(event) -> None:
        if isinstance(event, ev.Closed):
            closed.append(event)

    return SessionCore("audio", fabric=None, emit=emit, unit_timeout_s=TIMEOUT_S)  # type: ignore[arg-type]


async def test_units_answered_in_time_keep_the_session():
    closed: list[ev.Closed] = []
    core = core_with(closed)
    watchdog = asyncio.create_task(core._watchdog())
    try:
        for seq in range(1, 16):  # 1.5 s of units, each answered after 60 ms
            core._waiting[seq] = time.monotonic()
            await asyncio.sleep(0.06)
            core._waiting.pop(seq)
            await asyncio.sleep(0.04)
        assert not closed and not watchdog.done()
    finally:
        watchdog.cancel()
        await core.close()


async def test_an_unanswered_unit_ends_the_session_at_its_deadline():
    closed: list[ev.Closed] = []
    core = core_with(closed)
    watchdog = asyncio.create_task(core._watchdog())
    await asyncio.sleep(0.25)  # the watchdog sleeps with nothing waiting
    core._waiting[1] = time.monotonic()
    sent = time.monotonic()
    await asyncio.sleep(0.1)
    core._waiting[2] = time.monotonic()  # a later unit is due later
    await asyncio.wait_for(watchdog, 5.0)
    took = time.monotonic() - sent
    assert [c.reason for c in closed] == [ev.ERROR]
    assert closed[0].message == close_message("error", "the worker stopped responding")
    assert TIMEOUT_S <= took < TIMEOUT_S + 0.3, took
