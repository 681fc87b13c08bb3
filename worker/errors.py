"""The worker's error hierarchy; service.py maps it to gRPC status codes in one place."""

from __future__ import annotations

# A setting out of range or malformed is the shared configuration scheme's ConfigError (a
# ValueError whose message names the variable or flag).
from omnifabric.common.config import ConfigError as ConfigError


class WorkerError(Exception):
    """Base of every error the worker raises on purpose; the message is safe to show."""


class InvalidRequest(WorkerError):
    """The request is malformed (first message not `start`, bad PCM, bad mode) or outside
    the engine's limits."""


class LeaseNotFound(WorkerError):
    """The scheduler never granted this lease on this worker (within lease_wait_s)."""


class LeaseInUse(WorkerError):
    """The lease is already held by a session, or was used before."""


class StaleLease(WorkerError):
    """The lease was granted by a scheduler leadership (epoch) older than one this worker
    has seen: a paused or cut-off old leader's grant, void."""

    PREFIX = "stale_epoch"

    def __init__(self, lease_id: str, epoch: int, current: int) -> None:
        super().__init__(
            f"{self.PREFIX}: lease {lease_id!r} was granted by scheduler epoch {epoch}; "
            f"this worker follows epoch {current}"
        )


class ModeMismatch(WorkerError):
    """The session's mode differs from the mode the lease was granted for."""


class NoFreeSlot(WorkerError):
    """Every slot of this worker is taken."""


class NotServing(WorkerError):
    """The worker is warming up or draining and takes no new sessions."""


class EngineUnavailable(WorkerError):
    """The requested engine does not exist or cannot be loaded here."""


class EngineFailure(WorkerError):
    """The engine raised while serving a session; the session ends with ERROR."""


class EngineStuck(EngineFailure):
    """An engine call overran the unit timeout; its thread is still inside it."""
