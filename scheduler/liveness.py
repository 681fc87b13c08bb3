"""Whether a worker is hung, judged net of the scheduler's own stalls (issue 55).

A worker reports every second on its Register stream; one silent for the worker timeout is
taken for hung and its registration ends (RELIABILITY.md F2). But the scheduler only hears
a report when its event loop runs: a scheduler that was itself stalled (paused with SIGSTOP,
starved of CPU, in a long collection, busy with a burst of work) heard nothing meanwhile,
and that silence is its own, not the worker's.

So the scheduler keeps its own pulse (`LoopClock`): a probe that wakes every `TICK_S` and
notes how late it woke. Lateness past the loop's ordinary jitter is time the scheduler was
not attending; `attended()` is the monotonic clock with every such stall taken out (the one
in progress too, so a reader right after a resume already sees it). A worker's silence is
measured on that clock (`Liveness`): the rule and its one owner. A worker declared lost
keeps its leases for `LOST_GRACE_S` more of attended time (`AttendedTimer`), in which it
can register again with its sessions and keep them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

#: How often the probe wakes, seconds (ten wake-ups a second: nothing to the loop).
TICK_S = 0.1
#: Lateness up to this is the loop's ordinary jitter on a loaded host, not a stall, seconds.
JITTER_S = 0.02
#: Seconds of attended time the leases of a lost worker wait for it to register again with
#: them (its stream broke but it lives: it is back within its first retry, ~0.2 s).
LOST_GRACE_S = 1.0
#: The probe's largest lateness is reported over windows of this many seconds.
LAG_WINDOW_S = 10.0


class LoopClock:
    """The scheduler's pulse: how late its event loop runs, and time net of its stalls.

    `tick` is called by the probe (`Scheduler.watch`) as it wakes; everything else may be
    read at any moment from the loop (and the figures from the metrics thread).
    """

    def __init__(
        self,
        tick_s: float = TICK_S,
        jitter_s: float = JITTER_S,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tick_s = tick_s
        self.jitter_s = jitter_s
        self._now = now
        self.stalled_s = 0.0
        """Seconds not attended, summed over the stalls that ended (see `stalled_total`)."""
        self.lag_s = 0.0
        """The probe's last lateness, seconds."""
        self._due: float | None = None
        """When the probe should wake next; None before it first ticks (no stall is open)."""
        self._window_start = now()
        self._window_max = 0.0
        self._last_window_max = 0.0

    def start(self) -> None:
        """The probe sleeps from now: a stall is counted from `tick_s` after it."""
        self._due = self._now() + self.tick_s

    def stop(self) -> None:
        """The probe stopped: nothing more counts as a stall."""
        self._due = None

    def tick(self) -> float:
        """The probe woke: fold its lateness in (past the jitter: a stall) and expect it
        `tick_s` from now. Returns the lateness, seconds."""
        now = self._now()
        lateness = 0.0 if self._due is None else max(0.0, now - self._due)
        self.stalled_s += max(0.0, lateness - self.jitter_s)
        self.lag_s = lateness
        if now - self._window_start >= LAG_WINDOW_S:
            self._last_window_max, self._window_max = self._window_max, 0.0
            self._window_start = now
        self._window_max = max(self._window_max, lateness)
        self._due = now + self.tick_s
        return lateness

    def open_stall_s(self, now: float) -> float:
        """The stall in progress at `now`: how far the probe is overdue, past the jitter."""
        if self._due is None:
            return 0.0
        return max(0.0, now - self._due - self.jitter_s)

    def stalled_total(self) -> float:
        """Seconds the scheduler did not attend since the probe started, the open stall in."""
        return self.stalled_s + self.open_stall_s(self._now())

    def attended(self) -> float:
        """The monotonic clock less every stall so far (the open one too), seconds."""
        now = self._now()
        return now - self.stalled_s - self.open_stall_s(now)

    def lag_max_s(self) -> float:
        """The probe's largest lateness over the last one or two windows, seconds."""
        return max(self._window_max, self._last_window_max)


class Seen(Protocol):
    """What the rule reads of a worker: when it last said anything, in attended time."""

    last_seen: float


class Liveness:
    """The rule: a worker is hung when it has been silent, in attended time, longer than
    `timeout_s` (OMNI_SCHEDULER_WORKER_TIMEOUT_S)."""

    def __init__(self, timeout_s: float, clock: LoopClock) -> None:
        self.timeout_s = timeout_s
        self.clock = clock

    def seen(self, worker: Seen) -> None:
        """The worker said something now (its hello, a report, a release)."""
        worker.last_seen = self.clock.attended()

    def silence_s(self, worker: Seen) -> float:
        """Seconds the worker has been silent while the scheduler was listening."""
        return self.clock.attended() - worker.last_seen

    def hung(self, worker: Seen) -> bool:
        """Silent past the timeout on the scheduler's attended time."""
        return self.silence_s(worker) > self.timeout_s


class AttendedTimer:
    """Call `callback(*args)` once `delay_s` of attended time has passed: a loop timer that,
    should the scheduler have stalled meanwhile, waits out the time the stall took."""

    def __init__(
        self, clock: LoopClock, delay_s: float, callback: Callable[..., None], *args: Any
    ) -> None:
        self._clock = clock
        self._until = clock.attended() + delay_s
        self._callback = callback
        self._args = args
        self._handle = asyncio.get_running_loop().call_later(delay_s, self._fire)

    def _fire(self) -> None:
        left = self._until - self._clock.attended()
        if left > 0.001:
            self._handle = asyncio.get_running_loop().call_later(left, self._fire)
            return
        self._callback(*self._args)

    def cancel(self) -> None:
        self._handle.cancel()
