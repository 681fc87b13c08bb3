"""The public protocol's errors, and the one place they map to close codes. How an error
looks on the wire is each dialect's (edge.dialects); counting it is the connection's."""

from __future__ import annotations


class EdgeError(Exception):
    """An error the client is told about as an `error` event."""

    code = "internal_error"
    kind = "server_error"
    #: WebSocket close code that follows the event, or None when the session stays usable.
    close_code: int | None = None

    def __init__(self, message: str, close_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if close_code is not None:  # this instance ends the connection (its class may not)
            self.close_code = close_code


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


class ResumeUnknown(ClientError):
    """No session to resume with the token (never issued, or the session closed)."""

    code = "resume_unknown"
    close_code = 1008


class ResumeExpired(ClientError):
    """The session's resume window passed (or what the client missed is no longer kept)."""

    code = "resume_expired"
    close_code = 1008


class ResumeForbidden(ClientError):
    """The token belongs to a session of another API key."""

    code = "resume_forbidden"
    close_code = 1008


class QueueFull(EdgeError):
    code = "queue_full"
    close_code = 1013


class TooManySessions(ClientError):
    """The API key holds its limit of sessions across the fabric (the scheduler counts every
    edge's; the edge's own 429 before the upgrade counts its own)."""

    code = "too_many_sessions"
    close_code = 1008


class AppDisabled(ClientError):
    """The operator switched this kind of session off (PUT /api/admin/apps/{id})."""

    code = "app_disabled"
    close_code = 1008


class QueueCancelled(EdgeError):
    """An operator took the waiting request out of the queue (DELETE /api/queue/{ticket})."""

    code = "cancelled"
    close_code = 1000


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


class InternalError(EdgeError):
    """Something unexpected failed at the edge; details stay in the log."""

    code = "internal_error"
    close_code = 1011


class InferenceError(EdgeError):
    """The engine failed on one unit; the session may go on."""

    code = "inference_error"


#: How a second init and input before the session's start are worded, unless a dialect
#: words them in its own protocol (edge.session.SessionCore refuses both).
ALREADY_INITIALIZED = "the session is already initialized"
NOT_STARTED = "send session.init (or session.update) first"
