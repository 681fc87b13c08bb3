"""The scheduler's status for a large fleet (issue 55): the workers' lease lists count
against the status's bound like the queue and the running leases, and each worker's leases
are counted by mode whatever is listed."""

from __future__ import annotations

import asyncio

from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import LeaseOffer, Scheduler, WorkerHello
from omnifabric.scheduler.registry import Headroom, Health, Mode, Worker
from tests.scheduler.clients import announce


def hello(worker_id: str, slots: int) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        address="127.0.0.1:1",
        slots=slots,
        modes=frozenset({Mode.AUDIO, Mode.CHAT}),
        engine="synthetic",
        health=Health.SERVING,
    )


async def test_lease_lists_are_whole_in_worker_order_until_the_bound_and_counted_always():
    core = Scheduler(SchedulerConfig(realtime_margin=0.0))
    workers = [core.register(hello(name, slots)) for name, slots in (("a", 2), ("b", 1), ("c", 2))]
    announcers = [asyncio.ensure_future(announce(w)) for w in workers]
    try:
        calls = [core.acquire(Mode.CHAT if n == 0 else Mode.AUDIO, f"s{n}") for n in range(5)]
        events = [await anext(call) for call in calls]
        assert all(isinstance(event, LeaseOffer) for event in events)

        def listed(max_entries: int | None, ticket_id: str = "") -> dict[str, int]:
            status = core.status(max_entries, ticket_id)
            for w in status.workers:  # the counts are whole, listed or not
                assert sum(w.leases_by_mode.values()) == w.slots - w.slots_free
                assert len(w.lease_modes) == len(w.lease_ids)
            return {w.worker_id: len(w.lease_ids) for w in status.workers}

        assert listed(None) == {"a": 2, "b": 1, "c": 2}
        assert listed(5) == {"a": 2, "b": 1, "c": 2}
        assert listed(3) == {"a": 2, "b": 1, "c": 0}  # c's two would pass the bound
        assert listed(2) == {"a": 2, "b": 0, "c": 0}  # none listed past the first cut
        assert listed(1) == {"a": 0, "b": 0, "c": 0}
        assert core.status(100, ticket_id="none").workers == ()
        by_mode: dict[Mode | None, int] = {}
        for w in core.status(0).workers:
            for mode, n in w.leases_by_mode.items():
                by_mode[mode] = by_mode.get(mode, 0) + n
        assert by_mode == {Mode.CHAT: 1, Mode.AUDIO: 4}
        # The late units per lease in a worker's headroom follow its lease list.
        late = {lease_id: 1 for lease_id in workers[2].lease_slots}
        room = Headroom(1, {Mode.AUDIO: 0.1}, {Mode.AUDIO: 0.1}, late_recent=2, late_by_lease=late)
        core.report(workers[2], Health.SERVING, "", headroom=room)
        cut = core.status(3).workers[2].headroom
        assert cut is not None and cut.late_by_lease == {} and cut.late_recent == 2
        whole = core.status(5).workers[2].headroom
        assert whole is not None and whole.late_by_lease == late
        # What a listed worker says of its leases, its counts say too.
        whole = {w.worker_id: w for w in core.status(None).workers}
        for w in whole.values():
            counted = {m: w.lease_modes.count(m) for m in set(w.lease_modes)}
            assert counted == dict(w.leases_by_mode)
        for call in calls:
            await call.aclose()
    finally:
        for announcer in announcers:
            announcer.cancel()


def test_a_workers_counts_by_mode_follow_its_slots():
    worker = Worker("w", "127.0.0.1:1", 4, frozenset({Mode.AUDIO, Mode.CHAT}), "e", Health.SERVING)
    worker.take_slot("a", mode=Mode.AUDIO)
    worker.take_slot("b", mode=Mode.AUDIO)
    worker.take_slot("c")  # an orphan: its mode not known
    assert worker.mode_counts == {Mode.AUDIO: 2, None: 1}
    worker.take_slot("b", mode=Mode.CHAT)  # taken again (a rebuild): counted once
    assert worker.mode_counts == {Mode.AUDIO: 1, Mode.CHAT: 1, None: 1}
    for lease_id in ("a", "a", "c", "unknown"):
        worker.free_slot(lease_id)
    assert worker.mode_counts == {Mode.CHAT: 1} and len(worker.lease_slots) == 1
