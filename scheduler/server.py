"""The scheduler's grpc.aio server: SchedulerService plus the standard health service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omnifabric.common import listen
from omnifabric.common.interceptors import ErrorInterceptor
from omnifabric.common.tls import server_credentials
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import Scheduler
from omnifabric.scheduler.election import Elector, RedisElector, Term, parse_store_url
from omnifabric.scheduler.errors import SOURCE_METADATA, status_for
from omnifabric.scheduler.service import SchedulerServicer

log = logging.getLogger(__name__)

#: Full name of the service, as the health service knows it.
SERVICE_NAME = scheduler_pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name

#: Largest message either way by default (status snapshots are the biggest and stay far
#: below); OMNI_SCHEDULER_MAX_MESSAGE_BYTES changes it.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Message limits, keepalive, and an exclusive port."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Clients ping every few seconds to notice a dead scheduler quickly; the server
        # must accept those pings (even without calls in flight) instead of answering GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # The server pings too, as the backstop for a peer whose connection died without a
        # reset (a hung edge's Acquire streams end within ~15 s). A hung worker is the
        # watchdog's (scheduler.liveness: 3 s of silence net of the scheduler's own stalls,
        # RELIABILITY.md F2). The timeout is long because a stalled scheduler reads no ack
        # either: at 2 s, a full garbage collection of a 1,000-worker fleet (~5 s measured
        # at 57,600 sessions, issue 55) ended every worker's registration at once.
        ("grpc.keepalive_time_ms", 5_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.ping_timeout_ms", 10_000),
        # gRPC shares ports (SO_REUSEPORT) by default: a second scheduler started on the
        # same port would silently split the workers and the queue. Fail to bind instead.
        ("grpc.so_reuseport", 0),
    ]


@dataclass
class RunningScheduler:
    """A started server: its bound port, core state and health service."""

    server: grpc.aio.Server
    scheduler: Scheduler
    health: health.aio.HealthServicer
    host: str
    port: int
    elector: Elector | None = None
    """The election this scheduler takes part in (--ha); None: it leads alone."""
    watch: asyncio.Task[None] | None = None
    """The scheduler's pulse and workers' watchdog (Scheduler.watch), while it serves."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def on_leadership(self, leading: bool, term: Term | None) -> None:
        """The election's listener: lead or stand by, and report health to match."""
        if leading and term is not None:
            self.scheduler.lead(term.epoch, term.holder)
        else:
            self.scheduler.follow(term.holder if term else "", term.epoch if term else 0)
        task = asyncio.ensure_future(self.set_serving(self.scheduler.leadership.leads()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        if self.elector is not None:
            await self.elector.stop(release=True)
        await self.set_serving(False)
        await self.server.stop(grace)
        await self._stop_watch()
        log.info("scheduler stopped")

    async def drain(self, grace: float) -> None:
        """NOT_SERVING at once; refuse new requests and tell the queued ones (UNAVAILABLE);
        end the lease holders' and workers' streams without ending any lease, so running
        sessions go on with their workers; then stop, giving open RPCs `grace` seconds.
        A leader releases the election's key first: the standby takes over at once, and the
        workers and lease holders move to it."""
        if self.elector is not None:
            await self.elector.stop(release=True)
        await self.set_serving(False)
        self.scheduler.drain()
        await self.server.stop(grace)
        await self._stop_watch()
        log.info("scheduler drained and stopped")

    async def _stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watch
            self.watch = None

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(config: SchedulerConfig) -> RunningScheduler:
    """Bind host:port (0: any free port), start serving and report SERVING."""
    credentials = server_credentials(
        config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key
    )
    scheduler = Scheduler(config)
    server = grpc.aio.server(
        options=server_options(config.max_message_bytes),
        interceptors=[ErrorInterceptor(status_for, log, SOURCE_METADATA)],
    )
    scheduler_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(scheduler), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = listen.add_port(server, config.host, config.port, credentials)
    await server.start()
    running = RunningScheduler(server, scheduler, health_servicer, config.host, port)
    running.watch = asyncio.ensure_future(scheduler.watch())
    if config.ha is None:
        await running.set_serving(True)
    else:
        # A standby until the election says otherwise.
        holder = f"{listen.target(config.host, port)}#{secrets.token_hex(4)}"
        elector = RedisElector(parse_store_url(config.ha), holder, config.ha_ttl_s)
        leadership = scheduler.leadership
        leadership.standby = True
        leadership.term_valid = lambda: elector.leading
        leadership.store_problem = elector.store_problem
        elector.listeners.append(running.on_leadership)
        running.elector = elector
        await running.set_serving(False)
        await elector.start()
        log.info(
            "standby as %s; election store %s, TTL %.1f s",
            holder,
            elector.address.describe(),
            config.ha_ttl_s,
        )
    log.info(
        "scheduler listening on %s:%d (%s)",
        config.host,
        port,
        "plaintext"
        if credentials is None
        else "TLS" + (", client certificates required" if config.fabric_tls_ca else ""),
    )
    return running
