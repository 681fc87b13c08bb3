"""Start and stop the edge: the WebSocket/HTTP server and the RealtimeService gRPC server."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from websockets.asyncio.server import Server

from omnifabric.common import listen
from omnifabric.common.tls import server_credentials
from omnifabric.edge.app import EdgeApp
from omnifabric.edge.apps import follow
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.connection import ChatConnection, DuplexConnection
from omnifabric.edge.fabric import Fabric, channel_options
from omnifabric.edge.metrics import METRICS, EdgeMetrics
from omnifabric.edge.transports.grpc import RealtimeServicer
from omnifabric.edge.transports.websocket import serve_port
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

log = logging.getLogger("omnifabric.edge")


@dataclass
class RunningEdge:
    """A started edge; `port`/`grpc_port` are the bound ports."""

    config: EdgeConfig
    app: EdgeApp
    ws_server: Server
    grpc_server: grpc.aio.Server | None
    health: health.HealthServicer | None
    port: int
    grpc_port: int

    servicer: RealtimeServicer | None = None
    follow_apps: asyncio.Task[None] | None = None
    """Reads the fabric's app switches from the scheduler (edge.apps.follow)."""

    @property
    def url(self) -> str:
        scheme = "wss" if self.config.tls_cert else "ws"
        return f"{scheme}://{listen.target(self.config.host, self.port)}/v1/realtime"

    async def drain_and_stop(self, grace_s: float | None = None) -> None:
        """Refuse new sessions, end open ones with server_shutdown within the grace
        (config.drain_grace_s by default), then stop both servers."""
        # First, before any await: /healthz answers 503 and new sessions get 503 from now.
        self.app.draining = True
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # Workers get most of the grace to confirm each end (with its usage); the rest is
        # for session.closed to reach the client and the close handshake.
        confirm_s = 0.8 * grace_s
        # Every transport's sessions: WebSocket, HTTP and gRPC alike.
        connections: list[DuplexConnection | ChatConnection] = [
            *self.app.connections,
            *self.app.chats,
        ]
        ending = [c.shutdown(confirm_s) for c in connections]
        if ending:
            log.info("drain: ending %d sessions (grace %.1fs)", len(connections), grace_s)
            await asyncio.gather(*ending, return_exceptions=True)
        finished = [asyncio.ensure_future(c.finished.wait()) for c in connections]
        if finished:
            _, pending = await asyncio.wait(finished, timeout=max(0.1, deadline - loop.time()))
            for waiter in pending:
                waiter.cancel()
            if pending:
                log.warning("drain: %d connections open at the end of the grace", len(pending))
        self.ws_server.close()
        try:
            # A client that never answers the close handshake must not hold the drain.
            await asyncio.wait_for(self.ws_server.wait_closed(), max(0.5, deadline - loop.time()))
        except TimeoutError:
            log.warning("drain: WebSocket connections still closing at the end of the grace")
        if self.grpc_server is not None:
            await self.grpc_server.stop(max(0.1, deadline - loop.time()))
        if self.follow_apps is not None:
            self.follow_apps.cancel()
            await asyncio.gather(self.follow_apps, return_exceptions=True)
        await self.app.fabric.close()


async def start_edge(config: EdgeConfig, metrics: EdgeMetrics = METRICS) -> RunningEdge:
    """Bind both servers and return once they accept connections; `metrics` is what the
    edge's sessions feed and GET /metrics serves (the process's own by default)."""
    tls = config.tls()
    fabric = Fabric(
        config.scheduler,
        config.grpc_max_message_bytes,
        tls_ca=config.fabric_tls_ca,
        tls_cert=config.fabric_tls_cert,
        tls_key=config.fabric_tls_key,
    )
    fabric.start()
    app = EdgeApp(config, fabric, metrics)
    if config.record_dir:  # opt-in recording: retention now, then hourly
        from omnifabric.edge.recording import start_retention

        start_retention(config)
    # WebSocket upgrades and POST /api/chat share the port (edge.transports.http).
    try:
        ws_server = await serve_port(app, app, config, tls)
    except OSError as exc:
        raise listen.cannot_listen(config.host, config.port, exc) from None
    port = ws_server.sockets[0].getsockname()[1]
    grpc_server = None
    health_servicer = None
    servicer = None
    grpc_port = -1
    if config.grpc_port >= 0:
        options = channel_options(config.grpc_max_message_bytes)
        # gRPC listens with SO_REUSEPORT unless told not to: only --reuse-port shares a port.
        options.append(("grpc.so_reuseport", int(config.reuse_port)))
        grpc_server = grpc.aio.server(options=options)
        servicer = RealtimeServicer(app)
        rt_grpc.add_RealtimeServiceServicer_to_server(servicer, grpc_server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        credentials = None
        if tls is not None:
            # The public port's certificate (config.tls() checked the pair); no client certs.
            credentials = server_credentials(None, config.tls_cert, config.tls_key)
            assert credentials is not None
        try:
            grpc_port = listen.add_port(grpc_server, config.host, config.grpc_port, credentials)
        except OSError:
            ws_server.close()  # the WebSocket port is already bound: give it back
            await ws_server.wait_closed()
            raise
        await grpc_server.start()
        for name in ("", "omni.realtime.v1.RealtimeService"):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    follow_apps = asyncio.create_task(follow(app.apps, fabric.scheduler))
    return RunningEdge(
        config, app, ws_server, grpc_server, health_servicer, port, grpc_port, servicer, follow_apps
    )
