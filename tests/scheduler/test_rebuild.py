"""A scheduler that begins to lead rebuilds its state from the fabric: the sessions its
workers report in their hellos (per-key counts, resumable and detached sessions with their
time left) and the callers edges re-send with how long they waited (their place in line)."""

from __future__ import annotations

import asyncio

import pytest

from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import (
    HeldLease,
    LeaseOffer,
    QueueUpdate,
    Scheduler,
    WorkerHello,
)
from omnifabric.scheduler.errors import KeySessionLimit, ResumeForbidden, ResumeUnknown
from omnifabric.scheduler.leases import LeaseRevokeNotice, LeaseState
from omnifabric.scheduler.registry import Health, Mode
from tests.conftest import scaled
from tests.scheduler.clients import announce


def new_leader(**config: float) -> Scheduler:
    core = Scheduler(SchedulerConfig(release_timeout_s=0.05, **config))
    core.lead(7, "b")
    return core


def hello(held: tuple[HeldLease, ...], slots: int = 3, ids: tuple[str, ...] = ()) -> WorkerHello:
    return WorkerHello(
        worker_id="w1",
        address="127.0.0.1:1",
        slots=slots,
        modes=frozenset({Mode.AUDIO}),
        engine="synthetic",
        health=Health.SERVING,
        active_lease_ids=ids or tuple(h.lease_id for h in held),
        held_leases=held,
    )


RUNNING = HeldLease("L1", Mode.AUDIO, "s1", key="k", resume_key="r1", owner="o1", resume_grace_s=30)
DETACHED = HeldLease(
    "L2",
    Mode.AUDIO,
    "s2",
    key="k",
    resume_key="r2",
    owner="o2",
    resume_grace_s=30,
    detached=True,
    resume_left_s=12.0,
)


async def test_reported_sessions_count_for_their_key_and_can_be_resumed() -> None:
    core = new_leader()
    worker = core.register(hello((RUNNING, DETACHED)))
    assert worker.slots_free == 1
    assert core.leases.get("L1").state is LeaseState.ORPHAN  # running, no holder here
    detached = core.leases.get("L2")
    assert detached.state is LeaseState.DETACHED and detached.mode is Mode.AUDIO
    # What was left of its window when the worker reported it, not the whole grace.
    assert detached.release_timer is not None
    left = detached.release_timer.when() - asyncio.get_running_loop().time()
    assert 11.5 < left <= 12.05
    # Key k holds two sessions: its limit of two is reached on the new leader too.
    with pytest.raises(KeySessionLimit):
        await anext(core.acquire(Mode.AUDIO, "s3", key="k", key_limit=2))
    announcer = asyncio.ensure_future(announce(worker))
    try:
        with pytest.raises(ResumeForbidden):
            await anext(core.reattach("r2", "someone else"))
        for resume_key, owner in (("r2", "o2"), ("r1", "o1")):
            holder = core.reattach(resume_key, owner)
            offer = await anext(holder)
            assert isinstance(offer, LeaseOffer) and offer.epoch == 7
            assert offer.worker_address == "127.0.0.1:1"
            await holder.aclose()  # gone again: detached with its grace, as granted here
        assert core.leases.get("L1").state is LeaseState.DETACHED
        assert core.leases.get("L2").release_timer.when() - asyncio.get_running_loop().time() > 29
    finally:
        announcer.cancel()


async def test_a_detached_session_is_taken_back_when_its_time_left_passes() -> None:
    core = new_leader()
    short = HeldLease("L3", Mode.AUDIO, "s3", resume_key="r3", owner="o", resume_grace_s=30,
                      detached=True, resume_left_s=0.1)  # fmt: skip
    worker = core.register(hello((short,)))
    notice = await asyncio.wait_for(worker.outbox.get(), scaled(2))
    assert isinstance(notice, LeaseRevokeNotice) and notice.lease_id == "L3"
    assert notice.reason == "resume window passed"


async def test_ids_without_detail_are_taken_slots_only() -> None:
    core = new_leader()
    # An id alone (an older worker), and one in a mode this scheduler does not know.
    unknown = HeldLease("odd", None, resume_key="r9", owner="o", resume_grace_s=30)
    worker = core.register(hello((unknown,), ids=("old", "odd")))
    for lease_id in ("old", "odd"):
        lease = core.leases.get(lease_id)
        assert lease.state is LeaseState.ORPHAN and lease.mode is None and not lease.resume_key
    assert worker.slots_free == 1
    with pytest.raises(ResumeUnknown):
        await anext(core.reattach("r9", "o"))
    core.release(worker, "old")
    assert worker.slots_free == 2


async def test_resent_callers_keep_their_place_and_are_not_refused_again() -> None:
    core = new_leader(queue_max=1)
    worker = core.register(hello((RUNNING,), slots=1))  # its one slot is taken
    announcer = asyncio.ensure_future(announce(worker))
    try:
        # A new caller arrives first at the new leader...
        new = core.acquire(Mode.AUDIO, "new", key="k", key_limit=3)
        assert (await anext(new)).position == 1
        # ...then two that waited 20 s and 10 s at the old one come back in the wrong order
        # (the queue is full and the key at its limit: they were admitted before).
        second = core.acquire(
            Mode.AUDIO, "second", key="k", key_limit=2, waited_s=10.0, previous_position=2
        )
        first = core.acquire(
            Mode.AUDIO, "first", key="k", key_limit=2, waited_s=20.0, previous_position=1
        )
        assert (await anext(second)).position == 1
        update = await anext(first)
        assert isinstance(update, QueueUpdate) and update.position == 1
        assert [e.session_id for e in core.status().queue] == ["first", "second", "new"]
        assert core.status().queue[0].waited_s >= 20.0
        assert core.leadership.rebuild_s is not None and core.leadership.rebuild_s < 3.0
        core.release(worker, "L1")  # the running session ends: the oldest caller is served
        assert isinstance(await asyncio.wait_for(anext(first), scaled(2)), LeaseOffer)
        for call in (first, second, new):
            await call.aclose()
    finally:
        announcer.cancel()
