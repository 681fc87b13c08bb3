"""The scheduler's server over real gRPC: drain, message limits, unexpected errors (G2, G6)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.scheduler.leases import Lease, LeaseGrantNotice, LeaseState
from omnifabric.scheduler.server import SERVICE_NAME
from tests.conftest import scaled
from tests.scheduler.clients import Holder, WorkerStream
from tests.scheduler.conftest import StartScheduler

AUDIO = common_pb2.MODE_AUDIO
SOURCE = ("omni-error-source", "scheduler")


async def test_drain_refuses_tells_the_queued_and_keeps_leases(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO, "running")
    await holder.expect_lease()
    await worker.expect("lease_granted")
    waiting = Holder(harness.stub, AUDIO, "waiting")
    await waiting.expect_position(1)
    watch = health_pb2_grpc.HealthStub(harness.channel).Watch(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    )
    updates = aiter(watch)
    first = await asyncio.wait_for(anext(updates), scaled(2))
    assert first.status == health_pb2.HealthCheckResponse.SERVING

    drain = asyncio.ensure_future(harness.running.drain(grace=1.0))
    second = await asyncio.wait_for(anext(updates), scaled(2))
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    for told in (waiting, holder):
        error = await told.error()
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == "scheduler is shutting down"
        assert SOURCE in tuple(error.trailing_metadata())
    # The running lease was neither lost nor revoked: its session goes on with its worker.
    await asyncio.wait_for(worker.ended.wait(), scaled(2))
    assert worker.messages.empty()
    assert harness.core.leases.count(LeaseState.ACTIVE) == 1
    watch.cancel()
    await asyncio.wait_for(drain, scaled(3))


async def test_draining_core_refuses_acquire_and_register(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    value = harness.core.metrics.registry.get_sample_value
    assert value("omni_scheduler_draining") == 0
    harness.core.drain()
    assert value("omni_scheduler_draining") == 1
    await asyncio.wait_for(worker.ended.wait(), scaled(2))
    late = await Holder(harness.stub, AUDIO, "late").error()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await WorkerStream(harness.stub, "w2").start()
    for error in (late, info.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == "scheduler is shutting down"


async def test_oversized_messages_are_resource_exhausted(start_scheduler: StartScheduler) -> None:
    """G6: a message over max_message_bytes fails that call only; the next is served."""
    harness = await start_scheduler(max_message_bytes=64 * 1024)
    big = "x" * (100 * 1024)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await Holder(harness.stub, AUDIO, big).next()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    register = harness.stub.Register()
    await register.write(
        scheduler_pb.RegisterRequest(
            hello=scheduler_pb.WorkerHello(worker_id="big", address=big, slots=1, modes=[AUDIO])
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(register.read(), scaled(2))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    await Holder(harness.stub, AUDIO, "fits").expect_lease()
    await worker.close()


async def test_default_limit_is_8_mib(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await Holder(harness.stub, AUDIO, "x" * (8 * 1024 * 1024 + 1)).next()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "8388608" in info.value.details()
    reply = await harness.stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(2))
    assert reply.queue_max == 100


async def test_unexpected_errors_are_internal_without_details(
    start_scheduler: StartScheduler,
) -> None:
    """G2: an exception nobody foresaw becomes INTERNAL with a generic message, in a
    handler's own mapping (GetStatus) and in the interceptor (a Register stream fails
    after its start), and the server serves the next call."""
    harness = await start_scheduler()
    core = harness.core
    registry, core.registry = core.registry, None  # type: ignore[assignment]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(2))
    core.registry = registry
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal scheduler error"

    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    # A grant notice whose lease has no mode cannot be encoded: the stream's own loop fails.
    core.registry.get("w1").outbox.put_nowait(LeaseGrantNotice(Lease("w1", 0, None)))
    await asyncio.wait_for(worker.ended.wait(), scaled(2))
    assert worker.call is not None
    assert await worker.call.code() == grpc.StatusCode.INTERNAL
    assert await worker.call.details() == "internal scheduler error"
    assert "KeyError" not in await worker.call.details()
    reply = await harness.stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(2))
    assert [w.worker_id for w in reply.workers] == []
    again = await WorkerStream(harness.stub, "w2", slots=1).start()
    await Holder(harness.stub, AUDIO, "served").expect_lease()
    await again.close()


async def test_a_workers_kv_slots_reach_the_status(start_scheduler: StartScheduler) -> None:
    """The KV slot figures a batched worker reports with its memory (slots, tokens and bytes
    of one, how many more would fit) are in GetStatus as it sent them; a worker without
    slots reports zeros."""
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "gpu", slots=4).start()
    assert worker.call is not None
    memory = common_pb2.MemoryStats(
        device="cuda",
        allocated_bytes=9,
        baseline_bytes=8,
        kv_slots=4,
        kv_slot_tokens=5120,
        kv_slot_bytes=754_974_720,
        kv_slots_more=37,
    )
    report = scheduler_pb.WorkerReport(health=common_pb2.WORKER_HEALTH_SERVING, memory=memory)
    await worker.call.write(scheduler_pb.RegisterRequest(report=report))
    plain = await WorkerStream(harness.stub, "cpu", slots=1).start()
    deadline = asyncio.get_running_loop().time() + scaled(5)
    while True:
        status = await harness.stub.GetStatus(scheduler_pb.GetStatusRequest())
        by_id = {w.worker_id: w for w in status.workers}
        memory = by_id["gpu"].memory
        if memory.kv_slots or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    assert (memory.kv_slots, memory.kv_slot_tokens) == (4, 5120)
    assert (memory.kv_slot_bytes, memory.kv_slots_more) == (754_974_720, 37)
    assert by_id["cpu"].memory.kv_slots == 0
    await worker.close()
    await plain.close()
