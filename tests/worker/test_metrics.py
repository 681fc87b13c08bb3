"""Worker metrics: the hooks move the instruments; the runtime's state is read at scrape
time; a real session through WorkerService is counted; /metrics over HTTP."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request

from omnifabric.common import logs
from omnifabric.common.metrics import serve_http
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.worker.engine import GenerateResult, KvFigures
from omnifabric.worker.metrics import WorkerMetrics
from omnifabric.worker.session_types import CloseReason, SessionEnd, UnitOutput, UnitTimings, Usage
from tests.conftest import scaled
from tests.worker.conftest import SessionClient


def _output(seq: int, wall_clock_ms: float, is_listen: bool = True, kv: int = 300) -> UnitOutput:
    result = GenerateResult(is_listen=is_listen, text="" if is_listen else "hi", kv_cache_length=kv)
    timings = UnitTimings(
        prefill_ms=20.0, generate_ms=30.0, finalize_wait_ms=1.0, wall_clock_ms=wall_clock_ms
    )
    # Late: its result left later than one unit length (1 s here) after it arrived.
    late = wall_clock_ms > 1000.0
    return UnitOutput(
        seq=seq, result=result, timings=timings, usage=Usage(), dropped_seqs=[], late=late
    )


def test_observe_unit_and_end_move_the_instruments():
    metrics = WorkerMetrics()
    value = metrics.registry.get_sample_value
    metrics.observe_unit(_output(1, 60.0), "audio")
    metrics.observe_unit(_output(2, 1500.0, is_listen=False, kv=700), "audio")
    assert value("omni_worker_units_total", {"mode": "audio", "kind": "listen"}) == 1
    assert value("omni_worker_units_total", {"mode": "audio", "kind": "speak"}) == 1
    assert value("omni_worker_unit_deadline_misses_total") == 1
    assert value("omni_worker_unit_stage_seconds_count", {"stage": "prefill"}) == 2
    assert value("omni_worker_unit_stage_seconds_sum", {"stage": "generate"}) == 0.06
    assert value("omni_worker_unit_stage_seconds_bucket", {"stage": "wall_clock", "le": "1.0"}) == 1
    assert value("omni_worker_unit_context_tokens_sum") == 1000
    end = SessionEnd(
        CloseReason.USER_STOP, "closed", Usage(), units_served=2, units_dropped=3, late_units=1
    )
    metrics.observe_end(end)
    assert value("omni_worker_sessions_ended_total", {"reason": "user_stop"}) == 1
    assert value("omni_worker_units_dropped_total") == 3
    assert value("omni_worker_session_late_units_bucket", {"le": "0.0"}) == 0
    assert value("omni_worker_session_late_units_bucket", {"le": "1.0"}) == 1


def test_a_replys_start_is_observed_by_part_and_how():
    metrics = WorkerMetrics()
    value = metrics.registry.get_sample_value
    start = _output(3, 400.0, is_listen=False)
    start.result.reply_start_how = "inline"
    start.result.reply_start_ms = {"endpoint": 600.0, "asr": 300.0, "llm": 450.0, "tts": 50.0}
    metrics.observe_unit(start, "audio")
    metrics.observe_unit(_output(4, 20.0, is_listen=False), "audio")  # the reply goes on
    assert value("omni_worker_reply_starts_total", {"how": "inline"}) == 1
    assert value("omni_worker_reply_start_seconds_count", {"part": "asr"}) == 1
    assert value("omni_worker_reply_start_seconds_sum", {"part": "llm"}) == 0.45
    assert value("omni_worker_reply_start_seconds_bucket", {"part": "endpoint", "le": "0.5"}) == 0


async def test_runtime_state_and_a_served_session(scheduler, workers):
    worker = await workers.start(slots=2)
    value = worker.runtime.metrics.registry.get_sample_value
    assert value("omni_worker_slots") == 2
    assert value("omni_worker_slots_free") == 2
    assert value("omni_worker_serving") == 1
    assert value("omni_worker_engine_stuck") == 0
    assert value("omni_worker_info", {"worker_id": worker.worker_id, "engine": "synthetic"}) == 1
    # Memory figures exist for every engine (cpu here: process RSS).
    assert value("omni_worker_memory_baseline_bytes", {"device": "cpu"}) > 0
    assert value("omni_worker_memory_allocated_bytes", {"device": "cpu"}) > 0

    scheduler.grant(worker.worker_id, "L1")
    client = SessionClient(workers.stub(worker))
    client.start("L1")
    assert (await client.next()).WhichOneof("kind") == "started"
    assert value("omni_worker_sessions_active", {"mode": "audio"}) == 1
    assert value("omni_worker_slots_free") == 1
    for seq in (1, 2, 3):
        client.unit(seq)
        assert (await client.next()).WhichOneof("kind") == "result"
    client.close(common_pb2.CLOSE_REASON_USER_STOP)
    await client.until_ended()
    assert value("omni_worker_units_total", {"mode": "audio", "kind": "listen"}) == 3
    assert value("omni_worker_sessions_ended_total", {"reason": "user_stop"}) == 1
    assert value("omni_worker_sessions_active", {"mode": "audio"}) == 0
    assert value("omni_worker_memory_cleanups_total") == 1


def test_serve_http_answers_metrics():
    metrics = WorkerMetrics()
    metrics.observe_unit(_output(1, 10.0), "video")
    server, port = serve_http(metrics.registry, "127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            body = reply.read().decode()
        assert 'omni_worker_units_total{kind="listen",mode="video"} 1.0' in body
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            assert reply.status == 200
    finally:
        server.shutdown()
        server.server_close()


def test_json_log_lines_carry_the_session_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("worker"))
    logger = logging.getLogger("test.worker.metrics.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    token = logs.bind_session("rt_1")
    try:
        logger.info("unit %d served", 7, extra={"seq": 7})
    finally:
        logs.SESSION_ID.reset(token)
    logger.info("no session")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "unit 7 served" and first["session_id"] == "rt_1"
    assert (first["service"], first["level"], first["seq"]) == ("worker", "INFO", 7)
    assert first["ts"].endswith("Z") and "trace_id" not in first
    assert "session_id" not in second


async def test_an_engines_kv_slots_go_out_with_the_memory_report(scheduler, workers):
    """A worker whose engine keeps KV slots reports them with its memory (every report),
    so the scheduler's status and the edge's /status show them; others report zeros."""
    worker = await workers.start(slots=2)
    figures = KvFigures(slots=2, slot_tokens=5120, slot_bytes=1000, more_slots=7)
    worker.runtime.engine.kv_figures = lambda: figures  # type: ignore[method-assign]
    deadline = asyncio.get_running_loop().time() + scaled(5)
    while True:
        report = await asyncio.wait_for(scheduler.reports.get(), scaled(5))
        if report.memory.kv_slots or asyncio.get_running_loop().time() > deadline:
            break
    memory = report.memory
    assert (memory.kv_slots, memory.kv_slot_tokens) == (2, 5120)
    assert (memory.kv_slot_bytes, memory.kv_slots_more) == (1000, 7)
