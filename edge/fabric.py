"""gRPC clients of the fabric: one channel to the scheduler, one per worker address."""

from __future__ import annotations

import grpc

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
