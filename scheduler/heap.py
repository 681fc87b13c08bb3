"""Short garbage collections for a scheduler holding many sessions (issue 55).

CPython's full (generation 2) collection walks every object the process tracks, and the
scheduler's event loop waits meanwhile. A held session is ~84 such objects (mostly gRPC's
and asyncio's per-stream state), so the walk grows with the fleet: measured on a loaded
2-core host, ~0.2-0.4 s at 5,760 sessions, ~1.9 s at 17,280, ~5 s at 57,600; whichever
Acquires met one waited that long.

Most of what a full collection walks is long-lived (sessions last minutes) and not
garbage. So every `PERIOD_S` the keeper collects what is younger than its last pass, all
generations (short: only objects made since are walked; frozen ones are not) and moves
the survivors out of the collected generations (`gc.freeze`): full collections from then
on walk only what came since. Objects are still freed by reference counting when frozen;
what the collector alone can free is a reference cycle, and one through an object frozen
while it lived stays until the frozen heap is collected again: so every `THAW_EVERY_S` it
is thawed and collected in full once (one pause of the old length an hour; measured at
17,280 sessions, such a collection found 35-40 unreachable objects: the leftovers are
few). The keeper never asks how many objects are frozen: `gc.get_freeze_count` walks them
all (~0.1 s at a million, on the loop).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Seconds between the keeper's passes (each collects what is younger than the last one).
PERIOD_S = 1.0
#: Seconds between full collections of the frozen heap (for the cycles left in it).
THAW_EVERY_S = 3600.0


@dataclass
class HeapKeeper:
    """The scheduler process's collections (see the module): `keep` runs them on its loop.
    The gc functions are parameters for tests; a process has one keeper."""

    period_s: float = PERIOD_S
    thaw_every_s: float = THAW_EVERY_S
    collect: Callable[[int], int] = gc.collect
    freeze: Callable[[], None] = gc.freeze
    unfreeze: Callable[[], None] = gc.unfreeze
    clock: Callable[[], float] = time.monotonic
    passes: int = 0
    thaws: int = 0
    _thawed_at: float = 0.0
    """clock() at the last full collection of everything."""

    def settle(self) -> None:
        """Everything alive now is long-lived (the started server, its modules): collect
        in full and freeze it."""
        self.collect(2)
        self.freeze()
        self._thawed_at = self.clock()

    def step(self) -> float:
        """One pass: the young generations' full collection and freeze, or, every
        `thaw_every_s`, a full collection of everything first. Returns the seconds it
        took."""
        started = time.perf_counter()
        if self.clock() - self._thawed_at >= self.thaw_every_s:
            self.unfreeze()
            found = self.collect(2)
            self._thawed_at = self.clock()
            self.thaws += 1
            log.info(
                "heap: everything collected in full in %.2f s (%d unreachable)",
                time.perf_counter() - started,
                found,
            )
        else:
            self.collect(2)
        self.freeze()
        self.passes += 1
        return time.perf_counter() - started

    async def keep(self) -> None:
        """A `step` every `period_s` (after `settle`), until cancelled (then nothing stays
        frozen: a process that goes on collects as before)."""
        try:
            while True:
                await asyncio.sleep(self.period_s)
                self.step()
        finally:
            self.unfreeze()
