"""A worker's real-time headroom: what its engine spends on a session of each mode, measured
on recent units, and whether the worker keeps up.

Every served unit brings its engine time (its prefill and generate, then its deferred
finalize) against its length, and its wall clock (arrival to result). A session of a mode
costs the engine seconds per second of input of its recent units on average, and no less
than the average of its recent speaking units: a reply's compute per second of its speech
(its units cost many times a listening one's, most of it in the first one or two, and the
sessions admitted must keep real time while they speak). Until
MIN_MEASURED units of a mode were served, no less than the engine's own estimate from
warm-up either. "Recent" is the last `window_s` seconds (at least the last MIN_RECENT
units), so a worker slowed for a while, by its host or its load, reads as dearer, and as
cheap again soon after. A unit is late when its result left later than one unit length after
it arrived (a second at least: ``is_late``); a late unit within the window means the worker
is behind. The scheduler reads
these figures (WorkerReport's Headroom) and decides.

A session's dearest units matter too: the unit that ends a user's turn on the reference
engine (the turn's hearing, the reply's prefill and first piece) costs ~1 engine second where
the reply's mean is ~0.4, and two such units at once on a host whose engine has one thread
are both late, whatever the means say. So each mode also has a peak: the PEAK_QUANTILE-th
percentile of its recent units' costs, and no less than that of its recent speaking units
(the last MIN_RECENT of them when the window holds fewer: a reply's dear units are not
forgotten while the session listens), nor than the estimate until MIN_MEASURED; and what
one more session at its peak would add (the engine's `added` of the peak: the whole peak on
a time-sliced engine; a batched step serves every row at once, so its rows' dear units do
not wait for each other and the worker says 0 there: `added_peak`).
The scheduler admits one more session only where the dearest peak held and the new one's
added peak fit the engine's threads together (common.realtime.peaks_fit).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from omnifabric.common.stats import percentile

#: Units per mode kept at most.
RECENT_UNITS = 200
#: Units a quantile is taken over at least (older than the window if need be).
MIN_RECENT = 5
#: Units of a mode measured before the engine's estimate gives way to the measurements.
MIN_MEASURED = 20
#: The window, seconds, unless configured (worker config headroom_window_s).
WINDOW_S = 15.0
#: A chat turn holds one engine thread while it generates.
CHAT_COST = 1.0
#: The percentile of recent units' costs taken as a mode's peak (over a window of a few
#: replies this is their dearest unit but for one).
PEAK_QUANTILE = 95.0


#: The shortest deadline of a unit, s. A unit shorter than a second (one the edge cut where
#: the user's speech stopped, a half-duplex call's) may wait in the worker for the finalize
#: of the unit before it, which began a reply there (~0.8 s on a 2-core host): real time
#: allows that, as the unit after it comes later; the same wait for a whole unit does not.
MIN_DEADLINE_S = 1.0


def is_late(wall_s: float, length_s: float) -> bool:
    """Whether a unit of ``length_s`` seconds answered ``wall_s`` after it arrived is late:
    the one rule, for the session's count and the worker's headroom."""
    return wall_s > max(length_s, MIN_DEADLINE_S)


@dataclass(frozen=True)
class ModeCost:
    """What one session of a mode costs the engine (engine seconds per second of input),
    and what one more would add."""

    session_cost: float
    added_cost: float
    peak_cost: float = 0.0
    """A session's dearest units (PEAK_QUANTILE of its recent units' costs)."""
    added_peak: float = 0.0
    """What one more session's dearest unit adds, at once with the others'."""


@dataclass(frozen=True)
class HeadroomFigures:
    """What the worker reports (scheduler_service.proto Headroom)."""

    engine_threads: int
    costs: dict[str, ModeCost]
    late_recent: int
    late_total: int
    late_window_s: float
    unit_p95_ratio: float
    late_by_lease: dict[str, int]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Headroom:
    """Unit costs and lateness of one worker, as its sessions serve units."""

    def __init__(
        self,
        engine_threads: int,
        estimates: dict[str, float],
        added: Callable[[float], float],
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        added_peak: Callable[[float], float] | None = None,
    ) -> None:
        """`estimates`: engine seconds a session of each mode served costs per second of
        input before any unit was measured; `added`: what one more session adds, given what
        one costs (the engine's: time-sliced engines add it whole)."""
        self.engine_threads = max(1, engine_threads)
        self.estimates = dict(estimates)
        self.window_s = window_s
        self._added = added
        self._added_peak = added if added_peak is None else added_peak
        self._clock = clock
        # (when, engine seconds per second of input) of recent units, per mode.
        self._costs = {mode: deque[tuple[float, float]](maxlen=RECENT_UNITS) for mode in estimates}
        self._speaking = {
            mode: deque[tuple[float, float]](maxlen=RECENT_UNITS) for mode in estimates
        }
        self._measured = dict.fromkeys(estimates, 0)
        self._ratios = deque[tuple[float, float]](maxlen=RECENT_UNITS)
        self._late_at = deque[float]()
        self.late_total = 0
        self._late_by_lease: dict[str, int] = {}

    def unit(
        self,
        mode: str,
        lease_id: str,
        length_s: float,
        engine_s: float,
        wall_s: float,
        speaking: bool = False,
    ) -> bool:
        """One served unit of `length_s` seconds of input: the engine's time on it and its
        wall clock. Returns whether it was late."""
        if length_s <= 0:
            return False
        now = self._clock()
        if mode in self._costs:
            self._costs[mode].append((now, engine_s / length_s))
            if speaking:
                self._speaking[mode].append((now, engine_s / length_s))
            self._measured[mode] += 1
        self._ratios.append((now, wall_s / length_s))
        late = is_late(wall_s, length_s)
        if late:
            self.late_total += 1
            self._late_at.append(now)
            self._late_by_lease[lease_id] = self._late_by_lease.get(lease_id, 0) + 1
        return late

    def chat_turn(self, engine_s: float, wall_s: float) -> None:
        """One chat turn: the share of an engine thread it held while it ran."""
        if "chat" in self._costs and wall_s > 0:
            self._costs["chat"].append((self._clock(), min(1.0, engine_s / wall_s)))
            self._measured["chat"] += 1

    def session_ended(self, lease_id: str) -> None:
        """The session of `lease_id` is gone: its late count leaves the report."""
        self._late_by_lease.pop(lease_id, None)

    def _recent(self, entries: Iterable[tuple[float, float]]) -> list[float]:
        """The values of the window, or of the last MIN_RECENT entries if it holds fewer."""
        kept = list(entries)
        horizon = self._clock() - self.window_s
        values = [value for when, value in kept if when >= horizon]
        return values if len(values) >= MIN_RECENT else [value for _, value in kept[-MIN_RECENT:]]

    def late_recent(self) -> int:
        """Late units within the window."""
        horizon = self._clock() - self.window_s
        while self._late_at and self._late_at[0] < horizon:
            self._late_at.popleft()
        return len(self._late_at)

    def session_cost(self, mode: str) -> float:
        """Engine seconds one session of `mode` costs per second of input (see the module)."""
        if mode not in self._costs:
            return 0.0
        cost = max(
            _mean(self._recent(self._costs[mode])), _mean(self._recent(self._speaking[mode]))
        )
        if self._measured[mode] < MIN_MEASURED:
            cost = max(cost, self.estimates[mode])
        return cost

    def peak_cost(self, mode: str) -> float:
        """Engine seconds per second of input of a session's dearest units of `mode` (see
        the module)."""
        if mode not in self._costs:
            return 0.0
        peak = max(
            percentile(self._recent(self._costs[mode]), PEAK_QUANTILE, empty=0.0),
            percentile(self._recent(self._speaking[mode]), PEAK_QUANTILE, empty=0.0),
        )
        if self._measured[mode] < MIN_MEASURED:
            peak = max(peak, self.estimates[mode])
        return peak

    def figures(self) -> HeadroomFigures:
        costs = {}
        for mode in self._costs:
            cost, peak = self.session_cost(mode), self.peak_cost(mode)
            costs[mode] = ModeCost(cost, self._added(cost), peak, self._added_peak(peak))
        return HeadroomFigures(
            engine_threads=self.engine_threads,
            costs=costs,
            late_recent=self.late_recent(),
            late_total=self.late_total,
            late_window_s=self.window_s,
            unit_p95_ratio=percentile(self._recent(self._ratios), 95.0, empty=0.0),
            late_by_lease=dict(self._late_by_lease),
        )
