"""The unit loop's pieces without gRPC: mailbox (newest wins), lease book, session ends."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omnifabric.worker.engines.synthetic import SyntheticEngine
from omnifabric.worker.errors import LeaseInUse, LeaseNotFound, ModeMismatch
from omnifabric.worker.leases import LeaseBook, LeaseGrant
from omnifabric.worker.session import (
    CloseReason,
    DuplexSession,
    Mailbox,
    SessionEnd,
    SessionLimits,
    SessionSpec,
)
from omnifabric.worker.units import UnitInput
from tests.conftest import scaled

SILENCE = np.zeros(16000, dtype=np.float32)


def test_mailbox_newest_wins():
    box = Mailbox()
    for seq in (1, 2, 3):
        box.put(UnitInput(seq=seq, pcm=SILENCE))
    assert [u.seq for u in box.take_all()] == [3]
    assert box.take_all() == []
    assert box.take_dropped() == [1, 2] and box.take_dropped() == []
    box.put(UnitInput(seq=4, pcm=SILENCE))
    box.discard()
    assert box.dropped_total == 3
    box.join = True  # re-chunked sessions keep every waiting unit
    for seq in (5, 6):
        box.put(UnitInput(seq=seq, pcm=SILENCE))
    assert [u.seq for u in box.take_all()] == [5, 6] and box.take_dropped() == []


async def test_lease_book_claims():
    book = LeaseBook()
    released = []
    book.on_released = released.append
    with pytest.raises(LeaseNotFound):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    book.grant(LeaseGrant("a", 0, "audio"))
    book.grant(LeaseGrant("v", 1, "video"))
    with pytest.raises(ModeMismatch):
        await book.claim("v", "audio", 0.05, lambda reason: None)
    revoked = []
    await book.claim("a", "audio", 0.05, revoked.append)
    with pytest.raises(LeaseInUse):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    assert book.active_ids() == ["a"]
    book.revoke("a", "gone")
    assert revoked == ["gone"] and released == []
    book.release("a")
    assert released == ["a"] and book.active_ids() == []
    with pytest.raises(LeaseInUse):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    assert book.drop_unused() == ["v"]


async def test_lease_book_waits_for_a_late_grant():
    book = LeaseBook()
    claim = asyncio.ensure_future(book.claim("late", "audio", scaled(2), lambda r: None))
    await asyncio.sleep(0.05)
    book.grant(LeaseGrant("late", 0, "audio"))
    assert (await asyncio.wait_for(claim, scaled(2))).lease_id == "late"


async def run_session(limits, units=(), close=None):
    executor = ThreadPoolExecutor(2)
    freed = []
    session = DuplexSession(
        SessionSpec(session_id="s", lease_id="l", mode="audio"),
        SyntheticEngine(compute_ms=0),
        executor,
        limits,
        on_freed=lambda s, report: freed.append(report),
    )
    await session.open()
    runner = asyncio.ensure_future(session.run())
    for seq in units:
        session.submit(UnitInput(seq=seq, pcm=SILENCE))
        await asyncio.sleep(0.02)
    if close:
        session.close(close)
    events = []
    async for event in session.events():
        events.append(event)
    await asyncio.wait_for(runner, scaled(2))
    executor.shutdown()
    assert len(freed) == 1 and freed[0] is not None
    return events


async def test_session_ends_once_with_the_close_reason():
    events = await run_session(SessionLimits(60, 8192), units=[1, 2], close=CloseReason.USER_STOP)
    assert [e.seq for e in events[:-1]] == [1, 2]
    assert isinstance(events[-1], SessionEnd) and events[-1].reason == CloseReason.USER_STOP


async def test_session_duration_limit():
    loop = asyncio.get_running_loop()
    began = loop.time()
    events = await run_session(SessionLimits(0.3, 8192))
    assert events[-1].reason == CloseReason.TIMEOUT
    assert 0.3 <= loop.time() - began < scaled(1.0)


async def test_session_context_cap():
    events = await run_session(SessionLimits(60, 26), units=[1, 2, 3])
    assert [type(e).__name__ for e in events] == ["UnitOutput", "SessionEnd"]
    assert events[-1].reason == CloseReason.CONTEXT_FULL
