"""Admission from the registry's index (issue 55): Registry.pick answers what a scan of
every worker answers (the SERVING worker that can take the mode with the most free slots,
oldest on ties), through random registrations, grants, releases, health and slot changes,
headroom that refuses, hang-ups and removals; serving_capacity's cache follows changes."""

from __future__ import annotations

import random

from omnifabric.scheduler.registry import Headroom, Health, Mode, Registry, Worker

MODES = (Mode.AUDIO, Mode.CHAT)


def scan(registry: Registry, mode: Mode, margin: float) -> Worker | None:
    """The rule as a scan over every worker, in registration order."""
    best = None
    for worker in registry:
        if worker.can_take(mode, margin) and (best is None or worker.slots_free > best.slots_free):
            best = worker
    return best


def _worker(rng: random.Random, n: int) -> Worker:
    modes = frozenset(rng.sample(MODES, rng.randint(1, 2)))
    worker = Worker(f"w{n}", "127.0.0.1:1", rng.randint(1, 6), modes, "synthetic", Health.SERVING)
    if rng.random() < 0.5:  # a headroom that takes 2 sessions of each mode within the margin
        cost = {m: 0.35 for m in Mode}
        worker.headroom = Headroom(1, cost, dict(cost), late_recent=int(rng.random() < 0.2))
    return worker


def _step(rng: random.Random, registry: Registry, ids: list[str], n: int) -> None:
    """One random change of the fleet, as the core makes them."""
    workers = list(registry)
    action = rng.random()
    if action < 0.15 or not workers:
        registry.add(_worker(rng, rng.randint(0, 12)))  # a new worker, or one registering again
    elif action < 0.2:
        registry.remove(rng.choice(workers))
    elif action < 0.5:
        worker = rng.choice(workers)
        lease_id = f"l{n}"
        ids.append(lease_id)
        worker.take_slot(lease_id, mode=rng.choice(MODES))
    elif action < 0.8:
        worker = rng.choice(workers)
        if worker.lease_slots:
            worker.free_slot(rng.choice(list(worker.lease_slots)))
    elif action < 0.95:  # a report: health or slots may change, headroom always comes
        worker = rng.choice(workers)
        moved = rng.random() < 0.5
        if moved:
            worker.health = rng.choice([Health.SERVING, Health.SERVING, Health.NOT_SERVING])
            worker.slots = rng.randint(1, 6)
        registry.touch(worker, reindex=moved)
    else:
        rng.choice(workers).hung_up = True


def test_pick_from_the_index_is_the_scan() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        registry = Registry()
        ids: list[str] = []
        for n in range(400):
            _step(rng, registry, ids, n)
            for mode in MODES:
                for margin in (0.0, 0.8):
                    assert registry.pick(mode, margin) is scan(registry, mode, margin), (seed, n)


def test_capacity_is_counted_again_after_a_change() -> None:
    registry = Registry()
    worker = Worker("w1", "127.0.0.1:1", 4, frozenset({Mode.AUDIO}), "synthetic", Health.SERVING)
    registry.add(worker)
    assert registry.serving_capacity(Mode.AUDIO) == 4
    worker.slots = 6
    registry.touch(worker, reindex=False)  # a report
    assert registry.serving_capacity(Mode.AUDIO) == 6
    assert registry.serves(Mode.AUDIO) and not registry.serves(Mode.VIDEO)
    registry.remove(worker)
    assert registry.serving_capacity(Mode.AUDIO) == 0 and not registry.serves(Mode.AUDIO)


def test_the_index_stays_small_under_churn() -> None:
    registry = Registry()
    workers = [
        Worker(f"w{n}", "127.0.0.1:1", 64, frozenset({Mode.AUDIO}), "synthetic", Health.SERVING)
        for n in range(10)
    ]
    for worker in workers:
        registry.add(worker)
    for n in range(5000):
        worker = workers[n % 10]
        worker.take_slot(f"l{n}")
        worker.free_slot(f"l{n}")
    heap = registry._free[Mode.AUDIO].heap
    assert len(heap) <= 4 * len(workers) + 64
