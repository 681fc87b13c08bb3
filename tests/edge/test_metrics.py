"""Edge metrics: the hooks move the instruments, SessionCore feeds the process's
METRICS, and GET /metrics serves them in the Prometheus text format."""

from __future__ import annotations

import io
import json
import logging

from websockets.datastructures import Headers
from websockets.http11 import Request

from omnifabric.common import logs
from omnifabric.edge import events as ev
from omnifabric.edge.app import EdgeApp
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.errors import NotReady
from omnifabric.edge.metrics import METRICS, EdgeMetrics
from omnifabric.edge.session import SessionCore


def _value(name: str, labels: dict[str, str] | None = None) -> float:
    return METRICS.registry.get_sample_value(name, labels or {}) or 0.0


def test_hooks_move_the_instruments():
    metrics = EdgeMetrics()
    value = metrics.registry.get_sample_value
    sent_at: dict[int, float] = {}
    for seq in (1, 2, 3):
        metrics.unit_forwarded("audio", seq, sent_at)
    out = ev.Output(
        seq=3,
        is_listen=False,
        text="hi",
        pcm=b"",
        end_of_turn=False,
        kv_cache_length=10,
        timings_ms={},
        usage=ev.Usage(),
        dropped_seqs=(2,),
    )
    metrics.output("audio", out, sent_at)
    assert sent_at == {1: sent_at[1]}  # answered and replaced units are forgotten
    assert value("omni_edge_units_forwarded_total", {"mode": "audio"}) == 3
    assert value("omni_edge_outputs_total", {"mode": "audio", "kind": "speak"}) == 1
    assert value("omni_edge_unit_seconds_count", {"mode": "audio"}) == 1
    metrics.leased("video", 0.25)
    assert value("omni_edge_queue_wait_seconds_sum", {"mode": "video"}) == 0.25
    metrics.session_closed("video", "timeout")
    assert value("omni_edge_sessions_total", {"mode": "video", "reason": "timeout"}) == 1
    metrics.client_error("not_ready")
    assert value("omni_edge_client_errors_total", {"code": "not_ready"}) == 1


async def test_session_core_is_counted_while_open_and_by_close_reason():
    async def emit(_event) -> None:
        return None

    before = _value("omni_edge_sessions_total", {"mode": "audio", "reason": "user_stop"})
    queued = _value("omni_edge_sessions_active", {"mode": "audio", "state": "queued"})
    core = SessionCore("audio", fabric=None, emit=emit)  # type: ignore[arg-type]
    assert _value("omni_edge_sessions_active", {"mode": "audio", "state": "queued"}) == queued + 1
    await core.close()
    assert _value("omni_edge_sessions_active", {"mode": "audio", "state": "queued"}) == queued
    assert _value("omni_edge_sessions_total", {"mode": "audio", "reason": "user_stop"}) == (
        before + 1
    )


class _Wire:
    """A transport that keeps what the driver sends."""

    path = "/v1/realtime"
    input_end_closes = False

    def __init__(self) -> None:
        self.sent: list = []

    def bind(self, on_overflow, render_error) -> None:
        pass

    def send(self, message) -> None:
        self.sent.append(message)

    def send_all(self, messages) -> None:
        self.sent.extend(messages)

    def close(self, code: int, reason: str) -> None:
        self.sent.append((code, reason))


async def test_error_events_are_counted_by_the_connection_that_sends_them():
    from omnifabric.edge.connection import DuplexConnection
    from omnifabric.edge.dialects.realtime import RealtimeDuplex

    metrics = EdgeMetrics()
    app = EdgeApp(EdgeConfig(), None, metrics)  # type: ignore[arg-type]
    wire = _Wire()
    DuplexConnection(app, wire, RealtimeDuplex("audio")).fail(NotReady("send init first"))  # type: ignore[arg-type]
    assert wire.sent == [
        {
            "type": "error",
            "error": {"code": "not_ready", "message": "send init first", "type": "client_error"},
        }
    ]
    value = metrics.registry.get_sample_value(
        "omni_edge_client_errors_total", {"code": "not_ready"}
    )
    assert value == 1


async def test_get_metrics_on_the_websocket_port():
    app = EdgeApp(EdgeConfig(), None, METRICS)  # type: ignore[arg-type]
    response = await app.process_request(None, Request("/metrics", Headers()))  # type: ignore[arg-type]
    assert response is not None and response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    body = response.body.decode()
    assert "# TYPE omni_edge_sessions_total counter" in body
    assert "omni_edge_sessions_active" in body


def test_json_log_lines_carry_session_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("edge"))
    logger = logging.getLogger("test.edge.metrics.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    token = logs.bind_session("rt_9")
    try:
        logger.warning("hello %s", "there")
    finally:
        logs.SESSION_ID.reset(token)
    line = json.loads(stream.getvalue())
    assert line["msg"] == "hello there" and line["session_id"] == "rt_9"
    assert (line["service"], line["level"], line["logger"]) == (
        "edge",
        "WARNING",
        "test.edge.metrics.logs",
    )


def test_json_log_lines_carry_the_current_trace_id():
    from opentelemetry.sdk.trace import TracerProvider

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("edge"))
    logger = logging.getLogger("test.edge.metrics.trace")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("session") as span:
        logger.info("inside")
    logger.info("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert len(inside["trace_id"]) == 32 and "trace_id" not in outside
