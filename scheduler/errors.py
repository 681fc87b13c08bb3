"""Scheduler errors and the one place that maps them to gRPC status codes."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: Trailing metadata on every status the scheduler itself sends: lets a client tell the
#: scheduler's own refusals (details meant for it) from transport failures.
SOURCE_METADATA = (("omni-error-source", "scheduler"),)


class SchedulerError(Exception):
    """Base of the errors a scheduler RPC reports to its caller."""

    code = grpc.StatusCode.INTERNAL


class QueueFull(SchedulerError):
    """The wait queue holds queue_max requests already."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, waiting: int, queue_max: int) -> None:
        super().__init__(f"queue_full: {waiting} requests waiting (max {queue_max})")


class NoWorker(SchedulerError):
    """No registered worker, in any health, serves the requested mode."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, mode_name: str) -> None:
        super().__init__(f"no worker serves mode {mode_name}")


class InvalidRequest(SchedulerError):
    """The request breaks the contract (missing mode, hello not first, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ShuttingDown(SchedulerError):
    """The scheduler is draining: it takes no requests and ends its streams."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self) -> None:
        super().__init__("scheduler is shutting down")


class UnknownLease(SchedulerError):
    """The lease id is not (or no longer) known to the scheduler."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, lease_id: str) -> None:
        super().__init__(f"unknown lease {lease_id}")


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details to send for `error`; unknown errors leak nothing."""
    if isinstance(error, SchedulerError):
        return error.code, str(error)
    return grpc.StatusCode.INTERNAL, "internal scheduler error"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every handler's escaping exception becomes the status `status_for` gives it, so an
    unforeseen error is INTERNAL with a generic message, never grpc's default UNKNOWN
    status that quotes the exception."""

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
                return handler._replace(**{kind: _guarded(behavior, method)})
        return handler


def _guarded(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_unexpected(context, exc, method)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_unexpected(context, exc, method)

    return call


async def _abort_unexpected(
    context: grpc.aio.ServicerContext, error: Exception, method: str
) -> None:
    code, details = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.error("unexpected error in %s", method, exc_info=error)
    await context.abort(code, details, trailing_metadata=SOURCE_METADATA)
