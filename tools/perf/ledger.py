"""The per-unit ledger of `omnifabric bench`: what one level of one path measured (Level),
the figures as they arrive (Samples), one session's units by seq (UnitLedger), and their
percentiles."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omnifabric.common.stats import percentile

PATHS = (
    "fabric",
    "grpc-realtime",
    "ws-echo",
    "grpc-echo",
    "grpc-thread",
    "grpc-sync",
    "grpc-direct",
)
THROUGH_EDGE = ("fabric", "grpc-realtime")
"""The paths whose units cross the edge: its CPU per unit is measured on them."""


def us_per_unit(cpu_s: float, units: int) -> float:
    """CPU seconds spent on `units` units, in microseconds a unit (0.1 us steps)."""
    return round(cpu_s / units * 1e6, 1)


@dataclass
class Level:
    """N sessions x S seconds over one path."""

    path: str
    sessions: int
    seconds: int
    units_sent: int = 0
    answered: int = 0
    lost: int = 0
    dropped: int = 0
    lost_sessions: int = 0
    errors: list[str] = field(default_factory=list)
    overhead_ms: dict[str, float] = field(default_factory=dict)
    overhead_streaming_ms: dict[str, float] = field(default_factory=dict)
    """Units sent while every session streams (session opens and closes left out)."""
    rtt_ms: dict[str, float] = field(default_factory=dict)
    engine_ms: dict[str, float] = field(default_factory=dict)
    queue_wait_ms: dict[str, float] = field(default_factory=dict)
    in_worker_ms: dict[str, float] = field(default_factory=dict)
    """The part of the overhead spent inside the worker (its wall clock minus compute)."""
    client_loop_lag_ms: dict[str, float] = field(default_factory=dict)
    """How late the measuring client's event loop woke up (its own share of the overhead)."""
    processes: dict[str, dict[str, float]] = field(default_factory=dict)
    machine_cores: float = 0.0
    """Cores busy on the whole machine during the level (ours, others' and steal)."""
    steal_cores: float = 0.0
    noisy_attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier attempts of this level set aside for steal above --max-steal."""
    wall_s: float = 0.0
    edge_cpu_us_per_unit: float | None = None
    """Edge CPU over the whole level (session opens and closes included) per answered unit."""
    edge_cpu_us_per_unit_steady: float | None = None
    """The same while every session streams (after the last open, before the first close)."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.lost_sessions == 0 and self.answered > 0


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "p50": round(percentile(values, 50), 3),
        "p95": round(percentile(values, 95), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }


@dataclass
class Samples:
    """Per-unit figures as they arrive (the progress lines read them)."""

    overhead: list[float] = field(default_factory=list)
    rtt: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)
    queue_wait: list[float] = field(default_factory=list)
    in_worker: list[float] = field(default_factory=list)
    """Worker receive -> result send minus the engine's compute (paths that report it)."""
    sent_at: list[float] = field(default_factory=list)
    """When each answered unit was sent (monotonic), parallel to `overhead`."""
    sent: int = 0
    dropped: int = 0
    lost: int = 0
    lost_sessions: int = 0
    errors: list[str] = field(default_factory=list)

    def answer(
        self, sent_at: float, rtt_ms: float, engine_ms: float, worker_wall_ms: float | None = None
    ) -> None:
        self.sent_at.append(sent_at)
        self.rtt.append(rtt_ms)
        self.engine.append(engine_ms)
        self.overhead.append(rtt_ms - engine_ms)
        if worker_wall_ms is not None:
            self.in_worker.append(worker_wall_ms - engine_ms)

    def fill(self, level: Level) -> Level:
        level.units_sent = self.sent
        level.answered = len(self.overhead)
        level.lost, level.dropped, level.lost_sessions = self.lost, self.dropped, self.lost_sessions
        level.errors = sorted(set(self.errors))[:10]
        level.overhead_ms = stats(self.overhead)
        level.rtt_ms = stats(self.rtt)
        level.engine_ms = stats(self.engine)
        level.queue_wait_ms = stats(self.queue_wait)
        level.in_worker_ms = stats(self.in_worker)
        return level


class UnitLedger:
    """One session's units by seq: when each was sent, which got a result, which the
    worker reported dropped. Both result-bearing paths (fabric, grpc-direct) keep one."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.sent: dict[int, float] = {}
        self.answered: set[int] = set()
        self.dropped: set[int] = set()

    def send(self, seq: int) -> None:
        self.sent[seq] = time.monotonic()
        self.samples.sent += 1

    def result(
        self,
        seq: int,
        dropped_seqs: Iterable[int],
        now: float,
        engine_ms: float,
        worker_wall_ms: float | None,
    ) -> None:
        """A unit's result: its first one counts; the drops it reports are noted first."""
        for gone in dropped_seqs:
            if gone in self.sent and gone not in self.answered:
                self.dropped.add(gone)
        if seq in self.sent and seq not in self.answered and seq not in self.dropped:
            self.answered.add(seq)
            sent_at = self.sent[seq]
            self.samples.answer(sent_at, (now - sent_at) * 1000.0, engine_ms, worker_wall_ms)

    def settled(self) -> bool:
        """Every unit sent has a result or a reported drop."""
        return len(self.answered) + len(self.dropped) >= len(self.sent)

    def tally(self, closed_cleanly: bool) -> None:
        """Add this session's drops, lost units and (unless `closed_cleanly`) itself as lost."""
        s = self.samples
        s.dropped += len(self.dropped)
        s.lost += len(self.sent) - len(self.answered) - len(self.dropped)
        if not closed_cleanly:
            s.lost_sessions += 1


def within(level: Level, max_p99_ms: float) -> bool:
    """Nothing lost, and the overhead's p99 within `max_p99_ms` (the max search's test)."""
    return level.ok and level.overhead_ms["p99"] <= max_p99_ms
