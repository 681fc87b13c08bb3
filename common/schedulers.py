"""Several scheduler addresses (active/standby schedulers): the setting's form, and finding
the one that leads. Shared by the worker's registration and the edge's fabric client.

The setting holds one address or several, comma-separated (`--scheduler a:50051,b:50051`).
With one, nothing here runs: the clients dial it as they always did. With several, a client
asks each `GetLeader` and uses the one that leads with the highest epoch; a standby refuses
everything else with UNAVAILABLE "not_leader: ...", and a client then moves on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from omnifabric.common import listen
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

#: The details' prefix of a standby's refusal (the scheduler's NotLeader error).
NOT_LEADER = "not_leader"
#: The details of a draining scheduler's refusal (the scheduler's ShuttingDown error).
SHUTTING_DOWN = "scheduler is shutting down"
#: How long one GetLeader may take before that scheduler counts as unreachable, seconds.
ASK_TIMEOUT_S = 1.0
#: How often a client with several addresses asks them which leads, seconds.
WATCH_INTERVAL_S = 0.5


def addresses(value: str) -> tuple[str, ...]:
    """The scheduler addresses of a setting: one host:port or several, comma-separated.
    ValueError when none is given or one has no port."""
    found = tuple(part.strip() for part in value.split(",") if part.strip())
    if not found:
        raise ValueError("names no scheduler address (host:port[,host:port...])")
    for address in found:
        listen.check_address(address)
    return found


def is_not_leader(error: grpc.RpcError) -> bool:
    """True for a standby's refusal (its details start with NOT_LEADER)."""
    details = error.details() if isinstance(error, grpc.aio.AioRpcError) else ""
    return (details or "").startswith(NOT_LEADER)


def elsewhere(error: grpc.aio.AioRpcError, from_scheduler: bool) -> bool:
    """True when a call refused this way before any answer may succeed at another
    scheduler: a standby's or a draining scheduler's refusal, or a transport failure
    (`from_scheduler` False). Any other UNAVAILABLE the scheduler sent (no worker for the
    mode) is an answer."""
    if error.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    return not from_scheduler or (error.details() or "").startswith((NOT_LEADER, SHUTTING_DOWN))


@dataclass(frozen=True)
class Answer:
    """What one scheduler said of the leadership (and of itself)."""

    index: int
    leading: bool
    epoch: int
    leader: str
    pid: int | None = None
    terms: int | None = None
    """Leaderships it began since its start."""
    rebuild_s: float | None = None
    """Its last rebuild, seconds (None before it first led)."""


async def ask(
    stub: scheduler_grpc.SchedulerServiceStub, index: int, timeout_s: float = ASK_TIMEOUT_S
) -> Answer | None:
    """Scheduler `index`'s answer to GetLeader; None when it cannot be reached in time. A
    scheduler without the RPC leads alone (epoch 0)."""
    try:
        reply = await stub.GetLeader(scheduler_pb.GetLeaderRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            return Answer(index, True, 0, "")
        return None
    return Answer(
        index,
        reply.leading,
        reply.epoch,
        reply.leader,
        pid=reply.pid or None,
        terms=reply.terms,
        rebuild_s=reply.rebuild_s if reply.HasField("rebuild_s") else None,
    )


def leader(answers: Sequence[Answer | None]) -> Answer | None:
    """The leading answer with the highest epoch; None when none leads."""
    leaders = [a for a in answers if a is not None and a.leading]
    return max(leaders, key=lambda a: a.epoch) if leaders else None


async def find_leader(
    stubs: Sequence[scheduler_grpc.SchedulerServiceStub], timeout_s: float = ASK_TIMEOUT_S
) -> tuple[Answer | None, int]:
    """Ask every scheduler at once: (the leading one with the highest epoch, or None; the
    highest epoch any of them named)."""
    answers = await asyncio.gather(*(ask(s, i, timeout_s) for i, s in enumerate(stubs)))
    highest = max((a.epoch for a in answers if a is not None), default=0)
    return leader(answers), highest
