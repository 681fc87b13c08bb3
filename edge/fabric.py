"""gRPC clients of the fabric: one channel to the scheduler, one per worker address."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from edge import events as ev
from edge.errors import QueueFull, ServiceUnavailable
from omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Keepalive and size limits for the edge's channels.

    Pings every 5 s with a 5 s timeout notice a dead or hung peer in ~10 s even when
    no unit is in flight (without them, a hung peer takes minutes to notice).
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 5000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.ping_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


class Fabric:
    """The edge's connections into the fabric, shared by all its sessions."""

    def __init__(self, scheduler_address: str, max_message_bytes: int) -> None:
        self._options = channel_options(max_message_bytes)
        self._scheduler_channel = grpc.aio.insecure_channel(scheduler_address, self._options)
        self.scheduler = scheduler_grpc.SchedulerServiceStub(self._scheduler_channel)
        self._workers: dict[str, tuple[grpc.aio.Channel, worker_grpc.WorkerServiceStub]] = {}

    def worker(self, address: str) -> worker_grpc.WorkerServiceStub:
        """The stub for a worker; channels are cached and multiplex all its sessions."""
        entry = self._workers.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address, self._options)
            entry = (channel, worker_grpc.WorkerServiceStub(channel))
            self._workers[address] = entry
        return entry[1]

    async def close(self) -> None:
        """Close every channel."""
        await self._scheduler_channel.close()
        for channel, _ in self._workers.values():
            await channel.close()
        self._workers.clear()


async def wait_for_lease(
    call: grpc.aio.UnaryStreamCall, on_queued: Callable[[ev.Queued], Awaitable[None]]
) -> scheduler_pb.Lease:
    """Read an Acquire stream until its lease, reporting queue positions via on_queued.

    The call stays open (the lease lives as long as it); on any error it is cancelled.
    Raises QueueFull or ServiceUnavailable.
    """
    first = True
    try:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise ServiceUnavailable("the scheduler ended the queue without a lease")
            kind = response.WhichOneof("kind")
            if kind == "queued":
                q = response.queued
                await on_queued(
                    ev.Queued(q.position, q.queue_length, q.estimated_wait_s, q.ticket_id, first)
                )
                first = False
            elif kind == "lease":
                return response.lease
            else:
                raise ServiceUnavailable("the worker was lost before the session started")
    except grpc.aio.AioRpcError as err:
        call.cancel()
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise QueueFull("the queue is full, try again later") from None
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            raise ServiceUnavailable(err.details() or "no worker available") from None
        raise ServiceUnavailable("the scheduler cannot be reached") from None
    except BaseException:
        call.cancel()
        raise
