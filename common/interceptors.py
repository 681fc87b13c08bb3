"""The gRPC server interceptor every service installs: an exception escaping a handler becomes
the status the service's own `status_for` maps it to, so an unforeseen error is INTERNAL with
a generic message (and logged with its traceback), never gRPC's default UNKNOWN status quoting
the exception."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

#: An exception -> (status code, details safe to show the caller).
StatusFor = Callable[[BaseException], tuple[grpc.StatusCode, str]]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Guards every handler of the server: unary and streaming, request and response.

    `trailing_metadata` goes with every status it sets (the scheduler names itself as the
    source of an error this way); `log` gets the unexpected ones."""

    def __init__(
        self,
        status_for: StatusFor,
        log: logging.Logger,
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.status_for = status_for
        self.log = log
        self.trailing_metadata = tuple(trailing_metadata)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: self._guarded(behavior, method)})
        return handler

    def _guarded(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await self._abort(context, exc, method)

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._abort(context, exc, method)

        return call

    async def _abort(
        self, context: grpc.aio.ServicerContext, error: Exception, method: str
    ) -> None:
        code, details = self.status_for(error)
        if code is grpc.StatusCode.INTERNAL:
            self.log.error("unexpected error in %s", method, exc_info=error)
        await context.abort(code, details, trailing_metadata=self.trailing_metadata)
