"""Generated-stub contract tests: every RPC against the real services (G1, G2)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc
from tests.conftest import scaled
from tests.stack import Stack

PCM = np.zeros(16000, "<f4").tobytes()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "2", "--compute-ms", "5", name="w0")
        s.start_edge()
        yield s
    finally:
        s.stop()


async def next_msg(call):
    msg = await asyncio.wait_for(call.read(), scaled(10))
    assert msg is not grpc.aio.EOF
    return msg


async def test_health_of_every_service(stack):
    worker_address = None
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        status = await scheduler_grpc.SchedulerServiceStub(ch).GetStatus(scheduler_pb.GetStatusRequest())
        worker_address = status.workers[0].address
    for address, service in (
        (stack.scheduler_address, "omni.realtime.v1.SchedulerService"),
        (worker_address, "omni.realtime.v1.WorkerService"),
        (stack.grpc_address, "omni.realtime.v1.RealtimeService"),
    ):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=scaled(5))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, (address, name)


async def test_scheduler_get_status(stack):
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        status = await scheduler_grpc.SchedulerServiceStub(ch).GetStatus(scheduler_pb.GetStatusRequest())
    [w] = status.workers
    assert w.worker_id == "w0" and w.slots == 2 and w.engine == "synthetic"
    assert w.health == common_pb2.WORKER_HEALTH_SERVING
    assert common_pb2.MODE_AUDIO in w.modes and common_pb2.MODE_VIDEO in w.modes
    assert status.queue_max == 100


async def test_scheduler_register_stream(stack):
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        call = stub.Register()
        await call.write(scheduler_pb.RegisterRequest(hello=scheduler_pb.WorkerHello(
            worker_id="contract-fake", address="127.0.0.1:1", slots=1,
            modes=[common_pb2.MODE_CHAT], engine="none", health=common_pb2.WORKER_HEALTH_NOT_SERVING)))
        reply = await next_msg(call)
        assert reply.WhichOneof("kind") == "registered" and reply.registered.worker_id == "contract-fake"
        status = await stub.GetStatus(scheduler_pb.GetStatusRequest())
        assert "contract-fake" in {w.worker_id for w in status.workers}
        call.cancel()
        deadline = asyncio.get_running_loop().time() + scaled(5)
        while "contract-fake" in {w.worker_id for w in status.workers}:
            assert asyncio.get_running_loop().time() < deadline, status
            await asyncio.sleep(0.02)
            status = await stub.GetStatus(scheduler_pb.GetStatusRequest())


async def test_acquire_errors(stack):
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        for mode, code in ((common_pb2.MODE_UNSPECIFIED, grpc.StatusCode.INVALID_ARGUMENT),):
            call = stub.Acquire(scheduler_pb.AcquireRequest(mode=mode, session_id="x"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == code


async def test_acquire_then_worker_session(stack):
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        acquire = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id="c1"))
        msg = await next_msg(acquire)
        assert msg.WhichOneof("kind") == "lease"
        lease = msg.lease
        assert lease.worker_id == "w0" and lease.lease_id
        async with grpc.aio.insecure_channel(lease.worker_address) as wch:
            wstub = worker_grpc.WorkerServiceStub(wch)
            bad = wstub.Session()
            await bad.write(worker_pb.SessionRequest(start=worker_pb.SessionStart(
                lease_id="not-a-lease", session_id="c0", mode=common_pb2.MODE_AUDIO)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(bad.read(), scaled(10))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

            call = wstub.Session()
            await call.write(worker_pb.SessionRequest(start=worker_pb.SessionStart(
                lease_id=lease.lease_id, session_id="c1", mode=common_pb2.MODE_AUDIO,
                system_prompt="contract")))
            started = await next_msg(call)
            assert started.WhichOneof("kind") == "started" and started.started.prompt_length > 0
            await call.write(worker_pb.SessionRequest(unit=worker_pb.Unit(seq=1, pcm=PCM)))
            result = await next_msg(call)
            assert result.WhichOneof("kind") == "result"
            assert result.result.seq == 1 and result.result.is_listen
            assert result.result.timings.wall_clock_ms > 0 and result.result.kv_cache_length > 0
            await call.write(worker_pb.SessionRequest(
                close=worker_pb.SessionClose(reason=common_pb2.CLOSE_REASON_USER_STOP)))
            ended = await next_msg(call)
            assert ended.WhichOneof("kind") == "ended"
            assert ended.ended.reason == common_pb2.CLOSE_REASON_USER_STOP
            assert ended.ended.units_served == 1
        acquire.cancel()


async def test_realtime_service_connect(stack):
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = rt_grpc.RealtimeServiceStub(ch)
        call = stub.Connect()
        await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(
            mode=common_pb2.MODE_AUDIO, system_prompt="internal client")))
        kinds = []
        while True:
            msg = await next_msg(call)
            kinds.append(msg.WhichOneof("kind"))
            if kinds[-1] == "created":
                break
        assert kinds[-2:] == ["queue_done", "created"]
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=PCM)))
        out = await next_msg(call)
        assert out.WhichOneof("kind") == "output" and out.output.seq == 1 and out.output.is_listen
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=b"\x00" * 6)))
        err = await next_msg(call)
        assert err.WhichOneof("kind") == "error" and err.error.code == "invalid_payload"
        await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest(reason="done")))
        closed = await next_msg(call)
        assert closed.WhichOneof("kind") == "closed"
        assert closed.closed.reason == common_pb2.CLOSE_REASON_USER_STOP
        assert closed.closed.reason_text == "done"


async def test_realtime_service_rejects_bad_first_message(stack):
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        call = rt_grpc.RealtimeServiceStub(ch).Connect()
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=PCM)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), scaled(10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_worker_chat_under_a_chat_lease(stack):
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        acquire = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_CHAT, session_id="c"))
        lease = (await next_msg(acquire)).lease
        async with grpc.aio.insecure_channel(lease.worker_address) as wch:
            wstub = worker_grpc.WorkerServiceStub(wch)
            request = worker_pb.ChatRequest(
                lease_id=lease.lease_id,
                session_id="c",
                messages=[worker_pb.ChatMessage(role="user", parts=[worker_pb.ContentPart(text="hi")])],
            )
            request.tts.enabled = False
            responses = [r async for r in wstub.Chat(request, timeout=scaled(10))]
            kinds = [r.WhichOneof("kind") for r in responses]
            assert kinds[0] == "prefilled" and kinds[-1] == "done" and "delta" in kinds
            done = responses[-1].done
            assert done.text == "You said: hi" and done.reason == "turn_end"
            assert done.generated_tokens == 3 and done.usage.total_tokens > 0
            # The lease was for one turn: using it again is refused.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in wstub.Chat(request, timeout=scaled(10))]
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # A duplex lease is not a chat lease.
            request.lease_id = "unknown"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in wstub.Chat(request, timeout=scaled(10))]
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        acquire.cancel()


async def test_worker_memory_reaches_the_scheduler_status(stack):
    """Memory after warm-up and after each session's cleanup is exported through the
    registration stream into GetStatus (device, bytes held, baseline, cleanups)."""
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        status = await stub.GetStatus(scheduler_pb.GetStatusRequest())
        before = status.workers[0].memory
        assert status.workers[0].HasField("memory") and before.device == "cpu"
        assert before.baseline_bytes > 0 and before.allocated_bytes > 0
        acquire = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id="m"))
        lease = (await next_msg(acquire)).lease
        async with grpc.aio.insecure_channel(lease.worker_address) as wch:
            call = worker_grpc.WorkerServiceStub(wch).Session()
            await call.write(worker_pb.SessionRequest(start=worker_pb.SessionStart(
                lease_id=lease.lease_id, session_id="m", mode=common_pb2.MODE_AUDIO)))
            await next_msg(call)
            await call.write(worker_pb.SessionRequest(
                close=worker_pb.SessionClose(reason=common_pb2.CLOSE_REASON_USER_STOP)))
            assert (await next_msg(call)).WhichOneof("kind") == "ended"
        acquire.cancel()
        deadline = asyncio.get_running_loop().time() + scaled(5)
        while (
            memory := (await stub.GetStatus(scheduler_pb.GetStatusRequest())).workers[0].memory
        ).cleanups <= before.cleanups:
            assert asyncio.get_running_loop().time() < deadline, memory
            await asyncio.sleep(0.02)
        assert memory.cleanups == before.cleanups + 1
        assert memory.before_cleanup_bytes > 0


async def test_oversized_messages_are_resource_exhausted(stack):
    """G6: over the explicit limits (scheduler 8 MiB, worker 16 MiB) a call fails with
    RESOURCE_EXHAUSTED, and each server goes on serving the next call."""
    audio = common_pb2.MODE_AUDIO
    over_8_mib = "x" * (8 * 1024 * 1024 + 1)
    async with grpc.aio.insecure_channel(stack.scheduler_address) as ch:
        stub = scheduler_grpc.SchedulerServiceStub(ch)
        call = stub.Acquire(scheduler_pb.AcquireRequest(mode=audio, session_id=over_8_mib))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), scaled(10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        register = stub.Register()
        hello = scheduler_pb.WorkerHello(worker_id="huge", address=over_8_mib, slots=1)
        await register.write(scheduler_pb.RegisterRequest(hello=hello))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(register.read(), scaled(10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        over_16_mib = b"\0" * (16 * 1024 * 1024 + 4)
        for session_id, pcm, ok in (("g6", over_16_mib, False), ("g6b", PCM, True)):
            acquire = stub.Acquire(scheduler_pb.AcquireRequest(mode=audio, session_id=session_id))
            lease = (await next_msg(acquire)).lease
            async with grpc.aio.insecure_channel(lease.worker_address) as wch:
                call = worker_grpc.WorkerServiceStub(wch).Session()
                start = worker_pb.SessionStart(
                    lease_id=lease.lease_id, session_id=session_id, mode=audio
                )
                await call.write(worker_pb.SessionRequest(start=start))
                assert (await next_msg(call)).WhichOneof("kind") == "started"
                await call.write(worker_pb.SessionRequest(unit=worker_pb.Unit(seq=1, pcm=pcm)))
                if ok:  # the worker serves the session after the oversized one
                    assert (await next_msg(call)).WhichOneof("kind") == "result"
                    call.cancel()
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await asyncio.wait_for(call.read(), scaled(10))
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            acquire.cancel()
