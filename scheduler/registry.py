"""Worker registry: who is registered, what each serves, and which slots are taken."""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnifabric.common import realtime

# What a worker's engine accepts, as its hello declares it (the worker owns the values; the
# scheduler only keeps them and hands them out with leases and status): common's type.
from omnifabric.common.modes import Mode as Mode
from omnifabric.common.session_types import EngineLimits as EngineLimits


class Health(enum.Enum):
    """Worker health as last reported; only SERVING workers get new leases."""

    UNKNOWN = "unknown"
    SERVING = "serving"
    NOT_SERVING = "not_serving"


@dataclass(frozen=True)
class MemoryFigures:
    """A worker's memory report: device ("cuda" or "cpu") and bytes held."""

    device: str
    allocated_bytes: int
    baseline_bytes: int
    before_cleanup_bytes: int
    cleanups: int
    kv_slots: int = 0
    """The engine's KV slots allocated at start (batched engines; 0: none), the tokens and
    bytes of one, and how many more the device's free memory would hold."""
    kv_slot_tokens: int = 0
    kv_slot_bytes: int = 0
    kv_slots_more: int = 0


@dataclass(frozen=True)
class Headroom:
    """What a worker serves in real time, as it reports it (worker.headroom measures it):
    engine threads, and per mode what one session costs and what one more adds (engine
    seconds per second of input); late units lately, and per lease."""

    engine_threads: int
    session_cost: dict[Mode, float]
    added_cost: dict[Mode, float]
    late_recent: int = 0
    late_total: int = 0
    late_window_s: float = 0.0
    unit_p95_ratio: float = 0.0
    late_by_lease: dict[str, int] = field(default_factory=dict)
    peak_cost: dict[Mode, float] = field(default_factory=dict)
    """Per mode, what a session's dearest units cost (an older worker reports none: 0)."""
    added_peak: dict[Mode, float] = field(default_factory=dict)
    """Per mode, what one more session's dearest unit adds at once with the others'."""

    def held_peak(self, counts: Mapping[Mode | None, int]) -> float:
        """The dearest peak among the modes of the sessions held, `counts` of each (a lease
        of unknown mode: the dearest mode's)."""
        dearest = max(self.peak_cost.values(), default=0.0)
        return max(
            (
                dearest if m is None else self.peak_cost.get(m, dearest)
                for m, n in counts.items()
                if n
            ),
            default=0.0,
        )

    def peaks_fit(self, mode: Mode, counts: Mapping[Mode | None, int]) -> bool:
        """Whether one more session of `mode` and the sessions held keep real time when
        their dearest units come at once (common.realtime.peaks_fit)."""
        added = self.added_peak.get(mode, self.peak_cost.get(mode, 0.0))
        return realtime.peaks_fit(self.engine_threads, self.held_peak(counts), added)

    def committed(self, counts: Mapping[Mode | None, int]) -> float:
        """What sessions cost, `counts` of them of each mode (a lease of unknown mode, a
        worker's own from before a scheduler restart: the dearest mode)."""
        dearest = max(self.session_cost.values(), default=0.0)
        return sum(
            n * (dearest if m is None else self.session_cost.get(m, dearest))
            for m, n in counts.items()
        )

    def sessions_within(self, mode: Mode, margin: float) -> int:
        """How many sessions of `mode` alone the worker holds in real time (one where two
        of its dearest units at once would not keep it)."""
        if not self.peaks_fit(mode, {mode: 1}):
            return 1
        return realtime.sessions_within(
            self.engine_threads,
            self.session_cost.get(mode, 0.0),
            self.added_cost.get(mode, 0.0),
            margin,
        )


@dataclass
class Worker:
    """One live registration: capacity, modes, health and the leases on its slots."""

    worker_id: str
    address: str
    slots: int
    modes: frozenset[Mode]
    engine: str
    health: Health
    detail: str = ""
    #: When the worker last said anything, on the scheduler's attended clock
    #: (scheduler.liveness: the rule that tells it hung).
    last_seen: float = 0.0
    #: Set once its silence ended its registration: it gets no lease while that ends.
    hung_up: bool = False
    #: The worker's latest memory report, or None before its first.
    memory: MemoryFigures | None = None
    #: What the worker's engine accepts, from its hello; None when it sent none.
    limits: EngineLimits | None = None
    #: The worker's latest headroom; None before it reported one (slots alone decide).
    headroom: Headroom | None = None
    #: Registration order; ties between equally free workers go to the older one.
    seq: int = 0
    #: lease id -> slot number, for every lease that occupies a slot.
    lease_slots: dict[str, int] = field(default_factory=dict)
    #: lease id -> the mode it was granted for (None: an orphan, mode unknown).
    lease_modes: dict[str, Mode | None] = field(default_factory=dict)
    #: How many of its leases are of each mode (kept with lease_modes, for the status).
    mode_counts: Counter[Mode | None] = field(default_factory=Counter)
    #: Messages for the worker's Register stream (lease notices; None ends the stream).
    outbox: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    #: Told when its slots are taken or freed (its registry's admission index).
    on_change: Callable[[Worker], None] | None = field(default=None, repr=False, compare=False)

    @property
    def slots_free(self) -> int:
        """Slots not occupied by any lease (active, returning or orphan)."""
        return max(0, self.slots - len(self.lease_slots))

    def can_take(self, mode: Mode, margin: float = 0.0) -> bool:
        """True when this worker may receive a new lease for `mode` now: SERVING, a free
        slot, and with a margin (> 0) and a headroom report, keeping real time with one
        more session (see admits)."""
        return (
            self.health is Health.SERVING
            and not self.hung_up
            and mode in self.modes
            and self.slots_free > 0
            and self.admits(mode, margin)
        )

    def admits(self, mode: Mode, margin: float) -> bool:
        """Whether one more session of `mode` keeps real time here: a worker with no
        session always takes one; one with late units lately takes none (it is behind);
        else the sessions leased here and the new one must stay within `margin` of the
        engine's threads (common.realtime), and the dearest unit held and the new
        session's must fit the threads at once (``Headroom.peaks_fit``). Always True
        without a margin or a report."""
        room = self.headroom
        if margin <= 0 or room is None or not self.lease_slots:
            return True
        if room.late_recent:
            return False
        added = room.added_cost.get(mode, room.session_cost.get(mode, 0.0))
        committed = room.committed(self.mode_counts)
        return realtime.fits(room.engine_threads, committed, added, margin) and room.peaks_fit(
            mode, self.mode_counts
        )

    def take_slot(
        self, lease_id: str, preferred: int | None = None, mode: Mode | None = None
    ) -> int:
        """Occupy the lowest free slot (or `preferred` if free) for `lease_id`, a lease for
        `mode` (None: unknown)."""
        used = set(self.lease_slots.values())
        if preferred is not None and preferred not in used and 0 <= preferred < self.slots:
            slot = preferred
        else:
            # Past `slots` only when a reconnecting worker reports more leases than slots.
            slot = next(n for n in itertools.count() if n not in used)
        self._uncount(lease_id)
        self.lease_slots[lease_id] = slot
        self.lease_modes[lease_id] = mode
        self.mode_counts[mode] += 1
        if self.on_change is not None:
            self.on_change(self)
        return slot

    def free_slot(self, lease_id: str) -> None:
        """Give back the slot `lease_id` occupied, if any."""
        self._uncount(lease_id)
        self.lease_slots.pop(lease_id, None)
        self.lease_modes.pop(lease_id, None)
        if self.on_change is not None:
            self.on_change(self)

    def _uncount(self, lease_id: str) -> None:
        if lease_id in self.lease_modes:
            mode = self.lease_modes[lease_id]
            self.mode_counts[mode] -= 1
            if not self.mode_counts[mode]:
                del self.mode_counts[mode]


class _FreeIndex:
    """The workers that may take a session of one mode, most free slots first and oldest on
    ties (Registry.pick's order) in a heap, so that admission looks at the best candidate
    instead of every worker.

    Entries are pushed whenever a worker's free slots or health change (Registry.touch) and
    never updated: an entry whose worker changed since is stale and dropped when it comes
    to the top; the heap is rebuilt when stale entries outnumber the workers."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, int, Worker]] = []
        """(-free slots, registration order, push order, worker)."""

    def push(self, worker: Worker, order: int) -> None:
        heapq.heappush(self.heap, (-worker.slots_free, worker.seq, order, worker))

    def best(
        self, fits: Callable[[Worker], bool], live: Callable[[Worker, int], bool]
    ) -> Worker | None:
        """The first worker in order that `fits` (entries not `live` are dropped; the ones
        that do not fit stay for later)."""
        heap = self.heap
        passed = []
        found = None
        while heap:
            entry = heap[0]
            if not live(entry[3], -entry[0]):
                heapq.heappop(heap)
            elif fits(entry[3]):
                found = entry[3]
                break
            else:
                passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found


class Registry:
    """Live workers by id, in registration order."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._seq = itertools.count()
        self._pushes = itertools.count()
        self._free: dict[Mode, _FreeIndex] = {mode: _FreeIndex() for mode in Mode}
        """Per mode, the workers that may take one more session of it (see `pick`)."""
        self._modes: Counter[Mode] = Counter()
        """Registered workers per mode they serve, in any health."""
        self.version = 0
        """Counts every change that can change what the workers hold (capacity's cache)."""
        self._capacity: dict[tuple[Mode, float], tuple[int, int]] = {}

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def add(self, worker: Worker) -> Worker | None:
        """Register `worker`; returns the registration it replaces, if any."""
        old = self._workers.pop(worker.worker_id, None)
        if old is not None:
            self._forget(old)
        worker.seq = next(self._seq)
        self._workers[worker.worker_id] = worker
        self._modes.update(worker.modes)
        worker.on_change = self.touch
        self.touch(worker)
        return old

    def remove(self, worker: Worker) -> bool:
        """Drop `worker` if it is still the live registration for its id."""
        if self._workers.get(worker.worker_id) is worker:
            del self._workers[worker.worker_id]
            self._forget(worker)
            return True
        return False

    def _forget(self, worker: Worker) -> None:
        """`worker` is no longer registered: its entries in the index go stale."""
        self._modes.subtract(worker.modes)
        worker.on_change = None
        self.version += 1

    def touch(self, worker: Worker, reindex: bool = True) -> None:
        """A worker's slots, health or headroom changed: forget cached capacities, and
        (`reindex`: its free slots or health changed) index it anew where it may take one
        more session."""
        self.version += 1
        if not reindex or not self._leasable(worker, worker.slots_free):
            return
        for mode in worker.modes:
            self._free[mode].push(worker, next(self._pushes))
        if sum(len(index.heap) for index in self._free.values()) > 4 * len(self._workers) + 64:
            self._reindex()

    def _reindex(self) -> None:
        """Rebuild the index from the live workers (its stale entries had piled up)."""
        for index in self._free.values():
            index.heap = []
        for worker in self._workers.values():
            if self._leasable(worker, worker.slots_free):
                for mode in worker.modes:
                    self._free[mode].push(worker, next(self._pushes))

    def _leasable(self, worker: Worker, free: int) -> bool:
        """Whether an index entry of `worker` with `free` slots still stands: the worker is
        registered, SERVING, not hung up, and has `free` (> 0) slots free."""
        return (
            free > 0
            and worker.slots_free == free
            and worker.health is Health.SERVING
            and not worker.hung_up
            and self._workers.get(worker.worker_id) is worker
        )

    def is_current(self, worker: Worker) -> bool:
        """True while `worker` has not been removed or replaced."""
        return self._workers.get(worker.worker_id) is worker

    def serves(self, mode: Mode) -> bool:
        """True when any registered worker, in any health, serves `mode`."""
        return self._modes[mode] > 0

    def pick(self, mode: Mode, margin: float = 0.0) -> Worker | None:
        """The SERVING worker for `mode` that can take it (Worker.can_take) with the most
        free slots (oldest on ties). From the index: the candidates in that order until one
        keeps real time with one more session (Worker.admits), not a scan of the fleet."""
        return self._free[mode].best(lambda w: w.can_take(mode, margin), self._leasable)

    def serving_capacity(self, mode: Mode, margin: float = 0.0) -> int:
        """Sessions of `mode` the SERVING workers hold at once: each its slots, or fewer
        where its headroom says fewer keep real time (with a margin); a worker that is
        behind (late units lately) takes none until it recovers, so it counts for what it
        holds now (at least 1). Counted once per change of the fleet (`version`)."""
        cached = self._capacity.get((mode, margin))
        if cached is not None and cached[0] == self.version:
            return cached[1]
        total = 0
        for w in self._workers.values():
            if w.health is not Health.SERVING or mode not in w.modes:
                continue
            held = w.slots
            if margin > 0 and w.headroom is not None:
                held = min(held, w.headroom.sessions_within(mode, margin))
                if w.headroom.late_recent:
                    held = min(held, max(1, len(w.lease_slots)))
            total += held
        self._capacity[(mode, margin)] = (self.version, total)
        return total
