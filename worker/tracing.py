"""Per-unit tracing: one span per served unit under the session's trace, built once its
finalize is done from the times the unit loop measured (perf_counter)."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from omnifabric.common import telemetry
from omnifabric.worker.session_types import SessionSpec, UnitTrace

TRACER = telemetry.tracer("worker")
#: perf_counter -> epoch nanoseconds, for spans built from measured times.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _ns(perf: float) -> int:
    return int(perf * 1e9) + _EPOCH_OFFSET_NS


def trace_unit(spec: SessionSpec, unit: UnitTrace, f0: float, f1: float) -> None:
    """One span per unit (receive -> finalize done) under the session's trace, with
    prefill / generate / finalize children, built from the measured times; nothing when
    the session has no trace (`spec.trace_context`)."""
    parent = spec.trace_context
    if parent is None:
        return
    span = TRACER.start_span("unit", context=parent, start_time=_ns(unit.received_at))
    if not span.is_recording():
        return  # tracing off here, or the trace sampled out: its children would be too
    out = unit.output
    result, timings = out.result, out.timings
    attributes: dict[str, AttributeValue] = {
        "session.id": spec.session_id,
        "unit.seq": out.seq,
        "unit.kind": "listen" if result.is_listen else "speak",
        "unit.kv_cache_length": result.kv_cache_length,
        "unit.n_tokens": result.n_tokens,
        "unit.n_tts_tokens": result.n_tts_tokens,
        "unit.end_of_turn": result.end_of_turn,
        "unit.deadline_missed": out.late,
        "unit.dropped_before": len(out.dropped_seqs),
    }
    span.set_attributes(attributes)
    ctx = trace.set_span_in_context(span)
    p1 = unit.started + timings.prefill_ms / 1000.0
    g1 = p1 + timings.generate_ms / 1000.0
    for name, a, b in (
        ("prefill", unit.started, p1),
        ("generate", p1, g1),
        ("finalize", f0, f1),
    ):
        TRACER.start_span(name, context=ctx, start_time=_ns(a)).end(end_time=_ns(b))
    span.end(end_time=_ns(f1))
