"""gRPC transport: RealtimeService.Connect calls as driver transports.

Requests are read in order from the call; responses wait in a queue bounded like a
WebSocket client's outbox (`Outbound`), so a client that stops reading ends its call with
RESOURCE_EXHAUSTED `slow_client` instead of filling the edge's memory. A dialect's
Refusal ends the call with its status. Without a valid `authorization: Bearer KEY` (when
keys are configured) the call ends with UNAUTHENTICATED, and with RESOURCE_EXHAUSTED when
the key holds as many sessions as its limit; anything unexpected ends it with INTERNAL and
a generic text (the details stay in the log).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from omnifabric.common.calls import cancelled_soon
from omnifabric.edge.access import key_digest
from omnifabric.edge.connection import DuplexConnection
from omnifabric.edge.dialects import GRPC_CONNECT
from omnifabric.edge.dialects.base import Refusal
from omnifabric.edge.errors import EdgeError, SlowClient
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

if TYPE_CHECKING:
    from omnifabric.edge.app import EdgeApp

log = logging.getLogger("omnifabric.edge.grpc")

_END = object()
"""The end of the response stream (a clean end, status OK)."""


class Outbound:
    """Responses to one client, bounded in messages and serialized bytes.

    `put` never blocks. A client that stops reading stops the call's writes (HTTP/2 flow
    control), then fills this queue: past its bound the queue is dropped, `on_overflow`
    runs once and returns what ends the call, and `get` answers that from then on.
    """

    def __init__(self, max_messages: int, max_bytes: int, on_overflow: Callable[[], Any]) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.on_overflow = on_overflow
        self.overflowed = False
        self._last: Any = None
        self._items: deque[tuple[Any, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        """Queue one response, a Refusal or _END (either always fits, as one response
        always fits an empty queue)."""
        if self.overflowed:
            return
        size = item.ByteSize() if isinstance(item, rt_pb.ConnectResponse) else 0
        if (
            size
            and self._items
            and (len(self._items) >= self.max_messages or self._bytes + size > self.max_bytes)
        ):
            self._overflow()
            return
        self._items.append((item, size))
        self._bytes += size
        self._ready.set()

    async def get(self) -> Any:
        """The next response, a Refusal, or _END."""
        while not self._items and not self.overflowed:
            self._ready.clear()
            await self._ready.wait()
        if self.overflowed:
            return self._last
        item, size = self._items.popleft()
        self._bytes -= size
        return item

    def _overflow(self) -> None:
        log.warning(
            "gRPC client not reading: %d messages (%d bytes) waiting, bound %d messages / "
            "%d bytes: ending the call",
            len(self._items),
            self._bytes,
            self.max_messages,
            self.max_bytes,
        )
        self.overflowed = True
        # What was queued is what costs memory, and the client will not get it.
        self._items.clear()
        self._bytes = 0
        self._ready.set()
        self._last = self.on_overflow()


class GrpcTransport:
    """One Connect call: its request iterator in, an Outbound out."""

    input_end_closes = True
    """A half-closed call still reads: the session ends gracefully (client_closed)."""
    path = "grpc:RealtimeService/Connect"

    def __init__(
        self,
        requests: AsyncIterator[Any],
        max_messages: int,
        max_bytes: int,
        context: grpc.aio.ServicerContext | None = None,
    ) -> None:
        self._requests = requests
        self._context = context
        self._limits = (max_messages, max_bytes)
        self.out: Outbound | None = None
        self.owner = ""
        """The API key digest of the call ("" without keys): only it may resume."""
        self.dropped = False
        """The call was cancelled or lost (not half-closed): a resumable session waits."""

    def bind(
        self, on_overflow: Callable[[], None], render_error: Callable[[EdgeError], Any]
    ) -> None:
        max_messages, max_bytes = self._limits
        slow = SlowClient(
            f"the client is not reading: over {max_messages} messages or {max_bytes} bytes "
            "were waiting to be sent"
        )

        def overflowed() -> Any:
            ending = render_error(slow)
            on_overflow()
            return ending

        self.out = Outbound(max_messages, max_bytes, overflowed)

    async def receive(self) -> Any | None:
        try:
            message = await anext(self._requests, None)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self.dropped = True
            return None
        if message is None and self._context is not None:
            # A cancelled call ends its requests like a half-close: tell them apart.
            self.dropped = await cancelled_soon(self._context)
        return message

    def send(self, message: Any) -> None:
        assert self.out is not None
        self.out.put(message)

    def send_all(self, messages: list[Any]) -> None:
        for message in messages:
            self.send(message)

    def close(self, code: int, reason: str) -> None:
        assert self.out is not None
        self.out.put(_END)

    async def finish(self) -> None:
        if self.out is not None:
            self.out.put(_END)


def _authorization(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return ""


class RealtimeServicer(rt_grpc.RealtimeServiceServicer):
    """Connect: one DuplexConnection per call, in the gRPC dialect."""

    def __init__(self, app: EdgeApp) -> None:
        self.app = app

    async def Connect(
        self,
        request_iterator: AsyncIterator[rt_pb.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rt_pb.ConnectResponse]:
        app = self.app
        digest = key_digest(app.config, _authorization(context))
        if digest is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        if digest and not app.key_sessions.take(digest):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "this API key holds as many open sessions as its limit allows",
            )
        config = app.config
        transport = GrpcTransport(
            request_iterator, config.outbound_queue_max, config.outbound_queue_bytes, context
        )
        transport.owner = digest or ""
        connection = DuplexConnection(app, transport, GRPC_CONNECT.open("", {}, ""))
        runner = asyncio.create_task(connection.run())
        try:
            assert transport.out is not None
            while True:
                item = await transport.out.get()
                if item is _END:
                    break
                if isinstance(item, Refusal):
                    await context.abort(grpc.StatusCode[item.status], item.details)
                yield item
            failed = runner.exception() if runner.done() and not runner.cancelled() else None
            if failed is not None:
                raise failed
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled or lost the call. gRPC can stop iterating this
            # generator while it waits at its `yield` (a cancel while a response is being
            # written); the loop's finalizer then closes it with GeneratorExit, not a
            # CancelledError. Catching only the latter closed a resumable session instead
            # of keeping it (test_resume.py's cross-edge test, 1 run in 8 under load).
            transport.dropped = True
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            # Internals (exception text, paths) stay in the log, not in the status.
            log.exception("RealtimeService.Connect failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if not runner.done():
                runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            if digest:
                app.key_sessions.give_back(digest)
