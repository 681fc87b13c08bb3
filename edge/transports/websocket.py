"""WebSocket transport: one client connection under the edge's keepalive, its messages
received in order and sent through its bounded Outbox (edge.outbox)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from edge.config import EdgeConfig
from edge.errors import EdgeError
from edge.outbox import Outbox


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

    def bind(
        self, on_overflow: Callable[[], None], render_error: Callable[[EdgeError], Any]
    ) -> None:
        self.outbox = Outbox.sized_by(self.config, self.ws, on_overflow, render_error)

    async def receive(self) -> str | bytes | None:
        try:
            return await self.ws.recv()
        except ConnectionClosed:
            return None

    def send(self, message: dict[str, Any]) -> None:
        assert self.outbox is not None
        self.outbox.send(message)

    def close(self, code: int, reason: str) -> None:
        assert self.outbox is not None
        self.outbox.close(code, reason)

    async def finish(self) -> None:
        if self.outbox is not None:
            await self.outbox.finish(finish_timeout_s(self.config))
