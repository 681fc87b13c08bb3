"""What a gRPC server can tell of a stream call's end."""

from __future__ import annotations

import asyncio

import grpc

#: How long the end of a call's requests waits to tell a cancel from a half-close, s (a
#: loaded process flags a cancel some 100 ms late; a half-close is taken as one after this).
CANCEL_WAIT_S = 1.0


async def cancelled_soon(context: grpc.aio.ServicerContext, wait_s: float = CANCEL_WAIT_S) -> bool:
    """True when the call is cancelled now or within `wait_s`: a client that cancels (or
    loses) a stream call ends its requests just as a half-close does, and the call is
    flagged cancelled a moment later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        if context.cancelled():
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.01)
