"""Lease records: a slot on a worker, held for as long as the holder's Acquire stream."""

from __future__ import annotations

import asyncio
import bisect
import enum
import heapq
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from omnifabric.scheduler.registry import Mode


class LeaseState(enum.Enum):
    """Where a lease is in its life."""

    #: The holder's Acquire stream is open.
    ACTIVE = "active"
    #: The holder is gone; the worker was told and its lease_released is awaited.
    RETURNING = "returning"
    #: A resumable lease whose holder is gone: it waits for a Reattach within its grace
    #: (the worker keeps the session detached and releases it when the grace passes).
    DETACHED = "detached"
    #: Reported by a registering worker, granted by another leadership, no holder here;
    #: freed on release (one reported with its detail can be reattached by resume key).
    ORPHAN = "orphan"


class Signal:
    """A flag set once that coroutines wait for, like asyncio.Event; but a wait for the
    first of several (`first_set`) costs one future, not a task each. Every held lease
    waits for its loss, its move or the scheduler's ending for as long as its session
    lasts: with a task per event, a large fleet's heap (and the pause of each full garbage
    collection, which walks all of it) grew by three tasks per session."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Set it and wake every waiter (no-op when set)."""
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        await first_set(self)


async def first_set(*signals: Signal) -> None:
    """Return once any of `signals` is set."""
    if any(signal._set for signal in signals):
        return
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for signal in signals:
        if signal._waiters is None:
            signal._waiters = set()
        signal._waiters.add(waiter)
    try:
        await waiter
    finally:
        for signal in signals:
            if signal._waiters is not None:
                signal._waiters.discard(waiter)


@dataclass(slots=True)
class Lease:
    """One granted slot."""

    worker_id: str
    slot: int
    mode: Mode | None
    session_id: str = ""
    ticket_id: str = ""
    lease_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: LeaseState = LeaseState.ACTIVE
    #: time.monotonic() at grant.
    granted_at: float = field(default_factory=time.monotonic)
    #: The worker sent lease_released while the holder still held the lease.
    worker_released: bool = False
    #: Why the lease was lost with its worker; None while it is not.
    lost_reason: str | None = None
    #: Set once the worker's stream has passed on the grant (or the lease was lost).
    announced: Signal = field(default_factory=Signal)
    #: Set when the lease is lost with its worker.
    lost: Signal = field(default_factory=Signal)
    #: Timer that frees the slot if the worker never answers a revocation.
    release_timer: asyncio.TimerHandle | None = None
    #: Resumable leases: sha256 hex of the resume token, of the owner's identity, and the
    #: grace a detached lease waits for a Reattach.
    resume_key: str = ""
    owner: str = ""
    resume_grace_s: float = 0.0
    #: The hash of its API key, for the key's fabric-wide session limit ("" when none).
    key: str = ""
    #: time.monotonic() when the lease was last detached.
    detached_at: float = 0.0
    #: Set when another holder reattached the lease; each holder waits on the event it
    #: was handed (a reattach hands the new holder a fresh one).
    moved: Signal = field(default_factory=Signal)


@dataclass(frozen=True)
class LeaseGrantNotice:
    """Tell a worker about a new lease on one of its slots."""

    lease: Lease


@dataclass(frozen=True)
class LeaseRevokeNotice:
    """Tell a worker a lease's holder is gone; it answers with lease_released."""

    lease_id: str
    reason: str
    unused_only: bool = False
    """Release it only if no session uses it (a resumable lease's holder is gone)."""


class LeaseTable:
    """Every lease that occupies a slot, by lease id; and indexed by worker, API key and
    resume key, so that a registration, an Acquire with a key limit or a Reattach looks
    at the leases concerned, not at the whole fleet's (a lease's worker, key, resume key,
    mode and grant time are fixed at its creation). Per mode, the grant times in order
    (`grants`): what the queue's wait estimate reads, once per update, and a status its
    longest-running leases from, without a walk. The leases per state are counted: a
    lease in the table changes state through `set_state` only."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._by_worker: dict[str, dict[str, Lease]] = {}
        self._by_key: dict[str, dict[str, Lease]] = {}
        self._by_resume_key: dict[str, dict[str, Lease]] = {}
        self._grants: dict[Mode | None, list[tuple[float, str]]] = {}
        self._states: Counter[LeaseState] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def add(self, lease: Lease) -> None:
        old = self._leases.get(lease.lease_id)
        if old is not None:
            self._unindex(old)
        self._leases[lease.lease_id] = lease
        self._by_worker.setdefault(lease.worker_id, {})[lease.lease_id] = lease
        self._by_key.setdefault(lease.key, {})[lease.lease_id] = lease
        if lease.resume_key:
            self._by_resume_key.setdefault(lease.resume_key, {})[lease.lease_id] = lease
        # Grants come in time order: the append at the end is the usual case.
        bisect.insort(self._grants.setdefault(lease.mode, []), (lease.granted_at, lease.lease_id))
        self._states[lease.state] += 1

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: str) -> Lease | None:
        """Forget a lease, cancelling its release timer."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        self._unindex(lease)
        if lease.release_timer is not None:
            lease.release_timer.cancel()
            lease.release_timer = None
        return lease

    def by_resume_key(self, resume_key: str) -> Lease | None:
        """The resumable lease issued with this resume key, if any."""
        if not resume_key:
            return None
        return next(iter(self._by_resume_key.get(resume_key, {}).values()), None)

    def _unindex(self, lease: Lease) -> None:
        for index, name in (
            (self._by_worker, lease.worker_id),
            (self._by_key, lease.key),
            (self._by_resume_key, lease.resume_key),
        ):
            leases = index.get(name)
            if leases is not None:
                leases.pop(lease.lease_id, None)
                if not leases:
                    del index[name]
        self._states[lease.state] -= 1
        grants = self._grants.get(lease.mode)
        if grants:
            entry = (lease.granted_at, lease.lease_id)
            at = bisect.bisect_left(grants, entry)
            if at < len(grants) and grants[at] == entry:
                del grants[at]

    def grants(self, mode: Mode | None) -> list[tuple[float, str]]:
        """(time.monotonic() at grant, lease id) of every lease of `mode` that occupies a
        slot, oldest first: the table's own list, to read, not to change."""
        return self._grants.get(mode, [])

    def set_state(self, lease: Lease, state: LeaseState) -> None:
        """Move `lease` to `state`, counted (a lease not in the table: just set)."""
        if self._leases.get(lease.lease_id) is lease:
            self._states[lease.state] -= 1
            self._states[state] += 1
        lease.state = state

    def on_worker(self, worker_id: str) -> list[Lease]:
        """Every lease on the worker registered as `worker_id`."""
        return list(self._by_worker.get(worker_id, {}).values())

    def active(self, limit: int | None = None) -> list[Lease]:
        """The leases being served, oldest first; the `limit` oldest (None: all), found by
        walking the grants in order, not the whole table."""
        out: list[Lease] = []
        if limit is not None and limit <= 0:
            return out
        for _, lease_id in heapq.merge(*self._grants.values()):
            lease = self._leases[lease_id]
            if lease.state is LeaseState.ACTIVE:
                out.append(lease)
                if len(out) == limit:
                    break
        return out

    def held_by(self, key: str) -> int:
        """Leases of the sessions of this API key: active, detached and resumable, or
        running without a holder here (rebuilt from their worker's hello)."""
        held = (LeaseState.ACTIVE, LeaseState.DETACHED, LeaseState.ORPHAN)
        return sum(1 for lease in self._by_key.get(key, {}).values() if lease.state in held)

    def count(self, state: LeaseState) -> int:
        """How many leases are in `state` (counted as they change, not walked)."""
        return self._states[state]
