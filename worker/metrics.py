"""Prometheus metrics of one worker, in its own CollectorRegistry.

Per-unit figures are fed by `observe_unit` (one call where a UnitOutput goes out) and
session ends by `observe_end` (when the runtime frees a session); sessions, slots,
health and memory are read from the WorkerRuntime at scrape time. Served by
`common.metrics.serve_http` on `--metrics-port` (a prometheus_client HTTP server on its
own thread).
Process figures (process_resident_memory_bytes, process_open_fds, ...) and the live
asyncio tasks (omni_worker_asyncio_tasks) show leaks in long runs.

The runtime builds these metrics and passes itself in; this module knows it only as a
`RuntimeState` and never imports the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import Gauge
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from omnifabric.common.metrics import LabelledChildren
from omnifabric.worker.engines import memory

if TYPE_CHECKING:
    from omnifabric.worker.config import WorkerConfig
    from omnifabric.worker.engine import Engine
    from omnifabric.worker.headroom import HeadroomFigures
    from omnifabric.worker.session import DuplexSession
    from omnifabric.worker.session_types import SessionEnd, UnitOutput

#: Stage latencies, seconds; the unit loop runs at one unit per second.
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
#: Context length, tokens (the cap is 8192 by default).
CONTEXT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384)
#: Late units per session (a unit is late when its result left later than one unit length
#: after it arrived, a second at least: headroom.is_late).
LATE_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 600)
#: Sessions per batched step.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: UnitTimings field -> stage label.
STAGES = {
    "prefill_ms": "prefill",
    "generate_ms": "generate",
    "finalize_wait_ms": "finalize_wait",
    "wall_clock_ms": "wall_clock",
    "queue_ms": "queue",
    "engine_busy_ms": "engine_busy",
}


class HealthState(Protocol):
    """worker.runtime.Health, as far as the metrics read it."""

    @property
    def serving(self) -> bool: ...


class RuntimeState(Protocol):
    """What the metrics read from the worker at scrape time: worker.runtime.WorkerRuntime."""

    @property
    def config(self) -> WorkerConfig: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def slots(self) -> int: ...
    @property
    def sessions(self) -> dict[str, DuplexSession]: ...
    @property
    def chats(self) -> int: ...
    @property
    def health(self) -> HealthState: ...
    @property
    def stuck(self) -> dict[str, str]: ...
    @property
    def baseline(self) -> memory.MemoryReport | None: ...
    @property
    def last_cleanup(self) -> memory.MemoryReport | None: ...
    @property
    def cleanups(self) -> int: ...
    def headroom_figures(self) -> HeadroomFigures | None: ...


class WorkerMetrics:
    """The worker's instruments; `registry` is what /metrics serves."""

    def __init__(self, runtime: RuntimeState | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.units = Counter(
            "omni_worker_units",
            "Units served (one result each), by mode and kind (listen or speak).",
            ["mode", "kind"],
            registry=r,
        )
        self.unit_seconds = Histogram(
            "omni_worker_unit_stage_seconds",
            "Time per served unit by stage: prefill, generate, finalize_wait (waiting for "
            "the previous unit's deferred finalize), queue (receipt to start), wall_clock "
            "(receipt to result), engine_busy (of queue, the engine still on the session's "
            "earlier unit).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.deadline_misses = Counter(
            "omni_worker_unit_deadline_misses",
            "Late units: the result left later than one unit length (a second at least) after "
            "the unit arrived (slower than real time).",
            registry=r,
        )
        self.session_late_units = Histogram(
            "omni_worker_session_late_units",
            "Late units per duplex session, observed when it ends.",
            buckets=LATE_BUCKETS,
            registry=r,
        )
        self.units_dropped = Counter(
            "omni_worker_units_dropped",
            "Units replaced by a newer one before they were served (newest wins), "
            "counted when their session ends.",
            registry=r,
        )
        self._add_result_figures(r)
        self._child = LabelledChildren()
        """Labelled children of the per-unit instruments (a unit's observations: 147 ->
        110 us on a cold path, 10.6 -> 5.3 us back to back)."""
        self._stages = [(field, self._child(self.unit_seconds, s)) for field, s in STAGES.items()]
        self.batch_sessions = Histogram(
            "omni_worker_batch_sessions",
            "Sessions served per batched step (a worker whose engine steps sessions together).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "omni_worker_step_phase_seconds",
            "Time per batched step by phase: the engine's own (prefill, generate and finer "
            "ones) and wall (the whole call).",
            ["phase"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.sessions_ended = Counter(
            "omni_worker_sessions_ended",
            "Duplex sessions ended, by close reason.",
            ["reason"],
            registry=r,
        )
        if runtime is not None:
            r.register(_RuntimeCollector(runtime))
        ProcessCollector(registry=r)
        tasks = Gauge(
            "omni_worker_asyncio_tasks",
            "Live asyncio tasks on the worker's event loop, counted at scrape time.",
            registry=r,
        )
        with contextlib.suppress(RuntimeError):  # built outside a loop: the gauge stays 0
            loop = asyncio.get_running_loop()
            # Read on the metrics server's thread; safe because all_tasks(loop) copies the
            # weak set of tasks with retries for exactly that case (bpo-36607).
            tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def _add_result_figures(self, r: CollectorRegistry) -> None:
        """The instruments of what a unit's result tells: its context length and, on a
        reply's first unit, where the reply's start went (GenerateResult.reply_start_*)."""
        self.context_tokens = Histogram(
            "omni_worker_unit_context_tokens",
            "Context (KV cache) length after each served unit, tokens.",
            buckets=CONTEXT_BUCKETS,
            registry=r,
        )
        self.reply_start = Histogram(
            "omni_worker_reply_start_seconds",
            "Where the time to a reply's first audio went, by part (engines that report "
            "it): endpoint (silence after the user's last words before the turn was taken, "
            "stream time), asr, llm (the turn's prefill and the first piece), tts.",
            ["part"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.reply_starts = Counter(
            "omni_worker_reply_starts",
            "Replies begun, by how: inline (in the unit that ended the user's turn), "
            "finalize (in its finalize: sent at once where the sender takes results between "
            "units, else with the next unit), guess (begun before the "
            "turn ended, on the words heard so far).",
            ["how"],
            registry=r,
        )

    def observe_unit(self, output: UnitOutput, mode: str = "") -> None:
        """One served unit: its stage times, kind, context length, deadline; of a
        finalize's output between units (UnitOutput.early), how its reply started."""
        result = output.result
        if not output.early:
            timings = output.timings
            for field, child in self._stages:
                child.observe(max(0.0, getattr(timings, field)) / 1000.0)
            if output.late:
                self.deadline_misses.inc()
            self._child(self.units, mode, "listen" if result.is_listen else "speak").inc()
            self.context_tokens.observe(result.kv_cache_length)
        if result.reply_start_how:
            self._child(self.reply_starts, result.reply_start_how).inc()
            for part, ms in result.reply_start_ms.items():
                self._child(self.reply_start, part).observe(max(0.0, ms) / 1000.0)

    def observe_step(self, sessions: int, phases_ms: dict[str, float], wall_s: float) -> None:
        """One batched step: how many sessions it served and its phase times."""
        self.batch_sessions.observe(sessions)
        self._child(self.step_seconds, "wall").observe(wall_s)
        for phase, ms in phases_ms.items():
            self._child(self.step_seconds, phase).observe(max(0.0, ms) / 1000.0)

    def observe_end(self, end: SessionEnd) -> None:
        """A session ended (after its engine session and memory were freed)."""
        self.sessions_ended.labels(end.reason.value).inc()
        self.session_late_units.observe(end.late_units)
        if end.units_dropped:
            self.units_dropped.inc(end.units_dropped)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what a scrape returns)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _RuntimeCollector(Collector):
    """Gauges read from the runtime when scraped (on the HTTP server's thread:
    containers are copied with list()/len() before use)."""

    def __init__(self, runtime: RuntimeState) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Any]:
        rt = self._runtime
        sessions = list(rt.sessions.values())
        active = GaugeMetricFamily(
            "omni_worker_sessions_active", "Duplex sessions open, by mode.", labels=["mode"]
        )
        for mode in ("audio", "video"):
            active.add_metric([mode], sum(1 for s in sessions if s.spec.mode == mode))
        yield active
        yield GaugeMetricFamily(
            "omni_worker_chat_turns_active", "Chat turns being generated.", value=rt.chats
        )
        yield GaugeMetricFamily("omni_worker_slots", "Sessions this worker takes.", value=rt.slots)
        yield GaugeMetricFamily(
            "omni_worker_slots_free",
            "Slots not held by a session or chat turn.",
            value=max(0, rt.slots - len(sessions) - rt.chats),
        )
        yield GaugeMetricFamily(
            "omni_worker_serving",
            "1 while the worker takes new sessions (SERVING), else 0.",
            value=1 if rt.health.serving else 0,
        )
        yield GaugeMetricFamily(
            "omni_worker_engine_stuck",
            "Engine calls past the unit timeout that have not returned yet (the worker is "
            "NOT_SERVING while any is).",
            value=len(dict(rt.stuck)),
        )
        yield from self._headroom()
        info = GaugeMetricFamily(
            "omni_worker_info",
            "Always 1: the worker's id and engine.",
            labels=["worker_id", "engine"],
        )
        info.add_metric([rt.config.worker_id, rt.engine.name], 1)
        yield info
        yield from self._memory()

    def _headroom(self) -> Iterator[Any]:
        """The real-time headroom the worker reports to the scheduler (after warm-up)."""
        figures = self._runtime.headroom_figures()
        if figures is None:
            return
        cost = GaugeMetricFamily(
            "omni_worker_session_cost",
            "Engine seconds one session costs per second of its input (chat: the share of "
            "an engine thread a turn holds), by mode.",
            labels=["mode"],
        )
        peak = GaugeMetricFamily(
            "omni_worker_session_peak_cost",
            "Engine seconds per second of input of a session's dearest units (the 95th "
            "percentile of recent units: on the reference engine, the unit that ends a turn), "
            "by mode.",
            labels=["mode"],
        )
        for mode, mode_cost in sorted(figures.costs.items()):
            cost.add_metric([mode], mode_cost.session_cost)
            peak.add_metric([mode], mode_cost.peak_cost)
        yield cost
        yield peak
        yield GaugeMetricFamily(
            "omni_worker_engine_threads", "Engine threads.", value=figures.engine_threads
        )
        yield GaugeMetricFamily(
            "omni_worker_late_units_recent",
            f"Late units in the last {figures.late_window_s:g} s (the worker takes no new "
            "session while any).",
            value=figures.late_recent,
        )
        yield GaugeMetricFamily(
            "omni_worker_unit_wall_ratio_p95",
            "Recent units' wall clock over their length, 95th percentile.",
            value=figures.unit_p95_ratio,
        )

    def _memory(self) -> Iterator[Any]:
        """Memory figures, for every engine: device "cuda" (torch.cuda.memory_allocated)
        or "cpu" (process RSS)."""
        rt = self._runtime
        base, last = rt.baseline, rt.last_cleanup
        in_use, device = memory.measure()
        yield _device_gauge(
            "omni_worker_memory_allocated_bytes",
            "Memory in use now: CUDA allocated bytes, or RSS on CPU.",
            device,
            in_use,
        )
        if base is not None:
            yield _device_gauge(
                "omni_worker_memory_baseline_bytes",
                "Memory in use after the warm-up unit (what cleanups return to).",
                base.device,
                base.after_bytes,
            )
        report = last or base
        if report is not None:
            yield _device_gauge(
                "omni_worker_memory_after_cleanup_bytes",
                "Memory in use after the last cleanup (session end, or warm-up before any).",
                report.device,
                report.after_bytes,
            )
            yield _device_gauge(
                "omni_worker_memory_before_cleanup_bytes",
                "Memory in use just before the last cleanup.",
                report.device,
                report.before_bytes,
            )
        yield CounterMetricFamily(
            "omni_worker_memory_cleanups", "Memory cleanups after sessions.", value=rt.cleanups
        )


def _device_gauge(name: str, help_text: str, device: str, value: float) -> GaugeMetricFamily:
    """A gauge of one sample labelled with the memory's device ("cuda" or "cpu")."""
    gauge = GaugeMetricFamily(name, help_text, labels=["device"])
    gauge.add_metric([device], value)
    return gauge
