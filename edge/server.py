"""Start and stop the edge: the WebSocket/HTTP server and the RealtimeService gRPC server."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from websockets.asyncio.server import Server, serve

from edge import events as ev
from edge.config import EdgeConfig
from edge.fabric import Fabric, channel_options
from edge.grpc_api import RealtimeServicer
from edge.http_api import connection_class
from edge.ws import EdgeApp
from omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

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

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}/v1/realtime"

    async def drain_and_stop(self, grace_s: float = 5.0) -> None:
        """Refuse new sessions, close open ones with server_shutdown, then stop."""
        self.app.draining = True
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        closing = [
            c.core.close(ev.SERVER_SHUTDOWN)
            for c in list(self.app.connections)
            if not c.core.closed.is_set()
        ]
        if closing:
            try:
                await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), grace_s)
            except TimeoutError:
                log.warning("drain: %d sessions still open after %.1fs", len(closing), grace_s)
        self.ws_server.close()
        try:
            # A client that never answers the close handshake must not hold the drain.
            await asyncio.wait_for(self.ws_server.wait_closed(), max(0.5, deadline - loop.time()))
        except TimeoutError:
            log.warning("drain: WebSocket connections still closing at the end of the grace")
        if self.grpc_server is not None:
            await self.grpc_server.stop(max(0.1, deadline - loop.time()))
        await self.app.fabric.close()


async def start_edge(config: EdgeConfig) -> RunningEdge:
    """Bind both servers and return once they accept connections."""
    fabric = Fabric(config.scheduler, config.grpc_max_message_bytes)
    app = EdgeApp(config, fabric)
    if config.record_dir:  # opt-in recording: retention now, then hourly
        from edge.recording import start_retention

        start_retention(config)
    ws_server = await serve(
        app.handler,
        config.host,
        config.port,
        select_subprotocol=_select,
        # None keeps clients without an Origin header (SDKs, scripts) allowed.
        origins=[*config.allowed_origins, None] if config.allowed_origins else None,
        process_request=app.process_request,
        # Audio frames barely compress and deflate costs ms per frame on each side.
        compression=None,
        max_size=config.max_frame_bytes,
        open_timeout=config.open_timeout_s,
        ping_interval=config.ping_interval_s,
        ping_timeout=config.ping_timeout_s,
        close_timeout=config.ws_close_timeout_s,
        # Also answers POST /api/chat on this port (websockets parses GET handshakes only).
        create_connection=connection_class(app),
    )
    port = ws_server.sockets[0].getsockname()[1]
    grpc_server = None
    health_servicer = None
    grpc_port = -1
    if config.grpc_port >= 0:
        grpc_server = grpc.aio.server(options=channel_options(config.grpc_max_message_bytes))
        rt_grpc.add_RealtimeServiceServicer_to_server(
            RealtimeServicer(fabric, config.worker_start_timeout_s, config.close_timeout_s),
            grpc_server,
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        grpc_port = grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        await grpc_server.start()
        for name in ("", "omni.realtime.v1.RealtimeService"):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningEdge(config, app, ws_server, grpc_server, health_servicer, port, grpc_port)


def _select(conn, offered):
    from edge.ws import select_subprotocol

    return select_subprotocol(conn, offered)
