"""The liveness rule (scheduler.liveness, issue 55): a worker's silence is judged net of the
scheduler's own stalls, and a lost worker's leases wait a grace for it to come back.

The clock's arithmetic on a fake time; the rule on the real core with a real stall (the
event loop blocked past the worker timeout) and a real silence; the grace with a worker
that comes back and one that does not."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import LeaseLoss, LeaseOffer, Scheduler, WorkerHello
from omnifabric.scheduler.liveness import Liveness, LoopClock
from omnifabric.scheduler.registry import Health, Mode
from tests.conftest import scaled
from tests.scheduler.clients import announce


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Seen:
    last_seen = 0.0


def test_a_late_probe_is_a_stall_and_attended_time_leaves_it_out() -> None:
    t = FakeTime()
    clock = LoopClock(tick_s=0.1, jitter_s=0.02, now=t)
    clock.start()
    t.now += 0.11  # on time but for jitter: no stall
    assert clock.tick() == pytest.approx(0.01)
    assert clock.stalled_total() == 0.0
    t.now += 5.1  # the probe woke 5 s late: the loop did not run
    assert clock.stalled_total() == pytest.approx(4.98)  # open stall: seen before the tick
    assert clock.attended() == pytest.approx(t.now - 4.98)
    assert clock.tick() == pytest.approx(5.0)
    assert clock.stalled_total() == pytest.approx(4.98)  # closed: the same figure
    assert clock.lag_max_s() == pytest.approx(5.0)
    t.now += 0.1
    clock.tick()
    assert clock.stalled_total() == pytest.approx(4.98)


def test_silence_counts_only_while_the_scheduler_listened() -> None:
    t = FakeTime()
    clock = LoopClock(tick_s=0.1, jitter_s=0.02, now=t)
    rule = Liveness(3.0, clock)
    worker = Seen()
    clock.start()
    rule.seen(worker)
    t.now += 5.1  # the scheduler was paused 5 s: the worker's reports waited in its socket
    assert not rule.hung(worker)
    assert rule.silence_s(worker) == pytest.approx(0.12)
    clock.tick()
    for _ in range(31):  # 3.1 s of a scheduler listening and a worker saying nothing
        t.now += 0.1
        clock.tick()
    assert rule.hung(worker)
    rule.seen(worker)
    assert not rule.hung(worker)


def _hello(lease_ids: tuple[str, ...] = ()) -> WorkerHello:
    return WorkerHello(
        worker_id="w1",
        address="127.0.0.1:1",
        slots=2,
        modes=frozenset({Mode.AUDIO}),
        engine="synthetic",
        health=Health.SERVING,
        active_lease_ids=lease_ids,
    )


async def _until(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


async def test_a_stalled_loop_declares_no_worker_hung_and_real_silence_does() -> None:
    core = Scheduler(SchedulerConfig(worker_timeout_s=0.5))
    watch = asyncio.ensure_future(core.watch())
    try:
        await asyncio.sleep(0.15)
        worker = core.register(_hello())
        time.sleep(1.5)  # the scheduler stalls (a long collection, a pause): 3x the timeout
        await asyncio.sleep(0.3)  # a sweep or more (every 0.1 s here)
        assert not worker.hung_up and core.counters.workers_hung == 0
        assert core.clock.stalled_total() > 1.0
        assert core.metrics.registry.get_sample_value("omni_scheduler_stalled_seconds_total") > 1
        # Silence while the scheduler listens is the worker's: hung.
        await _until(lambda: worker.hung_up, 5)
        assert core.counters.workers_hung == 1
        assert worker.outbox.get_nowait() is None  # its Register stream ends
        assert not worker.can_take(Mode.AUDIO)
    finally:
        watch.cancel()


async def _leased(core: Scheduler) -> tuple:
    """w1 registered with one session granted on it: (worker, the holder's stream, offer)."""
    worker = core.register(_hello())
    announcer = asyncio.ensure_future(announce(worker))
    holder = core.acquire(Mode.AUDIO, "s1")
    offer = await anext(holder)
    assert isinstance(offer, LeaseOffer)
    announcer.cancel()
    return worker, holder, offer


async def test_a_lost_worker_that_comes_back_within_its_grace_keeps_its_sessions() -> None:
    core = Scheduler(SchedulerConfig())
    core.lost_grace_s = 5.0
    worker, holder, offer = await _leased(core)
    core.unregister(worker)  # its stream broke
    assert core.counters.workers_lost == 1
    next_event = asyncio.ensure_future(anext(holder))
    await asyncio.sleep(0.05)
    assert not next_event.done()  # the holder is not told anything yet
    back = core.register(_hello((offer.lease_id,)))
    assert back.lease_slots == {offer.lease_id: offer.slot}
    await asyncio.sleep(0.05)
    assert not next_event.done() and core.counters.leases_lost == 0
    next_event.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await next_event  # the holder leaves: its generator ends
    assert core.leases.get(offer.lease_id) is not None  # returning to the worker


async def test_a_lost_worker_that_does_not_come_back_loses_its_leases_after_the_grace() -> None:
    core = Scheduler(SchedulerConfig())
    core.lost_grace_s = 0.3
    worker, holder, offer = await _leased(core)
    core.unregister(worker)
    lost_at = time.monotonic()
    loss = await asyncio.wait_for(anext(holder), scaled(2))
    assert isinstance(loss, LeaseLoss) and loss.reason == "worker w1 lost"
    assert time.monotonic() - lost_at >= 0.25
    assert core.counters.leases_lost == 1
    await holder.aclose()
