"""The edge's reader of the scheduler's state: the one module that speaks protobuf for what
the edge shows of the fabric (GET /status, /workers, /cache, the queue API and the wait
estimate).

It owns the scheduler RPCs those readers make (GetStatus, CancelTicket, SetEta, and the
GetLeader of every configured scheduler through common.schedulers) and reads their replies
into the small frozen types below: a Snapshot of workers (health by name, memory with its
KV figures, headroom, engine limits), the queue, the running leases and the wait estimate.
Modes are named as status pages name them (common.modes.label). A failed call raises its
grpc.aio.AioRpcError; what that means for a client is admin_error's. The fabric's app
switches (GetApps, SetApp: edge.apps) are read here too.

The sessions' own calls (Acquire, Reattach, the worker's streams) are
edge.worker_client's; channels and stubs are edge.fabric's; the JSON is edge.status's and
edge.queue_api's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from omnifabric.common import limits as engine_limits
from omnifabric.common import modes, schedulers
from omnifabric.common.session_types import EngineLimits
from omnifabric.edge.errors import EdgeError, InvalidPayload, ServiceUnavailable
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb

#: How long a status or admin call may take before it counts as unanswered, s.
TIMEOUT_S = 2.0
#: Worker.health of a worker that takes new sessions.
SERVING = "serving"


@dataclass(frozen=True)
class KvFigures:
    """An engine's KV slots allocated at start (common.proto MemoryStats kv_*)."""

    slots: int
    slot_tokens: int
    slot_bytes: int
    slots_more: int
    """Slots more the device's free memory would hold now."""


@dataclass(frozen=True)
class Memory:
    """A worker's latest memory report."""

    device: str
    allocated_bytes: int
    baseline_bytes: int
    before_cleanup_bytes: int
    cleanups: int
    kv: KvFigures | None
    """None: the engine allocates no KV slots at start."""


@dataclass(frozen=True)
class Headroom:
    """A worker's latest headroom: its engine's time, what sessions cost it, late units."""

    engine_threads: int
    session_cost: Mapping[str, float]
    """Mode name -> what each running session of the mode costs, in the worker's order."""
    peak_cost: Mapping[str, float]
    """Mode name -> what a session's dearest units cost (0: an older worker's report)."""
    late_units_recent: int
    late_units_total: int
    late_window_s: float
    unit_p95_ratio: float
    late_units_by_lease: Mapping[str, int]


@dataclass(frozen=True)
class Worker:
    """One worker as the scheduler sees it."""

    worker_id: str
    address: str
    engine: str
    slots: int
    slots_free: int
    modes: tuple[str, ...]
    health: str
    """SERVING, "not_serving" or "unspecified" (a newer value: its number)."""
    detail: str
    lease_ids: tuple[str, ...]
    memory: Memory | None
    """None before its first memory report."""
    admits: tuple[str, ...]
    """The modes the scheduler would lease one more session of there now."""
    headroom: Headroom | None
    limits: EngineLimits | None
    """None: the worker declared none (older workers)."""
    lease_modes: tuple[str, ...] = ()
    """The mode of each of `lease_ids` ("unspecified": not known)."""
    leases_by_mode: Mapping[str, int] = field(default_factory=dict)
    """How many leases it holds of each mode, whole where the status's bound left
    `lease_ids` out (empty from an older scheduler)."""

    @property
    def lease_count(self) -> int:
        """The leases it holds (from their counts; an older scheduler's: the list)."""
        return sum(self.leases_by_mode.values()) or len(self.lease_ids)

    @property
    def leases_listed(self) -> bool:
        """Whether `lease_ids` (and the headroom's late units per lease) name every lease it
        holds: not where the status's bound left them out."""
        return len(self.lease_ids) >= self.lease_count

    @property
    def modes_held(self) -> set[str]:
        """The modes of the sessions it serves ("unspecified": some not known)."""
        return set(self.leases_by_mode) | set(self.lease_modes)


@dataclass(frozen=True)
class QueueEntry:
    """A request waiting in the scheduler's queue."""

    ticket_id: str
    mode: str
    session_id: str
    position: int
    """1-based."""
    estimated_wait_s: float
    waited_s: float


@dataclass(frozen=True)
class RunningLease:
    """A lease being served."""

    lease_id: str
    worker_id: str
    mode: str
    session_id: str
    elapsed_s: float
    estimated_remaining_s: float


@dataclass(frozen=True)
class Eta:
    """How the scheduler estimates waits, per mode name: the length assumed before any
    session was seen, the moving average (absent: none seen) and the sessions it folds in."""

    alpha: float
    baseline_s: Mapping[str, float]
    mean_s: Mapping[str, float]
    samples: Mapping[str, int]


@dataclass(frozen=True)
class EtaChange:
    """A change of the wait estimate (SetEta): 0 leaves alpha as it is, modes not named
    keep their baseline."""

    alpha: float = 0.0
    baseline_s: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's state (GetStatus)."""

    workers: tuple[Worker, ...]
    queue_length: int
    queue_max: int
    leases_active: int
    leases_detached: int
    """Resumable sessions whose holder is gone (their slots are taken)."""
    mean_session_s: Mapping[str, float]
    queue: tuple[QueueEntry, ...]
    """In queue order."""
    running: tuple[RunningLease, ...]
    eta: Eta
    epoch: int


# ---- protobuf -> domain ------------------------------------------------------------------


def health_name(value: int) -> str:
    """A WorkerHealth wire value -> its name without the prefix, lower case (a value this
    build does not know: its number)."""
    try:
        return common_pb2.WorkerHealth.Name(value).removeprefix("WORKER_HEALTH_").lower()
    except ValueError:
        return str(value)


def memory_from(m: common_pb2.MemoryStats) -> Memory:
    kv = None
    if m.kv_slots:
        kv = KvFigures(m.kv_slots, m.kv_slot_tokens, m.kv_slot_bytes, m.kv_slots_more)
    return Memory(
        m.device, m.allocated_bytes, m.baseline_bytes, m.before_cleanup_bytes, m.cleanups, kv
    )


def headroom_from(h: scheduler_pb.Headroom) -> Headroom:
    return Headroom(
        engine_threads=h.engine_threads,
        session_cost={modes.label(c.mode): c.session_cost for c in h.costs},
        peak_cost={modes.label(c.mode): c.peak_cost for c in h.costs},
        late_units_recent=h.late_units_recent,
        late_units_total=h.late_units_total,
        late_window_s=h.late_window_s,
        unit_p95_ratio=h.unit_p95_ratio,
        late_units_by_lease=dict(h.late_units_by_lease),
    )


def limits_from(pb: common_pb2.EngineLimits) -> EngineLimits:
    return engine_limits.from_pb(pb)


def worker_from(w: scheduler_pb.WorkerStatus) -> Worker:
    """A WorkerStatus -> Worker; absent memory, headroom and limits are None."""
    return Worker(
        worker_id=w.worker_id,
        address=w.address,
        engine=w.engine,
        slots=w.slots,
        slots_free=w.slots_free,
        modes=tuple(modes.label(m) for m in w.modes),
        health=health_name(w.health),
        detail=w.detail,
        lease_ids=tuple(w.lease_ids),
        memory=memory_from(w.memory) if w.HasField("memory") else None,
        admits=tuple(modes.label(m) for m in w.admits),
        headroom=headroom_from(w.headroom) if w.HasField("headroom") else None,
        limits=limits_from(w.limits) if w.HasField("limits") else None,
        lease_modes=tuple(modes.label(m) for m in w.lease_modes),
        leases_by_mode=dict(w.leases_by_mode),
    )


def queue_entry_from(q: scheduler_pb.QueueEntry) -> QueueEntry:
    return QueueEntry(
        q.ticket_id, modes.label(q.mode), q.session_id, q.position, q.estimated_wait_s, q.waited_s
    )


def running_from(r: scheduler_pb.RunningLease) -> RunningLease:
    return RunningLease(
        r.lease_id,
        r.worker_id,
        modes.label(r.mode),
        r.session_id,
        r.elapsed_s,
        r.estimated_remaining_s,
    )


def eta_from(eta: scheduler_pb.EtaStatus) -> Eta:
    return Eta(eta.alpha, dict(eta.baseline_s), dict(eta.mean_s), dict(eta.samples))


def snapshot_from(snap: scheduler_pb.GetStatusResponse) -> Snapshot:
    """A GetStatusResponse -> Snapshot."""
    return Snapshot(
        workers=tuple(worker_from(w) for w in snap.workers),
        queue_length=snap.queue_length,
        queue_max=snap.queue_max,
        leases_active=snap.leases_active,
        leases_detached=snap.leases_detached,
        mean_session_s=dict(snap.mean_session_s),
        queue=tuple(queue_entry_from(q) for q in snap.queue),
        running=tuple(running_from(r) for r in snap.running),
        eta=eta_from(snap.eta),
        epoch=snap.epoch,
    )


def set_eta_request(change: EtaChange) -> scheduler_pb.SetEtaRequest:
    """An EtaChange -> the SetEtaRequest that makes it."""
    return scheduler_pb.SetEtaRequest(alpha=change.alpha, baseline_s=change.baseline_s or {})


# ---- the RPCs ------------------------------------------------------------------------------


async def get_status(stub: Any, timeout_s: float = TIMEOUT_S, ticket_id: str = "") -> Snapshot:
    """The scheduler's snapshot (its AioRpcError when it does not answer in time): the
    queue and the running leases as far as the scheduler's --status-entries bound, the
    counts whole; with `ticket_id`, that waiting request alone and no running lease."""
    request = scheduler_pb.GetStatusRequest(ticket_id=ticket_id)
    reply = await stub.GetStatus(request, timeout=timeout_s)
    return snapshot_from(reply)


async def find_ticket(stub: Any, ticket_id: str) -> QueueEntry | None:
    """The queue entry of `ticket_id`; None when it is not waiting (served, gone, cancelled
    or unknown). Asks for that ticket alone: the answer does not grow with the fleet."""
    if not ticket_id:
        return None
    snap = await get_status(stub, ticket_id=ticket_id)
    return next((q for q in snap.queue if q.ticket_id == ticket_id), None)


async def cancel_ticket(stub: Any, ticket_id: str) -> bool:
    """Take `ticket_id` out of the queue; whether it was waiting."""
    request = scheduler_pb.CancelTicketRequest(ticket_id=ticket_id)
    reply = await stub.CancelTicket(request, timeout=TIMEOUT_S)
    return bool(reply.cancelled)


async def get_eta(stub: Any) -> Eta:
    """The wait estimate (GetStatus carries it)."""
    return (await get_status(stub)).eta


async def set_eta(stub: Any, change: EtaChange) -> Eta:
    """Change the wait estimate; the estimate after it (an invalid change: its
    INVALID_ARGUMENT AioRpcError)."""
    reply = await stub.SetEta(set_eta_request(change), timeout=TIMEOUT_S)
    return eta_from(reply.eta)


async def leadership(stubs: Sequence[Any]) -> list[schedulers.Answer | None]:
    """Every scheduler's GetLeader, asked at once, in the stubs' order (None: that one did
    not answer in time). Raises nothing."""
    return list(await asyncio.gather(*(schedulers.ask(s, i) for i, s in enumerate(stubs))))


# ---- the app switches (edge.apps) --------------------------------------------------


@dataclass(frozen=True)
class Switches:
    """The fabric's app switches as the scheduler answers them (GetApps, SetApp)."""

    disabled: tuple[str, ...]
    generation: int
    """Counts the changes within one scheduler process (`epoch`)."""
    epoch: str


def _switches(msg: scheduler_pb.AppSwitches) -> Switches:
    return Switches(tuple(msg.disabled_app_ids), msg.generation, msg.epoch)


async def get_apps(stub: Any, timeout_s: float) -> Switches:
    """The scheduler's app switches (its AioRpcError when it does not answer)."""
    reply = await stub.GetApps(scheduler_pb.GetAppsRequest(), timeout=timeout_s)
    return _switches(reply.switches)


async def set_app(stub: Any, app_id: str, enabled: bool, timeout_s: float) -> Switches:
    """Switch an app for the fabric; the switches after it (AioRpcError as get_apps)."""
    request = scheduler_pb.SetAppRequest(app_id=app_id, enabled=enabled)
    reply = await stub.SetApp(request, timeout=timeout_s)
    return _switches(reply.switches)


def admin_error(err: grpc.aio.AioRpcError) -> EdgeError:
    """A scheduler admin RPC's failure (the queue API): InvalidPayload when it refused the
    request, else ServiceUnavailable (its details name addresses and are not for clients)."""
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPayload(err.details() or "")
    return ServiceUnavailable("the scheduler cannot be reached")
