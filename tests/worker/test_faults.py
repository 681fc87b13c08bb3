"""Worker faults through real gRPC servers: a hung engine call (F5), message limits (G6),
unexpected errors (G2)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.common.close_reasons import INFERENCE_ERROR, close_message
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.worker import service
from omnifabric.worker.engines.synthetic import SyntheticEngine, SyntheticSession
from tests.conftest import scaled
from tests.worker.conftest import SILENCE, SessionClient, pcm_bytes

SERVING = common_pb2.WORKER_HEALTH_SERVING
NOT_SERVING = common_pb2.WORKER_HEALTH_NOT_SERVING


class SlowFinalizeSession(SyntheticSession):
    engine: SlowFinalizeEngine

    def finalize(self) -> None:
        time.sleep(self.engine.finalize_s)
        super().finalize()


class SlowFinalizeEngine(SyntheticEngine):
    """finalize() blocks finalize_s seconds (0 during warm-up)."""

    session_class = SlowFinalizeSession
    finalize_s = 0.0


class TimeoutRaisingSession(SyntheticSession):
    engine: TimeoutRaisingEngine

    def generate(self, force_listen: bool):
        if self.engine.raising:
            raise TimeoutError("the engine's own timeout")
        return super().generate(force_listen)


class TimeoutRaisingEngine(SyntheticEngine):
    """generate() raises TimeoutError at once once `raising` (not during warm-up): an
    engine failure, not a stuck call."""

    session_class = TimeoutRaisingSession
    raising = False


async def start_session(workers, worker, lease_id):
    """An open session and its SessionStarted."""
    workers.scheduler.grant(worker.worker_id, lease_id)
    client = SessionClient(workers.stub(worker))
    client.start(lease_id)
    started = await client.next()
    assert started.WhichOneof("kind") == "started", started
    return client, started.started


async def open_session(workers, worker, lease_id):
    client, _ = await start_session(workers, worker, lease_id)
    return client


async def serve_unit(client, seq):
    client.unit(seq, SILENCE)
    response = await client.next()
    assert response.WhichOneof("kind") == "result", response
    return response.result


async def report_where(workers, predicate, timeout_s=3.0):
    """The next report to the scheduler that matches (reports also come every second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while True:
        remaining = deadline - loop.time()
        report = await asyncio.wait_for(workers.scheduler.reports.get(), max(0.01, remaining))
        if predicate(report):
            return report


async def health(worker):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="omni.realtime.v1.WorkerService")
        )
    return reply.status


async def test_hung_unit_ends_its_session_and_the_worker_serves_again_once_it_returns(workers):
    engine = SyntheticEngine(compute_ms=2, slots=3, hang_unit=3, hang_s=1.5)
    worker = await workers.start(engine=engine, unit_timeout_s=0.3)
    hung = await open_session(workers, worker, "L1")
    other = await open_session(workers, worker, "L2")
    for seq in (1, 2):
        await serve_unit(hung, seq)
    await serve_unit(other, 1)

    hung.unit(3)
    began = time.monotonic()
    (ended,) = await hung.until_ended()
    took = time.monotonic() - began
    assert ended.ended.reason == common_pb2.CLOSE_REASON_ERROR
    assert ended.ended.error_code == "inference_error"
    assert ended.ended.message == close_message(
        INFERENCE_ERROR, "the engine did not finish unit 3 within 0.3 s"
    )
    assert 0.25 < took < scaled(1.0)
    assert await workers.scheduler.next_released() == "L1"
    # Reports queue up (one a second): skip earlier ones such as warm-up's NOT_SERVING.
    report = await report_where(
        workers, lambda r: r.health == NOT_SERVING and r.detail.startswith("engine stuck")
    )
    assert report.detail == "engine stuck: unit 3 of session s-L1 over 0.3 s"
    stuck_gauge = worker.runtime.metrics.registry.get_sample_value
    assert stuck_gauge("omni_worker_engine_stuck") == 1
    assert await health(worker) == health_pb2.HealthCheckResponse.NOT_SERVING

    # The other session runs on another engine thread, untouched.
    await serve_unit(other, 2)
    # No new session while the call is stuck.
    refused = SessionClient(workers.stub(worker))
    refused.start("L3")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await refused.next()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    # Once the call returns, its engine session is freed and the worker serves again.
    await report_where(workers, lambda r: r.health == SERVING)
    assert stuck_gauge("omni_worker_engine_stuck") == 0
    assert time.monotonic() - began > 1.4
    assert await health(worker) == health_pb2.HealthCheckResponse.SERVING
    assert not worker.runtime.stuck
    again = await open_session(workers, worker, "L4")
    await serve_unit(again, 1)
    other.close()
    await other.until_ended()


async def test_hung_finalize_ends_the_session_at_once(workers):
    engine = SlowFinalizeEngine(compute_ms=2, slots=2)
    worker = await workers.start(engine=engine, unit_timeout_s=0.3)
    engine.finalize_s = 1.0
    client = await open_session(workers, worker, "L1")
    began = time.monotonic()
    await serve_unit(client, 1)
    # No further unit: the stuck finalize alone ends the session.
    (ended,) = await client.until_ended()
    assert ended.ended.error_code == "inference_error"
    assert ended.ended.message == close_message(
        INFERENCE_ERROR, "the engine did not finish finalize of unit 1 within 0.3 s"
    )
    assert time.monotonic() - began < scaled(0.9)
    await report_where(
        workers, lambda r: r.health == NOT_SERVING and r.detail.startswith("engine stuck")
    )
    engine.finalize_s = 0.0
    await report_where(workers, lambda r: r.health == SERVING)


class MeasuringEngine(SlowFinalizeEngine):
    """Measures its dearest call at `slowest_s` (Engine.slowest_call_s)."""

    slowest_s: float | None = None

    def slowest_call_s(self) -> float | None:
        return self.slowest_s


async def test_a_finalize_waiting_for_the_engine_thread_is_not_stuck(workers):
    """One engine thread, two sessions whose finalizes take 0.6 s each under a 1.0 s unit
    timeout: the second waits 0.6 s for the thread and runs 0.6 s, 1.2 s after it was handed
    in, and is not stuck: the bound counts from the call's start (worker.engine_call)."""
    engine = SlowFinalizeEngine(compute_ms=2, slots=2, threads=1)
    worker = await workers.start(engine=engine, unit_timeout_s=1.0)
    engine.finalize_s = 0.6
    first = await open_session(workers, worker, "L1")
    second = await open_session(workers, worker, "L2")
    began = time.monotonic()
    first.unit(1, SILENCE)
    second.unit(1, SILENCE)
    for client in (first, second):
        assert (await client.next()).WhichOneof("kind") == "result"
    for client in (first, second):  # each next unit waits for its session's finalize
        assert (await serve_unit(client, 2)).seq == 2
    assert time.monotonic() - began >= 1.2  # the two finalizes ran one after the other
    assert not worker.runtime.stuck
    assert await health(worker) == health_pb2.HealthCheckResponse.SERVING
    engine.finalize_s = 0.0
    for client in (first, second):
        client.close()
        await client.until_ended()


async def test_the_unit_timeout_is_a_multiple_of_the_engines_dearest_call_where_longer(workers):
    """An engine that measures its dearest call at 0.5 s gets 3 times that, 1.5 s, over a
    configured 0.3 s: its sessions say so (SessionStarted.unit_timeout_ms, which the edge
    outwaits); a 0.8 s finalize is served, a 2.5 s one is stuck at 1.5 s. Unmeasured, the
    configured timeout holds."""
    engine = MeasuringEngine(compute_ms=2, slots=3)
    worker = await workers.start(engine=engine, unit_timeout_s=0.3)
    client, started = await start_session(workers, worker, "L1")
    assert started.unit_timeout_ms == 300
    client.close()
    await client.until_ended()

    engine.slowest_s = 0.5
    assert worker.runtime.unit_timeout_s() == pytest.approx(1.5)
    client, started = await start_session(workers, worker, "L2")
    assert started.unit_timeout_ms == 1500
    engine.finalize_s = 0.8
    for seq in (1, 2, 3):  # each after the 0.8 s finalize of the one before
        await serve_unit(client, seq)
    client.close()
    await client.until_ended()
    assert not worker.runtime.stuck

    engine.finalize_s = 2.5
    client, started = await start_session(workers, worker, "L3")
    await serve_unit(client, 1)
    began = time.monotonic()
    (ended,) = await client.until_ended()
    assert ended.ended.error_code == "inference_error"
    assert ended.ended.message == close_message(
        INFERENCE_ERROR, "the engine did not finish finalize of unit 1 within 1.5 s"
    )
    assert 1.0 < time.monotonic() - began < scaled(2.3)
    engine.finalize_s = 0.0
    await report_where(workers, lambda r: r.health == SERVING, timeout_s=5.0)


async def test_an_engine_raising_timeout_error_fails_the_unit_and_is_not_stuck(workers):
    """The unit timeout tells its own expiry from a TimeoutError the engine raised: the
    latter is an inference failure, the worker stays serving."""
    engine = TimeoutRaisingEngine(compute_ms=2, slots=2)
    worker = await workers.start(engine=engine, unit_timeout_s=5)
    engine.raising = True
    client = await open_session(workers, worker, "L1")
    began = time.monotonic()
    client.unit(1, SILENCE)
    (ended,) = await client.until_ended()
    assert time.monotonic() - began < scaled(2.0)
    assert ended.ended.error_code == "inference_error"
    assert ended.ended.message == close_message(INFERENCE_ERROR)
    assert not worker.runtime.stuck
    assert worker.runtime.metrics.registry.get_sample_value("omni_worker_engine_stuck") == 0
    assert await health(worker) == health_pb2.HealthCheckResponse.SERVING


async def test_oversized_unit_is_resource_exhausted_and_the_worker_goes_on(workers):
    """G6: a message over max_message_bytes fails its call; the lease comes back and the
    next session is served."""
    worker = await workers.start(max_message_bytes=64 * 1024)
    client = await open_session(workers, worker, "L1")
    client.unit(1, pcm_bytes(seconds=2.0))  # 128 KB
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.next()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await workers.scheduler.next_released() == "L1"
    again = await open_session(workers, worker, "L2")
    await serve_unit(again, 1)


async def test_unexpected_errors_are_internal_without_details(workers, monkeypatch):
    """G2: an exception nobody foresaw becomes INTERNAL "internal error", before the
    session starts (the servicer's mapping) and after (the interceptor); the worker
    serves the next session."""
    worker = await workers.start()
    runtime = worker.runtime
    leases, runtime.leases = runtime.leases, None
    client = SessionClient(workers.stub(worker))
    client.start("L1")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.next()
    runtime.leases = leases
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error"

    client = await open_session(workers, worker, "L2")

    def broken(event):
        raise AttributeError("'NoneType' object has no attribute 'seq'")

    with monkeypatch.context() as patch:
        patch.setattr(service, "encode_event", broken)
        client.unit(1, SILENCE)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.next()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error"
    assert await workers.scheduler.next_released() == "L2"
    again = await open_session(workers, worker, "L3")
    await serve_unit(again, 1)


async def test_a_failing_metric_does_not_end_the_session(workers):
    """A unit is counted after its result went out, apart from the stream: an instrument
    that raises is logged and the session goes on."""
    worker = await workers.start()
    runtime = worker.runtime
    client = await open_session(workers, worker, "L1")
    metrics, runtime.metrics = runtime.metrics, None  # observe_unit raises AttributeError
    try:
        for seq in (1, 2):
            client.unit(seq, SILENCE)
            response = await client.next()
            assert response.WhichOneof("kind") == "result" and response.result.seq == seq
    finally:
        runtime.metrics = metrics
