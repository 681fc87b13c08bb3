"""Flow control of one WebSocket client: a bounded outbound queue and the keepalive.

Session code never awaits the client's socket: events are written at once when the socket
has taken everything before them (one unit's events in one system call), else they go into
the connection's `Outbox` and one sender task writes them out once the socket drains. A
client that stops reading fills the outbox, not the edge's memory: past its bound the
connection closes with `slow_client` (1008). The keepalive drops a client whose pong does
not come in time, also when the ping itself cannot be written because the client's buffers
are full (websockets' own keepalive waits for the buffers to drain before it starts its
timeout, so it never fires then).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from omnifabric.edge import codec
from omnifabric.edge.errors import EdgeError, SlowClient

log = logging.getLogger("omnifabric.edge.outbox")


def text_frame_header(size: int) -> bytes:
    """The header of a server's unmasked, unfragmented WebSocket text frame of `size`
    payload bytes (RFC 6455 5.2: FIN and opcode 1, then the length in 7, 7+16 or 7+64
    bits)."""
    if size < 126:
        return bytes((0x81, size))
    if size < 1 << 16:
        return struct.pack("!BBH", 0x81, 126, size)
    return struct.pack("!BBQ", 0x81, 127, size)


async def cut_off(ws: ServerConnection, code: int, reason: str) -> None:
    """End a connection whose client does not answer: the close frame if the socket still
    takes it, then the TCP connection at once (no close handshake to wait for)."""
    closing = asyncio.ensure_future(ws.close(code, reason))
    # One loop turn lets the close task write its frame before the transport goes.
    await asyncio.sleep(0)
    ws.transport.abort()
    await asyncio.gather(closing, return_exceptions=True)


async def keepalive(ws: ServerConnection, interval_s: float, timeout_s: float) -> None:
    """Ping every interval_s; no pong within timeout_s (writing the ping included): close
    1011 and drop the connection. Returns when the connection closes."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            async with asyncio.timeout(timeout_s):
                pong = await ws.ping()
                await pong
        except TimeoutError:
            log.warning("client answered no ping within %.1fs: connection dropped", timeout_s)
            await cut_off(ws, 1011, "keepalive ping timeout")
            return
        except ConnectionClosed:
            return


class Outbox:
    """Events to one client, sent in order by one task; bounded in events and in bytes.

    `send` and `close` never block. One event always fits an empty queue, so the byte
    bound limits the backlog, not the size of an event.
    """

    def __init__(
        self,
        ws: ServerConnection,
        max_events: int,
        max_bytes: int,
        close_grace_s: float,
        on_overflow: Callable[[], None] | None,
        render_error: Callable[[EdgeError], dict[str, Any]],
    ) -> None:
        self.ws = ws
        self.render_error = render_error
        """The endpoint's own error message shape (legacy endpoints carry a plain string)."""
        self.on_overflow = on_overflow
        """Called once on overflow: the session ends there, not at the close handshake."""
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.close_grace_s = close_grace_s
        self.overflowed = False
        self._items: deque[bytes | tuple[int, str]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self._closing = False
        """A close is queued: later events are dropped."""
        self._finishing = False
        """The connection is over: the sender stops once the queue is empty."""
        self._sending = False
        """The sender task is writing an event (later ones wait for it, in order)."""
        self._sender = asyncio.create_task(self._run())

    @classmethod
    def sized_by(
        cls,
        config: Any,
        ws: ServerConnection,
        on_overflow: Callable[[], None] | None,
        render_error: Callable[[EdgeError], dict[str, Any]],
    ) -> Outbox:
        """An Outbox bounded as the edge's config says (OMNI_EDGE_OUTBOUND_QUEUE_*)."""
        return cls(
            ws,
            config.outbound_queue_max,
            config.outbound_queue_bytes,
            config.ws_close_timeout_s,
            on_overflow,
            render_error,
        )

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def send(self, event: dict[str, Any]) -> None:
        """Queue one event; on overflow the queue is replaced by slow_client and a close."""
        self.send_all((event,))

    def send_all(self, events: Sequence[dict[str, Any]]) -> None:
        """Queue events in order (one unit's output, say): when the socket has taken
        everything before, they go out at once in one write. A batch over the byte bound
        (a resume's replay) goes one event at a time, each at once while the socket takes
        them. On overflow the queue is replaced by slow_client and a close."""
        if self._closing:
            return
        texts = [codec.dumps(event) for event in events]
        if (
            not self._items
            and sum(len(text) for text in texts) <= self.max_bytes
            and self._write_now(texts)
        ):
            return
        for text in texts:
            if self._closing:
                return
            if not self._items and self._write_now([text]):
                continue
            if self._items and (
                len(self._items) >= self.max_events or self._bytes + len(text) > self.max_bytes
            ):
                self._overflow()
                return
            self._items.append(text)
            self._bytes += len(text)
        self._ready.set()

    def _write_now(self, texts: list[bytes]) -> bool:
        """Write the events at once when nothing is waiting or being written and the socket
        has taken everything before (the common case): no task switch, no loop turn, and
        one system call for all of them. False leaves them to the sender task, which waits
        for the socket (flow control)."""
        ws = self.ws
        if self._sending or ws.send_in_progress is not None or ws.protocol.state is not State.OPEN:
            return False
        transport = ws.transport
        if transport.is_closing() or transport.get_write_buffer_size():
            return False
        protocol = ws.protocol
        if protocol.extensions:
            # permessage-deflate: websockets compresses and frames them.
            for text in texts:
                protocol.send_text(text)
            ws.send_data()
            return True
        # Plain text frames: a header before each payload, written as they are (websockets
        # would copy each payload into a new frame); whatever websockets has not written
        # yet (a pong) goes first.
        buffers = protocol.data_to_send()
        for text in texts:
            buffers.append(text_frame_header(len(text)))
            buffers.append(text)
        transport.writelines(buffers)
        return True

    def close(self, code: int, reason: str) -> None:
        """Close the connection once everything queued before was sent."""
        if self._closing:
            return
        self._closing = True
        self._items.append((code, reason))
        self._ready.set()

    async def finish(self, timeout_s: float) -> None:
        """Send what is queued (a queued close included), at most timeout_s, then stop the
        sender; a client that does not take it by then is cut off."""
        self._finishing = True
        self._ready.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._sender), timeout_s)
        except TimeoutError:
            self.ws.transport.abort()
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)

    def _overflow(self) -> None:
        self.overflowed = True
        log.warning(
            "client not reading: %d events (%d bytes) waiting, bound %d events / %d bytes: "
            "closing with 1008",
            len(self._items),
            self._bytes,
            self.max_events,
            self.max_bytes,
        )
        # What was queued is stale and is what costs memory: drop it, keep the reason.
        self._items.clear()
        self._bytes = 0
        err = SlowClient(
            f"the client is not reading: over {self.max_events} events or "
            f"{self.max_bytes} bytes were waiting to be sent"
        )
        self._items.append(codec.dumps(self.render_error(err)))
        self._items.append((1008, err.code))
        self._closing = True
        self._ready.set()
        # A client that cannot take even these two frames is cut off after the grace.
        asyncio.get_running_loop().call_later(self.close_grace_s, self._abort_if_open)
        if self.on_overflow is not None:
            self.on_overflow()

    def _abort_if_open(self) -> None:
        if not self._sender.done():
            self.ws.transport.abort()

    async def _run(self) -> None:
        try:
            while True:
                while not self._items:
                    if self._finishing:
                        return
                    self._ready.clear()
                    await self._ready.wait()
                item = self._items.popleft()
                if isinstance(item, tuple):
                    await self.ws.close(*item)
                    return
                self._bytes -= len(item)
                self._sending = True
                try:
                    await self.ws.send(item, text=True)  # UTF-8 JSON bytes, as a text frame
                finally:
                    self._sending = False
        except ConnectionClosed:
            pass
        finally:
            self._items.clear()
            self._bytes = 0
