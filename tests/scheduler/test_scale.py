"""What keeps the scheduler's work per message small at fleet scale (issue 55): a held
lease waits on one future for all its signals (none left behind when its holder goes), a
full fleet is dispatched without walking its queue, and a large status is built off the
event loop into the same reply."""

from __future__ import annotations

import asyncio

import pytest

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.scheduler import service
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import QueueUpdate, Scheduler, WorkerHello
from omnifabric.scheduler.leases import LeaseState, Signal, first_set
from omnifabric.scheduler.registry import Health, Mode
from tests.conftest import scaled
from tests.scheduler.clients import Holder, WorkerStream
from tests.scheduler.conftest import StartScheduler


async def test_the_first_of_several_signals_wakes_one_waiter_and_leaves_none() -> None:
    lost, moved, ending = Signal(), Signal(), Signal()
    waiter = asyncio.ensure_future(first_set(ending, lost, moved))
    await asyncio.sleep(0)
    assert not waiter.done()
    moved.set()
    await asyncio.wait_for(waiter, scaled(1))
    assert moved.is_set() and not lost.is_set()
    assert not ending._waiters and not lost._waiters  # the future is gone from each
    cancelled = asyncio.ensure_future(first_set(ending, lost))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not ending._waiters and not lost._waiters
    await asyncio.wait_for(first_set(moved), scaled(1))  # already set: at once
    ending.set()
    ending.set()  # setting twice is harmless
    await asyncio.wait_for(ending.wait(), scaled(1))


async def test_a_full_fleet_keeps_its_queue_in_order() -> None:
    core = Scheduler(SchedulerConfig())
    hello = WorkerHello(
        "w1", "127.0.0.1:1", 1, frozenset({Mode.AUDIO}), "synthetic", Health.SERVING
    )
    core.register(hello)
    first = core.acquire(Mode.AUDIO, "s0")
    pending = asyncio.ensure_future(anext(first))  # the grant waits for its announcement
    await asyncio.sleep(0.01)
    assert core.leases.count(LeaseState.ACTIVE) == 1
    waiting = [core.acquire(Mode.AUDIO, f"s{n}") for n in range(1, 4)]
    for n, holder in enumerate(waiting, start=1):
        update = await anext(holder)
        assert isinstance(update, QueueUpdate) and update.position == n
    # A report dispatches: nothing fits, the queue stays as it was.
    core.report(core.registry.get("w1"), Health.SERVING, "")
    assert [t.session_id for t in core.queue] == ["s1", "s2", "s3"]
    pending.cancel()
    for holder in waiting:
        await holder.aclose()


async def test_a_large_status_is_the_same_reply_built_off_the_loop(
    start_scheduler: StartScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=3).start()
    holders = [Holder(harness.stub, common_pb2.MODE_AUDIO, f"s{n}") for n in range(2)]
    for holder in holders:
        await holder.expect_lease()
    inline = await harness.stub.GetStatus(service.scheduler_pb.GetStatusRequest())
    monkeypatch.setattr(service, "STATUS_OFF_LOOP", 0)
    threaded = await harness.stub.GetStatus(service.scheduler_pb.GetStatusRequest())
    assert len(threaded.running) == 2 and len(threaded.workers) == 1
    for reply in (inline, threaded):
        for lease in reply.running:
            lease.elapsed_s = lease.estimated_remaining_s = 0.0  # they differ by the clock
        for entry in reply.queue:
            entry.waited_s = 0.0
    assert threaded == inline
    for holder in holders:
        holder.cancel()
    await worker.close()
