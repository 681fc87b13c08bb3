"""Starts a worker: engine, gRPC server (WorkerService + grpc.health.v1), registration.

Health is NOT_SERVING until the engine served one real unit (warm-up), and again from the
start of a drain.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omnifabric.common import listen
from omnifabric.common.interceptors import ErrorInterceptor
from omnifabric.common.tls import channel_credentials, server_credentials
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.engine import Engine
from omnifabric.worker.engines.registry import load_engine
from omnifabric.worker.registration import Registration
from omnifabric.worker.runtime import Health, WorkerRuntime
from omnifabric.worker.service import WorkerServicer, status_for

log = logging.getLogger("omnifabric.worker")

#: Time the server gives RPCs to flush after the sessions ended in-band on drain.
FLUSH_GRACE_S = 1.0
#: Health service names this worker answers for.
HEALTH_SERVICES = ("", "omni.realtime.v1.WorkerService")


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Server options: explicit message limits (larger: RESOURCE_EXHAUSTED); accept the
    edge's keepalive pings; ping idle edges; an exclusive port."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.ping_timeout_ms", 5000),
        # gRPC shares ports (SO_REUSEPORT) by default: a second worker on the same port
        # would take half of the edges' sessions. Fail to bind instead.
        ("grpc.so_reuseport", 0),
    ]


class RunningWorker:
    """A started worker: its port and id, readiness, and drain."""

    def __init__(
        self,
        config: WorkerConfig,
        runtime: WorkerRuntime,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        registration: Registration,
        port: int,
        address: str,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.server = server
        self.health_servicer = health_servicer
        self.registration = registration
        self.port = port
        self.address = address
        """host:port advertised to the scheduler."""
        self.worker_id = config.worker_id
        self._warmup: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def serving(self) -> bool:
        return self.runtime.health.serving

    async def wait_warm(self) -> None:
        """Until the warm-up unit has run (raises what the warm-up raised)."""
        if self._warmup is not None:
            await asyncio.shield(self._warmup)

    async def wait_ready(self) -> None:
        """Until warmed up (SERVING) and registered with the scheduler."""
        await self.wait_warm()
        await self.registration.registered.wait()

    async def drain_and_stop(self, grace: float | None = None) -> None:
        """NOT_SERVING (health and scheduler), end open sessions in-band with
        SERVER_SHUTDOWN within `grace` s (default drain_grace_s), then stop everything."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.drain_grace_s if grace is None else grace
        if self._warmup is not None and not self._warmup.done():
            self._warmup.cancel()
        await self.runtime.drain(grace)
        # Sessions have ended in-band; this short grace lets their `ended` reach the edges
        # without waiting on long-lived calls such as health watches.
        await self.server.stop(FLUSH_GRACE_S)
        # Lease releases queued by the drain must reach the scheduler: wait for it to end
        # the stream (usually milliseconds), never longer than the grace.
        await self.registration.stop(flush_timeout=max(1.0, grace))
        self.runtime.shutdown()
        log.info("worker %s stopped", self.worker_id)


async def start_worker(config: WorkerConfig, engine: Engine | None = None) -> RunningWorker:
    """Load the engine (or use `engine`), serve on host:port, register, warm up in the
    background (see RunningWorker.wait_ready). Raises EngineUnavailable, OSError."""
    loop = asyncio.get_running_loop()
    if engine is None:
        engine = await loop.run_in_executor(None, load_engine, config.engine, config)
    runtime = WorkerRuntime(config, engine)

    health_servicer = health.aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_health(state: Health) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICES:
            asyncio.ensure_future(health_servicer.set(name, status))

    runtime.health_listeners.append(on_health)

    credentials = server_credentials(
        config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key
    )
    server = grpc.aio.server(
        options=server_options(config.max_message_bytes),
        interceptors=[ErrorInterceptor(status_for, log)],
    )
    worker_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(runtime, config.worker_id), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = listen.add_port(server, config.host, config.port, credentials)
    await server.start()
    address = config.advertise_address or listen.target(listen.dial_host(config.host), port)

    registration = Registration(
        runtime,
        config.worker_id,
        address,
        credentials=channel_credentials(
            config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key
        ),
    )
    registration.start()
    worker = RunningWorker(config, runtime, server, health_servicer, registration, port, address)
    worker._warmup = asyncio.ensure_future(_warm(runtime))
    log.info(
        "worker %s listening on %s (engine %s, %d slots, %s), advertised as %s",
        config.worker_id,
        listen.target(config.host, port),
        engine.name,
        runtime.slots,
        "plaintext"
        if credentials is None
        else "TLS" + (", client certificates required" if config.fabric_tls_ca else ""),
        address,
    )
    return worker


async def _warm(runtime: WorkerRuntime) -> None:
    try:
        await runtime.warmup()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("engine warm-up failed")
        runtime.set_health(False, "warm-up failed")
        raise
