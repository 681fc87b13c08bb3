"""Prometheus metrics of the edge, in the edge's own CollectorRegistry.

One `EdgeMetrics` per process (`METRICS`), handed to the edge where it is assembled
(edge.server): the session core and the connection drivers feed it through small hooks,
and `EdgeApp.process_request` serves it as `GET /metrics` on the WebSocket port.
Live sessions are counted at scrape time from the session cores themselves (a weak
set), so the gauge cannot drift when a session ends in an unusual way. Process figures
(process_resident_memory_bytes, process_open_fds, ...) and the live asyncio tasks
(omni_edge_asyncio_tasks) show leaks in long runs.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import Gauge
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from omnifabric.common.metrics import LabelledChildren

if TYPE_CHECKING:
    from omnifabric.edge.events import Output


class LiveSession(Protocol):
    """What the sessions gauge reads of a session (edge.session.SessionCore)."""

    mode: str
    started: bool
    closed: asyncio.Event

    @property
    def leased(self) -> bool: ...


#: Content type of GET /metrics (the Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Queue waits, seconds.
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: Garbage-collector pauses, seconds.
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Edge-side time of a unit (forwarded -> result emitted), seconds.
UNIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class EdgeMetrics:
    """The edge's instruments; `registry` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._sessions: weakref.WeakSet[LiveSession] = weakref.WeakSet()
        self.sessions_total = Counter(
            "omni_edge_sessions",
            "Duplex sessions ended, by mode and close reason (user_stop, client_closed, "
            "timeout, context_full, server_shutdown, error).",
            ["mode", "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "omni_edge_queue_wait_seconds",
            "Time from the scheduler Acquire to the lease, as the edge saw it, by mode.",
            ["mode"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.units_forwarded = Counter(
            "omni_edge_units_forwarded",
            "Units of client input forwarded to a worker, by mode.",
            ["mode"],
            registry=r,
        )
        self.outputs = Counter(
            "omni_edge_outputs",
            "Unit results sent to clients, by mode and kind (listen or speak).",
            ["mode", "kind"],
            registry=r,
        )
        self.unit_seconds = Histogram(
            "omni_edge_unit_seconds",
            "Edge-side time of a unit: forwarded to the worker -> its result handed to the "
            "client's transport, by mode.",
            ["mode"],
            buckets=UNIT_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "omni_edge_client_errors",
            "Error events sent to clients, by public error code.",
            ["code"],
            registry=r,
        )
        self.gc_pause = Histogram(
            "omni_edge_gc_pause_seconds",
            "Garbage-collector pauses of the edge process, by generation: the event loop and "
            "every session stand still meanwhile.",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )
        self._child = LabelledChildren()
        """Labelled children of the per-unit instruments."""
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=20_000)
        """(when, seconds) of the latest units: the admin page's recent latency."""
        r.register(_SessionCollector(self._sessions))
        ProcessCollector(registry=r)
        Gauge(
            "omni_edge_asyncio_tasks",
            "Live asyncio tasks on the edge's event loop, counted at scrape time.",
            registry=r,
        ).set_function(_live_tasks)

    def identify(self, index: int) -> None:
        """Name this process in the exposition: omni_edge_process{index, pid} 1 (index 1..N
        under `--processes N`, 0 for a lone edge), so scrapes of a shared port are told
        apart."""
        Gauge(
            "omni_edge_process",
            "The edge process that answered this scrape (index under --processes, pid).",
            ["index", "pid"],
            registry=self.registry,
        ).labels(str(index), str(os.getpid())).set(1)

    def time_gc(self) -> None:
        """Observe every garbage-collector pause from now on (gc.callbacks)."""
        started = [0.0]
        by_generation = {g: self.gc_pause.labels(str(g)) for g in range(3)}

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                by_generation[info["generation"]].observe(time.perf_counter() - started[0])

        gc.callbacks.append(on_gc)

    # ---- hooks --------------------------------------------------------------------

    def track(self, core: LiveSession) -> None:
        """Count `core` in the live sessions gauge until it is closed (or collected)."""
        self._sessions.add(core)

    def session_closed(self, mode: str, reason: str) -> None:
        self.sessions_total.labels(mode, reason).inc()

    def leased(self, mode: str, queue_wait_s: float) -> None:
        self.queue_wait.labels(mode).observe(max(0.0, queue_wait_s))

    def unit_forwarded(self, mode: str, seq: int, sent_at: dict[int, float]) -> None:
        """A unit went to the worker; `sent_at` (the session's) remembers when."""
        sent_at[seq] = time.perf_counter()
        self._child(self.units_forwarded, mode).inc()

    def output(self, mode: str, out: Output, sent_at: dict[int, float]) -> None:
        """A result went to the client: count it and time its unit (replaced ones are
        forgotten)."""
        self._child(self.outputs, mode, "listen" if out.is_listen else "speak").inc()
        for seq in out.dropped_seqs:
            sent_at.pop(seq, None)
        started = sent_at.pop(out.seq, None)
        if started is not None:
            now = time.perf_counter()
            self._child(self.unit_seconds, mode).observe(now - started)
            self._recent.append((now, now - started))

    def recent_units(self, window_s: float = 10.0) -> dict[str, Any]:
        """Units answered in the last `window_s` seconds and their edge-side time (ms):
        {count, p50_ms, p99_ms} (None without units)."""
        since = time.perf_counter() - window_s
        times = sorted(s for t, s in list(self._recent) if t >= since)
        if not times:
            return {"count": 0, "p50_ms": None, "p99_ms": None}

        def at(q: float) -> float:
            return round(times[min(len(times) - 1, int(q * len(times)))] * 1000.0, 1)

        return {"count": len(times), "p50_ms": at(0.5), "p99_ms": at(0.99)}

    def client_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    # ---- exposition ---------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format 0.0.4."""
        return generate_latest(self.registry)


class _SessionCollector(Collector):
    """omni_edge_sessions_active{mode,state}, from the live session cores."""

    def __init__(self, sessions: weakref.WeakSet[LiveSession]) -> None:
        self._sessions = sessions

    def collect(self) -> Iterator[Any]:
        counts: dict[tuple[str, str], int] = {
            (mode, state): 0 for mode in ("audio", "video") for state in _STATES
        }
        for core in list(self._sessions):
            if core.closed.is_set():
                continue
            state = "active" if core.started else "leased" if core.leased else "queued"
            key = (core.mode, state)
            counts[key] = counts.get(key, 0) + 1
        gauge = GaugeMetricFamily(
            "omni_edge_sessions_active",
            "Open duplex sessions on this edge, by mode and state (queued: waiting for a "
            "slot; leased: slot held, not initialized; active: streaming units).",
            labels=["mode", "state"],
        )
        for (mode, state), value in sorted(counts.items()):
            gauge.add_metric([mode, state], value)
        yield gauge


_STATES = ("queued", "leased", "active")


def _live_tasks() -> float:
    """Unfinished tasks of the running loop: /metrics is served from the edge's own event
    loop, so no other thread is involved. NaN when scraped outside a loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return float("nan")


#: The edge process's metrics.
METRICS = EdgeMetrics()
