"""Test clients on real streams: a worker's Register stream and a holder's Acquire stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import scaled


async def announce(worker: Any) -> None:
    """Play a core-level worker's Register stream: pass every grant in its outbox on (as the
    stream would), for tests that drive scheduler.core.Scheduler without gRPC."""
    from omnifabric.scheduler.leases import LeaseGrantNotice

    while True:
        notice = await worker.outbox.get()
        if isinstance(notice, LeaseGrantNotice):
            notice.lease.announced.set()


#: Default wait for one expected message.
STEP_S = 2.0


class WorkerStream:
    """A worker as the scheduler sees it: a Register stream opened through the stub."""

    def __init__(
        self,
        stub: scheduler_grpc.SchedulerServiceStub,
        worker_id: str,
        *,
        slots: int = 1,
        modes: Iterable[int] = (common_pb2.MODE_AUDIO,),
        health: int = common_pb2.WORKER_HEALTH_SERVING,
        active_lease_ids: Iterable[str] = (),
        order: list[tuple[str, str]] | None = None,
        limits: common_pb2.EngineLimits | None = None,
    ) -> None:
        self.stub = stub
        self.worker_id = worker_id
        self.address = f"127.0.0.1:{22400 + abs(hash(worker_id)) % 1000}"
        self.hello = scheduler_pb.WorkerHello(
            worker_id=worker_id,
            address=self.address,
            slots=slots,
            modes=list(modes),
            engine="synthetic",
            health=health,
            active_lease_ids=list(active_lease_ids),
            limits=limits,
        )
        self.messages: asyncio.Queue[scheduler_pb.RegisterResponse] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.order = order
        self.call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> WorkerStream:
        """Send hello and wait for `registered`."""
        self.call = self.stub.Register()
        await self.call.write(scheduler_pb.RegisterRequest(hello=self.hello))
        first = await asyncio.wait_for(self.call.read(), scaled(STEP_S))
        assert first.WhichOneof("kind") == "registered", first
        assert first.registered.worker_id == self.worker_id
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.call is not None
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                if self.order is not None:
                    self.order.append(("worker", message.WhichOneof("kind")))
                self.messages.put_nowait(message)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            self.ended.set()

    async def expect(self, kind: str, timeout: float = STEP_S) -> scheduler_pb.RegisterResponse:
        """The next message from the scheduler, which must be of `kind`."""
        message = await asyncio.wait_for(self.messages.get(), scaled(timeout))
        assert message.WhichOneof("kind") == kind, message
        return message

    async def expect_nothing(self, seconds: float = 0.2) -> None:
        """No message arrives within `seconds` (a short, deliberate negative check)."""
        try:
            message = await asyncio.wait_for(self.messages.get(), scaled(seconds))
        except TimeoutError:
            return
        raise AssertionError(f"unexpected message to worker: {message}")

    async def release(self, lease_id: str) -> None:
        assert self.call is not None
        await self.call.write(
            scheduler_pb.RegisterRequest(
                lease_released=scheduler_pb.LeaseReleased(lease_id=lease_id)
            )
        )

    async def report(self, health: int, detail: str = "") -> None:
        assert self.call is not None
        await self.call.write(
            scheduler_pb.RegisterRequest(
                report=scheduler_pb.WorkerReport(health=health, detail=detail)
            )
        )

    async def revoke_and_release(self, lease_id: str) -> None:
        """Wait for the revocation of `lease_id` and answer it."""
        revoked = await self.expect("lease_revoked")
        assert revoked.lease_revoked.lease_id == lease_id
        await self.release(lease_id)

    def cancel(self) -> None:
        """Drop the stream, as a dying worker process would."""
        assert self.call is not None
        self.call.cancel()

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self._reader is not None:
            await asyncio.wait_for(self.ended.wait(), scaled(STEP_S))


class Holder:
    """An edge holding (or waiting for) a lease: one Acquire stream."""

    def __init__(
        self,
        stub: scheduler_grpc.SchedulerServiceStub,
        mode: int = common_pb2.MODE_AUDIO,
        session_id: str = "",
        order: list[tuple[str, str]] | None = None,
        **fields: Any,
    ) -> None:
        """`fields`: more AcquireRequest fields (resume, key limits)."""
        request = scheduler_pb.AcquireRequest(mode=mode, session_id=session_id, **fields)
        self.call = stub.Acquire(request)
        self.order = order

    async def next(self, timeout: float = STEP_S) -> scheduler_pb.AcquireResponse:
        """The next message; fails on EOF or timeout."""
        message = await asyncio.wait_for(self.call.read(), scaled(timeout))
        assert message is not grpc.aio.EOF, "Acquire stream ended"
        if self.order is not None:
            self.order.append(("holder", message.WhichOneof("kind")))
        return message

    async def expect(self, kind: str, timeout: float = STEP_S) -> scheduler_pb.AcquireResponse:
        message = await self.next(timeout)
        assert message.WhichOneof("kind") == kind, message
        return message

    async def expect_lease(self, timeout: float = STEP_S) -> scheduler_pb.Lease:
        """Skip queue updates until the lease arrives."""
        while True:
            message = await self.next(timeout)
            if message.WhichOneof("kind") == "lease":
                return message.lease
            assert message.WhichOneof("kind") == "queued", message

    async def expect_position(
        self, position: int, timeout: float = STEP_S
    ) -> scheduler_pb.QueuePosition:
        """Skip updates until one reports `position`."""
        while True:
            message = await self.expect("queued", timeout)
            if message.queued.position == position:
                return message.queued

    async def expect_end(self, timeout: float = STEP_S) -> None:
        """The stream ends with OK."""
        message = await asyncio.wait_for(self.call.read(), scaled(timeout))
        assert message is grpc.aio.EOF, message
        assert await self.call.code() == grpc.StatusCode.OK

    async def error(self, timeout: float = STEP_S) -> grpc.aio.AioRpcError:
        """The status error the stream ends with."""
        try:
            while True:
                message = await asyncio.wait_for(self.call.read(), scaled(timeout))
                assert message is not grpc.aio.EOF, "stream ended without an error"
        except grpc.aio.AioRpcError as exc:
            return exc

    def cancel(self) -> None:
        self.call.cancel()
