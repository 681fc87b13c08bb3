"""Prometheus metrics of one scheduler, in its own CollectorRegistry.

Queue, leases and workers are read from the Scheduler's state at scrape time (a custom
collector, so nothing can drift); only the queue-wait histogram is fed by a hook in the
core (`observe_queue_wait`, at every grant). Served by `common.metrics.serve_http` on
`--metrics-port` (a prometheus_client HTTP server on its own thread). Process figures
(process_resident_memory_bytes, process_open_fds, ...) and the live asyncio tasks
(omni_scheduler_asyncio_tasks) show leaks in long runs.

The core builds these metrics and passes itself in; this module knows it only as a
`SchedulerState` and never imports the core.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import Gauge
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from omnifabric.scheduler.leadership import Leadership
from omnifabric.scheduler.leases import LeaseState, LeaseTable
from omnifabric.scheduler.liveness import LoopClock
from omnifabric.scheduler.queue import WaitQueue
from omnifabric.scheduler.registry import Registry

#: Queue waits, seconds: from immediate grants to the long waits of a full fleet.
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: The event loop's lateness, seconds: from ordinary jitter to a paused process.
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class Counters:
    """Totals since start, for metrics (kept by the core, read at scrape time)."""

    leases_granted: int = 0
    leases_returned: int = 0
    leases_lost: int = 0
    queue_full_rejections: int = 0
    key_limit_rejections: int = 0
    """Acquire requests refused: their API key held its limit of sessions."""
    leases_expired: int = 0
    """Returned leases freed by the release timeout (the worker never confirmed)."""
    leases_reattached: int = 0
    """Resumable leases taken over by a new holder (Reattach)."""
    workers_lost: int = 0
    """Registrations that ended other than by a drain: the stream broke, or it was hung."""
    workers_hung: int = 0
    """Registrations ended by the watchdog: silent past the timeout on attended time."""
    worker_reports: int = 0
    """Reports read from workers' Register streams (each worker sends one a second)."""


class SchedulerState(Protocol):
    """What the metrics read from the scheduler at scrape time: scheduler.core.Scheduler."""

    @property
    def queue(self) -> WaitQueue: ...
    @property
    def leases(self) -> LeaseTable: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def draining(self) -> bool: ...
    @property
    def leadership(self) -> Leadership: ...
    @property
    def clock(self) -> LoopClock: ...


class SchedulerMetrics:
    """The scheduler's instruments; `registry` is what /metrics serves."""

    def __init__(self, scheduler: SchedulerState) -> None:
        self.registry = CollectorRegistry()
        self.queue_wait = Histogram(
            "omni_scheduler_queue_wait_seconds",
            "Time from a session's Acquire to its lease grant (0 when a slot was free), by mode.",
            ["mode"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "omni_scheduler_loop_lag_seconds",
            "How late the scheduler's event-loop probe woke (every 0.1 s): its own lag, "
            "which a worker's silence is judged net of.",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(scheduler))
        ProcessCollector(registry=self.registry)
        tasks = Gauge(
            "omni_scheduler_asyncio_tasks",
            "Live asyncio tasks on the scheduler's event loop, counted at scrape time.",
            registry=self.registry,
        )
        with contextlib.suppress(RuntimeError):  # no loop (unit tests): the gauge stays 0
            loop = asyncio.get_running_loop()
            # Called on the scrape thread: all_tasks(loop) copies the tasks' weak set with
            # retries, which is what CPython does for callers on other threads (bpo-36607).
            tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def observe_queue_wait(self, mode: str, seconds: float) -> None:
        self.queue_wait.labels(mode).observe(max(0.0, seconds))

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what a scrape returns)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges and counters read from the Scheduler when scraped.

    Runs on the HTTP server's thread: it only copies containers (list(), len()) and
    reads attributes, which the GIL keeps consistent enough for monitoring.
    """

    def __init__(self, scheduler: SchedulerState) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        yield from self._state()
        yield from self._counters()
        yield from self._leases()
        yield from self._workers()

    def _state(self) -> Iterator[Any]:
        """The queue, draining, leadership and the last rebuild."""
        s = self._scheduler
        lead = s.leadership
        yield _gauge("omni_scheduler_queue_length", "Sessions waiting in the queue.", len(s.queue))
        yield _gauge(
            "omni_scheduler_draining",
            "1 from SIGTERM on: no new leases or registrations, running sessions go on.",
            1 if s.draining else 0,
        )
        yield _gauge(
            "omni_scheduler_leader",
            "1 while this scheduler leads (always without --ha), 0 while a standby.",
            1 if lead.leads() and not s.draining else 0,
        )
        yield _gauge(
            "omni_scheduler_epoch",
            "Epoch of the newest leadership this scheduler knows of (0 without --ha).",
            lead.epoch,
        )
        yield CounterMetricFamily(
            "omni_scheduler_leaderships",
            "Leaderships this scheduler began since start (--ha; 0 without): each after the "
            "fabric's first is a failover or handover to it.",
            value=lead.terms,
        )
        rebuild = GaugeMetricFamily(
            "omni_scheduler_rebuild_seconds",
            "Its last rebuild: seconds from taking the lead to the last worker registration or "
            "re-sent request within the rebuild window (no sample before it first led).",
        )
        if lead.rebuild_s is not None:
            rebuild.add_metric([], lead.rebuild_s)
        yield rebuild
        yield _gauge(
            "omni_scheduler_loop_lag_max_seconds",
            "The event-loop probe's largest lateness over the last 10-20 s.",
            s.clock.lag_max_s(),
        )
        yield CounterMetricFamily(
            "omni_scheduler_stalled_seconds",
            "Seconds the scheduler's loop did not run when due (lateness past jitter): left "
            "out of every worker's silence.",
            value=s.clock.stalled_total(),
        )

    def _counters(self) -> Iterator[Any]:
        """The queue's bound and the lease and rejection counters."""
        s = self._scheduler
        counters = s.counters
        yield _gauge(
            "omni_scheduler_queue_max", "Queue length beyond which queue_full.", s.queue.queue_max
        )
        for name, help_text, value in (
            ("leases_granted", "Leases granted since start.", counters.leases_granted),
            (
                "leases_returned",
                "Leases whose holder ended its Acquire stream (session over).",
                counters.leases_returned,
            ),
            (
                "leases_lost",
                "Active leases that ended with their worker (lost or re-registered without it).",
                counters.leases_lost,
            ),
            (
                "workers_lost",
                "Worker registrations that ended other than by a drain (stream broken or hung).",
                counters.workers_lost,
            ),
            (
                "workers_hung",
                "Worker registrations ended for silence past the worker timeout (net of the "
                "scheduler's own stalls).",
                counters.workers_hung,
            ),
            (
                "worker_reports",
                "Reports read from the workers (one a second each, and on every change).",
                counters.worker_reports,
            ),
            (
                "leases_reattached",
                "Resumable leases taken over by a new holder (a resumed session).",
                counters.leases_reattached,
            ),
            (
                "leases_expired",
                "Returned leases whose slot was freed by the release timeout because the "
                "worker never confirmed the release.",
                counters.leases_expired,
            ),
            (
                "queue_full_rejections",
                "Acquire requests rejected with queue_full.",
                counters.queue_full_rejections,
            ),
            (
                "key_limit_rejections",
                "Acquire requests rejected because their API key held its limit of sessions "
                "across the fabric.",
                counters.key_limit_rejections,
            ),
        ):
            yield CounterMetricFamily(f"omni_scheduler_{name}", help_text, value=value)

    def _leases(self) -> Iterator[Any]:
        """Leases by state."""
        leases = self._scheduler.leases
        yield _gauge(
            "omni_scheduler_leases_active",
            "Leases whose holder still holds them.",
            leases.count(LeaseState.ACTIVE),
        )
        yield _gauge(
            "omni_scheduler_leases_detached",
            "Resumable sessions whose holder is gone, waiting for a resume.",
            leases.count(LeaseState.DETACHED),
        )
        yield _gauge(
            "omni_scheduler_leases_occupying",
            "Leases occupying a slot (active, returning or orphan).",
            len(leases),
        )

    def _workers(self) -> Iterator[Any]:
        """Workers by health, and each worker's slots and state."""
        s = self._scheduler
        workers = list(s.registry)
        by_health = GaugeMetricFamily(
            "omni_scheduler_workers", "Registered workers by health.", labels=["health"]
        )
        for health in ("serving", "not_serving", "unknown"):
            by_health.add_metric([health], sum(1 for w in workers if w.health.value == health))
        yield by_health
        slots = GaugeMetricFamily(
            "omni_scheduler_worker_slots", "Slots a worker advertises.", labels=["worker_id"]
        )
        free = GaugeMetricFamily(
            "omni_scheduler_worker_slots_free",
            "Slots of a worker not occupied by any lease.",
            labels=["worker_id"],
        )
        up = GaugeMetricFamily(
            "omni_scheduler_worker_serving",
            "1 while the worker reports SERVING, else 0.",
            labels=["worker_id", "engine"],
        )
        for w in workers:
            slots.add_metric([w.worker_id], w.slots)
            free.add_metric([w.worker_id], w.slots_free)
            up.add_metric([w.worker_id, w.engine], 1 if w.health.value == "serving" else 0)
        yield slots
        yield free
        yield up


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)
