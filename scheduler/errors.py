"""Scheduler errors and the one place that maps them to gRPC status codes."""

from __future__ import annotations

import grpc

from omnifabric.common.schedulers import NOT_LEADER, SHUTTING_DOWN

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


class KeySessionLimit(SchedulerError):
    """The request's API key holds as many sessions as its limit, fabric-wide."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    #: The details' prefix that tells this refusal from a full queue.
    PREFIX = "key_session_limit"

    def __init__(self, held: int, limit: int) -> None:
        super().__init__(
            f"{self.PREFIX}: this API key holds {held} sessions across the fabric, "
            f"its limit is {limit}"
        )


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
        super().__init__(SHUTTING_DOWN)


class NotLeader(SchedulerError):
    """A standby scheduler (--ha): it grants nothing until it leads. UNAVAILABLE, like a
    scheduler that is down: clients given several addresses try the next one."""

    code = grpc.StatusCode.UNAVAILABLE
    #: The details' prefix that tells this refusal from a scheduler shutting down.
    PREFIX = NOT_LEADER

    def __init__(self, leader: str = "", store_problem: str = "") -> None:
        named = f"the leader is {leader}" if leader else "no leader is known yet"
        if store_problem:  # then no scheduler can lead, whatever it last knew
            named = f"no scheduler can lead: {store_problem}"
        super().__init__(f"{self.PREFIX}: this scheduler is a standby ({named})")


class Cancelled(SchedulerError):
    """An operator took the waiting request out of the queue (CancelTicket)."""

    code = grpc.StatusCode.ABORTED

    def __init__(self) -> None:
        super().__init__("cancelled: an operator removed the request from the queue")


class UnknownLease(SchedulerError):
    """The lease id is not (or no longer) known to the scheduler."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, lease_id: str) -> None:
        super().__init__(f"unknown lease {lease_id}")


class ResumeUnknown(SchedulerError):
    """No resumable session has that token (never issued, or the session closed)."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self) -> None:
        super().__init__("resume_unknown: no session to resume with this token")


class ResumeExpired(SchedulerError):
    """The session's resume window passed; it was freed."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self) -> None:
        super().__init__("resume_expired: the session's resume window has passed")


class ResumeForbidden(SchedulerError):
    """The token was issued to another owner (API key)."""

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self) -> None:
        super().__init__("resume_forbidden: this session belongs to another key")


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details to send for `error`; unknown errors leak nothing."""
    if isinstance(error, SchedulerError):
        return error.code, str(error)
    return grpc.StatusCode.INTERNAL, "internal scheduler error"
