"""WebSocket transport: the edge's WebSocket server on the port it shares with HTTP, and
one client connection as a driver's transport, its messages received in order and sent
through its bounded Outbox (edge.outbox).

The port's connections start in edge.transports.http.FrontProtocol; the upgrades it hands
over become websockets ServerConnections (its public sans-I/O ServerProtocol and
ServerConnection, under a websockets Server that closes them on shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.extensions.base import ServerExtensionFactory
from websockets.extensions.permessage_deflate import enable_server_permessage_deflate
from websockets.http11 import SERVER, Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Origin, Subprotocol

from omnifabric.common import listen
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.errors import EdgeError
from omnifabric.edge.outbox import Outbox
from omnifabric.edge.transports.http import FrontProtocol

log = logging.getLogger("omnifabric.edge.websocket")


def finish_timeout_s(config: EdgeConfig) -> float:
    """Longest a connection's last frames may take to go out: past it the keepalive would
    have dropped a client that does not read."""
    return config.ping_interval_s + config.ping_timeout_s + config.ws_close_timeout_s


class WebSocketTransport:
    """A websockets ServerConnection as a driver's transport (JSON text messages)."""

    input_end_closes = False
    """A WebSocket whose input ended is gone: nothing more can be sent."""

    def __init__(self, ws: ServerConnection, config: EdgeConfig) -> None:
        self.ws = ws
        self.config = config
        self.path = ws.request.path if ws.request is not None else ""
        self.outbox: Outbox | None = None
        self.owner = ""
        """The API key digest the connection was opened with ("" without keys): only
        it may resume the connection's session."""
        self.dropped = False
        """The input ended without the client's close frame (a lost network, a killed
        client, a keepalive timeout): a resumable session waits for a resume."""

    def bind(
        self, on_overflow: Callable[[], None], render_error: Callable[[EdgeError], Any]
    ) -> None:
        self.outbox = Outbox.sized_by(self.config, self.ws, on_overflow, render_error)

    async def receive(self) -> str | bytes | None:
        try:
            return await self.ws.recv()
        except ConnectionClosed as closed:
            self.dropped = closed.rcvd is None
            return None

    def send(self, message: dict[str, Any]) -> None:
        assert self.outbox is not None
        self.outbox.send(message)

    def send_all(self, messages: list[dict[str, Any]]) -> None:
        assert self.outbox is not None
        self.outbox.send_all(messages)

    def close(self, code: int, reason: str) -> None:
        assert self.outbox is not None
        self.outbox.close(code, reason)

    async def finish(self) -> None:
        if self.outbox is not None:
            await self.outbox.finish(finish_timeout_s(self.config))


class Upgrade(Protocol):
    """What the edge does with a WebSocket upgrade: check it before the handshake
    (`process_request`: health, routing, keys), pick the subprotocol, serve it (`handler`),
    and give back what `process_request` took once the connection is over (`released`)."""

    async def process_request(
        self, conn: ServerConnection, request: Request
    ) -> Response | None: ...

    def select_subprotocol(
        self, conn: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None: ...

    async def handler(self, conn: ServerConnection) -> None: ...

    def released(self, conn: ServerConnection) -> None: ...


#: Connections the kernel completes before the edge accepts them. asyncio's default (100)
#: overflows when a few hundred clients connect at once: Linux then drops the client's
#: final handshake ACK and the connection is established a SYN-ACK retransmit (1 s) later.
LISTEN_BACKLOG = 2048


def allowed_origins(config: EdgeConfig) -> list[Origin | None] | None:
    """The Origin headers a handshake may carry (None: any); a configured list also lets
    in a handshake that carries no Origin header."""
    if not config.allowed_origins:
        return None
    return [*map(Origin, config.allowed_origins), None]


def server_extensions(config: EdgeConfig) -> Sequence[ServerExtensionFactory] | None:
    """The WebSocket extensions offered. Off unless configured: audio frames barely
    compress and deflate costs milliseconds per frame on each side."""
    if config.ws_compression == "deflate":
        return enable_server_permessage_deflate(None)
    return None


class PortServer:
    """One listening port's setup, shared by all its connections: the listener
    (`create_server`), the switch of an upgrade from FrontProtocol to a websockets
    ServerConnection (`open_websocket`) and each connection's life (`run_connection`).
    `server` is the websockets Server built on the first and the last."""

    def __init__(
        self, context: Any, upgrade: Upgrade, config: EdgeConfig, tls: ssl.SSLContext | None
    ) -> None:
        self.context = context
        self.upgrade = upgrade
        self.config = config
        self.tls = tls
        self.server = Server(self.create_server, self.run_connection)
        self.origins = allowed_origins(config)
        self.extensions = server_extensions(config)

    async def create_server(self) -> asyncio.Server:
        """The asyncio listener: every accepted connection starts in FrontProtocol."""
        config = self.config
        loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {}
        if self.tls is not None:
            # Bounds the TLS handshake like the WebSocket one.
            kwargs.update(
                ssl=self.tls,
                ssl_handshake_timeout=config.open_timeout_s,
                ssl_shutdown_timeout=config.ws_close_timeout_s,
            )

        def factory() -> FrontProtocol:
            return FrontProtocol(self.context, self.open_websocket)

        if config.host in listen.IPV6_WILDCARDS:  # both families, as the gRPC port
            sock = listen.bound_socket(
                config.host, config.port, reuse_port=config.reuse_port, reuse_address=True
            )
            return await loop.create_server(factory, sock=sock, backlog=LISTEN_BACKLOG, **kwargs)
        return await loop.create_server(
            factory,
            config.host,
            config.port,
            backlog=LISTEN_BACKLOG,
            reuse_port=config.reuse_port,
            **kwargs,
        )

    async def run_connection(self, connection: ServerConnection) -> None:
        """One upgraded connection: the handshake within the open timeout, then the
        handler; the TCP connection is closed whatever happens."""
        server, upgrade = self.server, self.upgrade
        try:
            try:
                async with asyncio.timeout(self.config.open_timeout_s):
                    await connection.handshake(upgrade.process_request, None, SERVER)
                if connection.protocol.state is not State.OPEN:
                    connection.transport.abort()
                    return
                server.all_connections.add(connection)
                try:
                    async with connection:
                        await upgrade.handler(connection)
                except Exception:
                    log.error("connection handler failed", exc_info=True)
                finally:
                    server.all_connections.discard(connection)
            except Exception:
                # A handshake that timed out or failed: no connection is left behind.
                connection.transport.abort()
        finally:
            server.handler_tasks.discard(asyncio.current_task())
            upgrade.released(connection)

    def open_websocket(self, transport: asyncio.Transport, first: bytes) -> None:
        """Hand an upgrade's transport, and the bytes FrontProtocol read, to a new
        ServerConnection: that starts run_connection."""
        config, upgrade = self.config, self.upgrade
        connection: ServerConnection

        def select(_protocol: ServerProtocol, offered: Sequence[Subprotocol]) -> Subprotocol | None:
            return upgrade.select_subprotocol(connection, offered)

        protocol = ServerProtocol(
            origins=self.origins,
            select_subprotocol=select,
            extensions=self.extensions,
            max_size=config.max_frame_bytes,
        )
        connection = ServerConnection(
            protocol,
            self.server,
            # The edge runs its own keepalive (edge.outbox): websockets' waits for a full
            # send buffer to drain before timing the pong, so a client that stops reading
            # would never be dropped.
            ping_interval=None,
            close_timeout=config.ws_close_timeout_s,
            max_queue=config.inbound_queue_max,
        )
        transport.set_protocol(connection)
        connection.connection_made(transport)  # starts run_connection
        connection.data_received(first)


async def serve_port(
    context: Any, upgrade: Upgrade, config: EdgeConfig, tls: ssl.SSLContext | None
) -> Server:
    """Listen on config.host:config.port: HTTP requests with a body are served by
    FrontProtocol, WebSocket upgrades by `upgrade`. Returns the started websockets Server
    (its close() ends the WebSocket connections with 1001)."""
    return await PortServer(context, upgrade, config, tls).server
