"""The scheduler's grpc.aio server: SchedulerService plus the standard health service."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.service import SchedulerServicer

log = logging.getLogger(__name__)

#: Full name of the service, as the health service knows it.
SERVICE_NAME = scheduler_pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name

#: Largest message either way; status snapshots are the biggest and stay far below.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# Clients ping every few seconds to notice a dead scheduler quickly; the server must
# accept those pings (even without calls in flight) instead of answering GOAWAY.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # The server pings too: a hung worker (SIGSTOP, stuck kernel) stops acking, its
    # Register stream breaks within ~4 s and its leases end (RELIABILITY.md F2).
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class RunningScheduler:
    """A started server: its bound port, core state and health service."""

    server: grpc.aio.Server
    scheduler: Scheduler
    health: health.aio.HealthServicer
    host: str
    port: int

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the server and SchedulerService."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop; open streams get `grace` seconds to finish."""
        await self.set_serving(False)
        await self.server.stop(grace)
        log.info("scheduler stopped")

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(config: SchedulerConfig) -> RunningScheduler:
    """Bind host:port (0: any free port), start serving and report SERVING."""
    scheduler = Scheduler(config)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    scheduler_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(scheduler), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{_host_for_bind(config.host)}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    await server.start()
    running = RunningScheduler(server, scheduler, health_servicer, config.host, port)
    await running.set_serving(True)
    log.info("scheduler listening on %s:%d", config.host, port)
    return running


def _host_for_bind(host: str) -> str:
    # IPv6 literals need brackets in a target string.
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
