"""LeaseTable's indexes (by worker, API key, resume key and, per mode, grant time), its
counts per state and its longest-running leases, and the queue's count per key, answer as
a walk over every lease and ticket would, on random histories (issue 55)."""

from __future__ import annotations

import random

from omnifabric.scheduler.leases import Lease, LeaseState, LeaseTable
from omnifabric.scheduler.queue import Ticket, WaitQueue
from omnifabric.scheduler.registry import Mode

HELD = (LeaseState.ACTIVE, LeaseState.DETACHED, LeaseState.ORPHAN)


def _check(table: LeaseTable, workers: list[str], keys: list[str]) -> None:
    every = list(table)
    for worker_id in workers:
        assert table.on_worker(worker_id) == [x for x in every if x.worker_id == worker_id]
    for key in keys:
        assert table.held_by(key) == sum(1 for x in every if x.key == key and x.state in HELD)
        first = next((x for x in every if x.resume_key == key), None)
        assert table.by_resume_key(key) is (first if key else None)
    for mode in (*Mode, None):
        walk = sorted((x.granted_at, x.lease_id) for x in every if x.mode is mode)
        assert table.grants(mode) == walk
    for state in LeaseState:
        assert table.count(state) == sum(1 for x in every if x.state is state)
    active = sorted(
        (x for x in every if x.state is LeaseState.ACTIVE), key=lambda x: (x.granted_at, x.lease_id)
    )
    assert table.active() == active
    assert table.active(3) == active[:3] and table.active(0) == []
    assert len(table) == len(every)


def test_the_lease_indexes_match_a_walk():
    rng = random.Random(55)
    workers, keys = ["w1", "w2", "w3"], ["", "k1", "k2", "k3"]
    table = LeaseTable()
    ids: list[str] = []
    for _ in range(2000):
        if ids and rng.random() < 0.4:
            table.pop(ids.pop(rng.randrange(len(ids))))
        elif ids and rng.random() < 0.2:
            lease = table.get(rng.choice(ids))
            assert lease is not None
            table.set_state(lease, rng.choice(list(LeaseState)))
        else:
            lease = Lease(
                worker_id=rng.choice(workers),
                slot=0,
                mode=rng.choice([Mode.AUDIO, Mode.VIDEO, None]),
                key=rng.choice(keys),
                resume_key=rng.choice(keys),
                # Mostly in time order, as grants are; rebuilt leases and ties too.
                granted_at=rng.choice([float(len(ids)), rng.uniform(0, 100), 5.0]),
            )
            table.add(lease)
            ids.append(lease.lease_id)
        _check(table, workers, keys)
    for lease_id in ids:
        table.pop(lease_id)
    assert (table._by_worker, table._by_key, table._by_resume_key) == ({}, {}, {})
    assert not any(table.grants(mode) for mode in (*Mode, None))
    assert not any(table.count(state) for state in LeaseState)


def test_the_queue_counts_waiting_tickets_per_key():
    rng = random.Random(7)
    queue = WaitQueue(queue_max=1000)
    waiting: list[Ticket] = []
    for _ in range(500):
        if waiting and rng.random() < 0.45:
            queue.remove(waiting.pop(rng.randrange(len(waiting))))
        else:
            ticket = Ticket(mode=Mode.AUDIO, session_id="s", key=rng.choice(["", "a", "b"]))
            queue.push(ticket)
            waiting.append(ticket)
        for key in ("a", "b"):
            assert queue.with_key(key) == sum(1 for t in queue if t.key == key)
        assert queue.with_key("") == 0
