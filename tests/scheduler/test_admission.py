"""Real-time admission in the scheduler's core: a worker gets one more session only while
its sessions and the new one keep within the margin of its engine's time by the costs it
reports, and none while it is behind (late units lately); the rest wait, their estimate
counting the sessions the workers hold in real time."""

from __future__ import annotations

import asyncio

import pytest

from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import LeaseOffer, QueueUpdate, Scheduler, WorkerHello
from omnifabric.scheduler.registry import Headroom, Health, Mode
from tests.conftest import scaled
from tests.scheduler.clients import announce


def headroom(audio: float, chat: float = 1.0, late: int = 0, threads: int = 1) -> Headroom:
    costs = {Mode.AUDIO: audio, Mode.CHAT: chat}
    return Headroom(threads, costs, dict(costs), late_recent=late)


def hello(room: Headroom | None, slots: int = 8) -> WorkerHello:
    return WorkerHello(
        worker_id="w1",
        address="127.0.0.1:1",
        slots=slots,
        modes=frozenset({Mode.AUDIO, Mode.CHAT}),
        engine="synthetic",
        health=Health.SERVING,
        headroom=room,
    )


async def test_leases_stop_where_real_time_would_and_the_rest_wait():
    core = Scheduler(SchedulerConfig(release_timeout_s=0.05, eta_initial_s=30.0))
    worker = core.register(hello(headroom(0.3)))
    announcer = asyncio.ensure_future(announce(worker))
    try:
        first, second = core.acquire(Mode.AUDIO, "s1"), core.acquire(Mode.AUDIO, "s2")
        assert isinstance(await anext(first), LeaseOffer)
        assert isinstance(await anext(second), LeaseOffer)
        third = core.acquire(Mode.AUDIO, "s3")  # 0.6 + 0.3 is over 0.8 of one thread
        update = await anext(third)
        assert isinstance(update, QueueUpdate) and update.position == 1
        # Two sessions at a time go through the worker, both just begun: the next
        # starts when the first of them ends, a whole session less their age.
        assert update.estimated_wait_s == pytest.approx(30.0, abs=scaled(0.5))
        status = core.status()
        assert status.workers[0].admits == () and status.workers[0].slots_free == 6
        # A chat turn holds a whole thread: no room for it either.
        chat = core.acquire(Mode.CHAT, "c1")
        assert isinstance(await anext(chat), QueueUpdate)
        await first.aclose()  # one ends: the waiting audio session fits again
        assert isinstance(await asyncio.wait_for(anext(third), scaled(2)), LeaseOffer)
        for call in (second, third, chat):
            await call.aclose()
    finally:
        announcer.cancel()


async def test_a_worker_behind_takes_nothing_more_but_an_idle_one_takes_one():
    core = Scheduler(SchedulerConfig(release_timeout_s=0.05))
    worker = core.register(hello(headroom(2.0)))  # slower than real time even alone
    announcer = asyncio.ensure_future(announce(worker))
    try:
        first = core.acquire(Mode.AUDIO, "s1")
        assert isinstance(await anext(first), LeaseOffer)  # idle: it always takes one
        second = core.acquire(Mode.AUDIO, "s2")
        assert isinstance(await anext(second), QueueUpdate)
        await first.aclose()
        assert isinstance(await asyncio.wait_for(anext(second), scaled(2)), LeaseOffer)
        # Cheap sessions, but late units lately: the worker is behind, it takes none.
        core.report(worker, Health.SERVING, "", headroom=headroom(0.1, late=3))
        third, fourth = core.acquire(Mode.AUDIO, "s3"), core.acquire(Mode.AUDIO, "s4")
        assert isinstance(await anext(third), QueueUpdate)
        # Behind, the worker counts for the one session it holds, not the 8 its costs
        # would fit: the second in line waits two sessions' lengths.
        update = await anext(fourth)
        assert isinstance(update, QueueUpdate) and update.position == 2
        assert update.estimated_wait_s == pytest.approx(2 * core.sessions.mean_s(Mode.AUDIO))
        core.report(worker, Health.SERVING, "", headroom=headroom(0.1))  # recovered
        assert isinstance(await asyncio.wait_for(anext(third), scaled(2)), LeaseOffer)
        for call in (second, third, fourth):
            await call.aclose()
    finally:
        announcer.cancel()


async def test_without_a_margin_or_a_report_slots_alone_decide():
    for config, room in (
        (SchedulerConfig(realtime_margin=0.0), headroom(0.5)),
        (SchedulerConfig(), None),
    ):
        core = Scheduler(config)
        worker = core.register(hello(room, slots=3))
        announcer = asyncio.ensure_future(announce(worker))
        try:
            calls = [core.acquire(Mode.AUDIO, f"s{n}") for n in range(4)]
            events = [await anext(call) for call in calls]
            assert [type(e) for e in events] == [LeaseOffer] * 3 + [QueueUpdate]
            for call in calls:
                await call.aclose()
        finally:
            announcer.cancel()


def test_a_report_changes_the_slots():
    core = Scheduler(SchedulerConfig())
    worker = core.register(hello(headroom(0.3), slots=5))
    core.report(worker, Health.SERVING, "", slots=2)
    assert core.status().workers[0].slots == 2
    core.report(worker, Health.SERVING, "")  # 0: as before
    assert core.status().workers[0].slots == 2


async def test_two_dear_units_at_once_must_fit_the_threads_too():
    """A reference-like worker: replies cost 0.35 a second on average (two fit 0.8 of its
    one thread) but the unit that ends a turn costs 0.95, so two such units at once would
    both be late: it takes one session. A batched worker with the same figures adds only
    0.05 at a peak (its step serves every row at once): it takes two. An older worker
    that reports no peaks is read by its means alone."""
    peaky = Headroom(1, {Mode.AUDIO: 0.35}, {Mode.AUDIO: 0.35})
    peaky.peak_cost[Mode.AUDIO] = 0.95
    batched = Headroom(1, {Mode.AUDIO: 0.35}, {Mode.AUDIO: 0.35})
    batched.peak_cost[Mode.AUDIO], batched.added_peak[Mode.AUDIO] = 0.95, 0.05
    older = Headroom(1, {Mode.AUDIO: 0.35}, {Mode.AUDIO: 0.35})
    for room, admitted in ((peaky, 1), (batched, 2), (older, 2)):
        assert room.sessions_within(Mode.AUDIO, 0.8) == admitted
        core = Scheduler(SchedulerConfig(release_timeout_s=0.05))
        worker = core.register(hello(room))
        announcer = asyncio.ensure_future(announce(worker))
        try:
            calls = [core.acquire(Mode.AUDIO, f"s{n}") for n in range(3)]
            events = [await anext(call) for call in calls]
            offers = [type(e) for e in events]
            assert offers == [LeaseOffer] * admitted + [QueueUpdate] * (3 - admitted), room
            for call in calls:
                await call.aclose()
        finally:
            announcer.cancel()


def test_peaks_travel_from_the_worker_report_to_the_scheduler_and_its_status():
    from omnifabric.scheduler.service import _headroom_from_pb, _headroom_to_pb
    from omnifabric.worker.headroom import HeadroomFigures, ModeCost
    from omnifabric.worker.registration import headroom_pb

    figures = HeadroomFigures(1, {"audio": ModeCost(0.35, 0.35, 0.95, 0.05)}, 0, 0, 15.0, 0.4, {})
    room = _headroom_from_pb(headroom_pb(figures))
    assert room.peak_cost == {Mode.AUDIO: pytest.approx(0.95)}
    assert room.added_peak == {Mode.AUDIO: pytest.approx(0.05)}
    again = _headroom_from_pb(_headroom_to_pb(room))
    assert (again.peak_cost, again.added_peak) == (room.peak_cost, room.added_peak)
