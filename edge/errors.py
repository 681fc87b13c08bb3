"""The public protocol's errors, and the one place they map to close codes."""

from __future__ import annotations

from edge.metrics import METRICS


class EdgeError(Exception):
    """An error the client is told about as an `error` event."""

    code = "internal_error"
    kind = "server_error"
    #: WebSocket close code that follows the event, or None when the session stays usable.
    close_code: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(EdgeError):
    kind = "client_error"


class NotReady(ClientError):
    """Input sent before the session is ready (before session.init/update)."""

    code = "not_ready"


class UnknownEvent(ClientError):
    code = "unknown_event"


class InvalidEvent(ClientError):
    """A known event at the wrong time, e.g. a second session.init."""

    code = "invalid_event"


class MissingField(ClientError):
    code = "missing_field"


class InvalidPayload(ClientError):
    code = "invalid_payload"


class QueueFull(EdgeError):
    code = "queue_full"
    close_code = 1013


class ServiceUnavailable(EdgeError):
    code = "service_unavailable"
    close_code = 1013


class WorkerConnectFailed(EdgeError):
    code = "worker_connect_failed"
    close_code = 1013


class SlowClient(ClientError):
    """The client stopped reading: its outbound queue overflowed. 1008 (policy violation),
    not 1011: the fault is the client's read rate, not a server condition to retry on."""

    code = "slow_client"
    close_code = 1008


class InferenceError(EdgeError):
    """The engine failed on one unit; the session may go on."""

    code = "inference_error"


def error_event(err: EdgeError) -> dict:
    """The JSON `error` event for an error (same shape in both dialects)."""
    METRICS.client_error(err.code)  # built only to be sent
    return {"type": "error", "error": {"code": err.code, "message": err.message, "type": err.kind}}


def legacy_error_event(err: EdgeError) -> dict:
    """The legacy endpoints' `error` message (/ws/duplex, /ws/chat): a plain string."""
    METRICS.client_error(err.code)  # built only to be sent
    text = f"{err.code}: {err.message}"
    return {"type": "error", "error": text, "message": text}
