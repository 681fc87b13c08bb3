"""Traces across processes: a real OTLP/gRPC receiver (opentelemetry-proto's service
definition) collects the spans that edge, scheduler and worker export for one session."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient
from tests.stack import Stack

UNITS = [SILENCE] * 3 + [SPEECH] * 2 + [SILENCE] * 4


class Receiver(otlp_grpc.TraceServiceServicer):
    """Keeps every exported span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append((attrs.get("service.name", ""), attrs, span))
        return otlp_pb.ExportTraceServiceResponse()


@pytest.fixture
async def receiver():
    server = grpc.aio.server()
    collector = Receiver()
    otlp_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield collector, port
    await server.stop(0)


async def test_one_trace_per_session_across_processes(receiver, tmp_path, monkeypatch):
    collector, port = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "1", "--compute-ms", "5", name="traced-worker")
        stack.start_edge()
        client = await WsClient.open(f"{stack.url}?mode=audio")
        await client.start()
        for seq, unit in enumerate(UNITS, 1):
            await client.append(unit)
            # Wait for this unit's own result: a turn's last unit also sends a listen
            # delta after its audio, which must not be taken for the next unit's.
            while (await client.until("delta.listen", "delta.audio"))["metrics"]["seq"] != seq:
                pass
        await client.send({"type": "session.close"})
        await client.until("session.closed")

        def done() -> bool:
            names = [s.name for _, _, s in collector.spans]
            return names.count("unit") >= len(UNITS) and "session" in names

        for _ in range(int(scaled(100))):
            if done():
                break
            await asyncio.sleep(0.1)
    finally:
        stack.stop()
    logs = {svc.name: svc.log_path.read_text() for svc in stack.services}
    spans = collector.spans
    by_name = defaultdict(list)
    for service, attrs, span in spans:
        by_name[span.name].append((service, attrs, span))
    [(edge_service, _, session)] = by_name["session"]
    assert edge_service == "omnifabric-edge"
    trace_id = session.trace_id
    units = [s for svc, _, s in by_name["unit"] if svc == "omnifabric-worker"]
    assert len(units) == len(UNITS)
    # Every unit span is in the session's trace and a direct child of the edge's span.
    assert all(u.trace_id == trace_id and u.parent_span_id == session.span_id for u in units)
    worker_attrs = [a for svc, a, _ in by_name["unit"]][0]
    assert worker_attrs["service.instance.id"] == "traced-worker"
    seqs = sorted(
        next(a.value.int_value for a in u.attributes if a.key == "unit.seq") for u in units
    )
    assert seqs == list(range(1, len(UNITS) + 1))
    kinds = {
        next(a.value.string_value for a in u.attributes if a.key == "unit.kind") for u in units
    }
    assert kinds == {"listen", "speak"}
    for u in units:
        keys = {a.key for a in u.attributes}
        assert {"unit.kv_cache_length", "unit.n_tokens", "unit.deadline_missed"} <= keys
        children = [s for _, _, s in spans if s.parent_span_id == u.span_id]
        assert sorted(c.name for c in children) == ["finalize", "generate", "prefill"]
        for child in children:
            assert u.start_time_unix_nano <= child.start_time_unix_nano
            assert child.end_time_unix_nano <= u.end_time_unix_nano
    # Queue wait on the edge, the scheduler's acquire under it, edge-side unit times.
    [(_, _, queue)] = by_name["queue"]
    assert queue.parent_span_id == session.span_id
    [(sched_service, _, acquire)] = by_name["acquire"]
    assert sched_service == "omnifabric-scheduler"
    assert acquire.trace_id == trace_id and acquire.parent_span_id == queue.span_id
    edge_units = by_name["edge.unit"]
    assert len(edge_units) == len(UNITS)
    assert all(s.parent_span_id == session.span_id for _, _, s in edge_units)
    # JSON log lines about the session carry its trace id in every service.
    trace_hex = trace_id.hex()
    for name in ("scheduler", "traced-worker", "edge"):
        lines = [json.loads(line) for line in logs[name].splitlines() if line.startswith("{")]
        about = [entry for entry in lines if entry.get("session_id")]
        assert about, name
        assert any(entry.get("trace_id") == trace_hex for entry in about), name
    # For the note: one real trace's unit spans with their timings.
    for u in sorted(units, key=lambda s: s.start_time_unix_nano):
        kids = {
            c.name: (c.end_time_unix_nano - c.start_time_unix_nano) / 1e6
            for _, _, c in spans
            if c.parent_span_id == u.span_id
        }
        seq = next(a.value.int_value for a in u.attributes if a.key == "unit.seq")
        print(
            f"unit {seq}: {(u.end_time_unix_nano - u.start_time_unix_nano) / 1e6:.1f} ms "
            + " ".join(f"{k} {v:.1f}" for k, v in sorted(kids.items()))
        )
