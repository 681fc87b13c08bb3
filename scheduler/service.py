"""SchedulerService servicer: protobuf <-> domain at the boundary, one core call per RPC."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from omnifabric.common import limits as engine_limits
from omnifabric.common import logs, modes, telemetry
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.scheduler.core import (
    MAX_WAITED_S,
    AcquireEvent,
    EtaSnapshot,
    HeldLease,
    LeaseLoss,
    LeaseMove,
    LeaseOffer,
    QueueUpdate,
    Scheduler,
    StatusSnapshot,
    WorkerHello,
)
from omnifabric.scheduler.errors import (
    SOURCE_METADATA,
    InvalidRequest,
    UnknownLease,
    status_for,
)
from omnifabric.scheduler.leases import LeaseGrantNotice, LeaseRevokeNotice
from omnifabric.scheduler.registry import (
    EngineLimits,
    Headroom,
    Health,
    MemoryFigures,
    Mode,
    Worker,
)

log = logging.getLogger(__name__)
TRACER = telemetry.tracer("scheduler")

_HEALTH_FROM_PB = {
    common_pb2.WORKER_HEALTH_SERVING: Health.SERVING,
    common_pb2.WORKER_HEALTH_NOT_SERVING: Health.NOT_SERVING,
}
_HEALTH_TO_PB = {
    Health.UNKNOWN: common_pb2.WORKER_HEALTH_UNSPECIFIED,
    Health.SERVING: common_pb2.WORKER_HEALTH_SERVING,
    Health.NOT_SERVING: common_pb2.WORKER_HEALTH_NOT_SERVING,
}


#: A status snapshot of this many leases and workers or more is built into its reply off
#: the event loop (GetStatus).
STATUS_OFF_LOOP = 1000
#: WorkerStatus.leases_by_mode's key for leases whose mode is not known.
UNKNOWN_MODE = modes.label(common_pb2.MODE_UNSPECIFIED)

#: Bounds of the fabric's app switches (ids are the edges' catalog: a handful, short).
MAX_APP_ID_CHARS = 64
MAX_APPS_OFF = 64


class SchedulerServicer(scheduler_grpc.SchedulerServiceServicer):
    """The gRPC face of one `Scheduler`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._disabled_apps: set[str] = set()
        """App ids switched off for the whole fabric (GetApps/SetApp)."""
        self._apps_generation = 0
        self._apps_epoch = secrets.token_hex(8)
        """This process's name for its generations (a restart counts from 0 again)."""

    async def Register(
        self,
        request_iterator: AsyncIterator[scheduler_pb.RegisterRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb.RegisterResponse]:
        requests = aiter(request_iterator)
        try:
            first = await anext(requests, None)
            if first is None or first.WhichOneof("kind") != "hello":
                raise InvalidRequest("the first message of Register must be hello")
            worker = self._scheduler.register(_hello_from_pb(first.hello))
        except Exception as exc:
            await _abort(context, exc)
        # Its silence is watched by the scheduler's pulse (Scheduler.watch), which ends
        # this stream through the outbox.
        reader = asyncio.create_task(self._read_worker(worker, requests))
        failure: Exception | None = None
        try:
            yield scheduler_pb.RegisterResponse(
                registered=scheduler_pb.Registered(
                    worker_id=worker.worker_id, epoch=self._scheduler.leadership.epoch
                )
            )
            while (notice := await worker.outbox.get()) is not None:
                if isinstance(notice, LeaseGrantNotice):
                    lease = notice.lease
                    yield scheduler_pb.RegisterResponse(
                        lease_granted=scheduler_pb.LeaseGranted(
                            lease_id=lease.lease_id,
                            slot=lease.slot,
                            mode=_granted_mode_to_pb(lease.mode),
                            session_id=lease.session_id,
                            epoch=self._scheduler.leadership.epoch,
                            key=lease.key,
                            resume_key=lease.resume_key,
                            owner=lease.owner,
                            resume_grace_s=lease.resume_grace_s,
                        )
                    )
                    # Resumed only after gRPC took the message: the worker knows the lease.
                    self._scheduler.lease_announced(lease)
                elif isinstance(notice, LeaseRevokeNotice):
                    yield scheduler_pb.RegisterResponse(
                        lease_revoked=scheduler_pb.LeaseRevoked(
                            lease_id=notice.lease_id,
                            reason=notice.reason,
                            unused_only=notice.unused_only,
                        )
                    )
            if reader.done() and not reader.cancelled():
                failure = reader.result()
            if failure is None:
                # Drained or stepped down: the worker logs why and registers again (with
                # the next leader).
                failure = self._scheduler.refusal()
        finally:
            reader.cancel()
            self._scheduler.unregister(worker)
        if failure is not None:
            await _abort(context, failure)

    async def _read_worker(
        self, worker: Worker, requests: AsyncIterator[scheduler_pb.RegisterRequest]
    ) -> Exception | None:
        """Apply the worker's reports and releases until its stream ends; returns its failure."""
        liveness = self._scheduler.liveness
        try:
            async for request in requests:
                liveness.seen(worker)
                kind = request.WhichOneof("kind")
                if kind == "report":
                    report = request.report
                    self._scheduler.report(
                        worker,
                        _health_from_pb(report.health),
                        report.detail,
                        _memory_from_pb(report.memory) if report.HasField("memory") else None,
                        _headroom_from_pb(report.headroom) if report.HasField("headroom") else None,
                        report.slots,
                    )
                elif kind == "lease_released":
                    try:
                        self._scheduler.release(worker, request.lease_released.lease_id)
                    except UnknownLease as exc:
                        # Normal after a release timeout freed the slot first.
                        log.info("worker %s: %s", worker.worker_id, exc)
                else:
                    return InvalidRequest(f"unexpected {kind or 'empty message'} after hello")
            return None
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            log.debug("worker %s stream broke: %r", worker.worker_id, exc)
            return None
        except Exception as exc:
            # A bug here: end the registration with INTERNAL rather than lose it silently.
            return exc
        finally:
            # Wakes the writer so the stream (and the registration) ends with the reader.
            worker.outbox.put_nowait(None)

    async def Acquire(
        self, request: scheduler_pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb.AcquireResponse]:
        logs.bind_session(request.session_id)  # this RPC's task: its log lines name it
        # "acquire" spans the wait for a lease, under the edge's queue span.
        span = TRACER.start_span(
            "acquire",
            context=telemetry.extract(context.invocation_metadata()),
            attributes={"session.id": request.session_id},
        )
        # Current for this RPC's task, so its log lines carry the session's trace id. The
        # task ends with the RPC, so nothing is detached: grpc closes a cancelled call's
        # generator from another task, whose context never held the token (detaching
        # there failed, logged as an error with a traceback).
        otel_context.attach(trace.set_span_in_context(span))
        try:
            mode = _mode_from_pb(request.mode)
            events = self._scheduler.acquire(
                mode,
                request.session_id,
                request.resume_key,
                request.owner,
                request.resume_grace_s,
                request.key,
                request.key_session_limit,
                _waited_s(request.waited_s),
                request.previous_position,
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    message = _acquire_event_to_pb(event)
                    if message.WhichOneof("kind") == "lease" and span.is_recording():
                        span.set_attribute("worker.id", message.lease.worker_id)
                        span.end()
                    yield message
        except Exception as exc:
            await _abort(context, exc)
        finally:
            if span.is_recording():
                span.end()

    async def Reattach(
        self, request: scheduler_pb.ReattachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb.ReattachResponse]:
        try:
            events = self._scheduler.reattach(request.resume_key, request.owner)
            async with contextlib.aclosing(events):
                async for event in events:
                    # The same fields, the same numbers: the edge reads both alike.
                    message = _acquire_event_to_pb(event)
                    yield scheduler_pb.ReattachResponse.FromString(message.SerializeToString())
        except Exception as exc:
            await _abort(context, exc)

    async def GetStatus(
        self, request: scheduler_pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.GetStatusResponse:
        bound = request.max_entries or self._scheduler.config.status_entries
        try:
            status = self._scheduler.status(bound, request.ticket_id)
        except Exception as exc:
            await _abort(context, exc)
        epoch = self._scheduler.leadership.epoch
        listed = sum(len(w.lease_ids) for w in status.workers)
        if len(status.running) + len(status.workers) + listed < STATUS_OFF_LOOP:
            return _status_to_pb(status, epoch)
        # A large fleet's snapshot is taken on the loop (consistent), and its thousands of
        # messages built on a thread: the loop, which serves every grant and report, then
        # waits at most a GIL switch at a time instead of the whole build (~10 us a lease).
        return await asyncio.to_thread(_status_to_pb, status, epoch)

    async def GetLeader(
        self, request: scheduler_pb.GetLeaderRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.GetLeaderResponse:
        leadership = self._scheduler.leadership
        return scheduler_pb.GetLeaderResponse(
            leading=leadership.leads() and not self._scheduler.draining,
            epoch=leadership.epoch,
            leader=leadership.leader,
            pid=os.getpid(),
            terms=leadership.terms,
            rebuild_s=leadership.rebuild_s,
        )

    async def CancelTicket(
        self, request: scheduler_pb.CancelTicketRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.CancelTicketResponse:
        return scheduler_pb.CancelTicketResponse(
            cancelled=self._scheduler.cancel(request.ticket_id)
        )

    async def GetApps(
        self, request: scheduler_pb.GetAppsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.GetAppsResponse:
        return scheduler_pb.GetAppsResponse(switches=self._app_switches())

    async def SetApp(
        self, request: scheduler_pb.SetAppRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.SetAppResponse:
        if (refusal := self._scheduler.refusal()) is not None:
            await _abort(context, refusal)  # a standby's switches would be lost
        app_id = request.app_id
        if not app_id or len(app_id) > MAX_APP_ID_CHARS:
            await _abort(context, InvalidRequest(f"app_id must be 1 to {MAX_APP_ID_CHARS} chars"))
        if request.enabled:
            self._disabled_apps.discard(app_id)
        elif app_id not in self._disabled_apps:
            if len(self._disabled_apps) >= MAX_APPS_OFF:
                await _abort(context, InvalidRequest(f"at most {MAX_APPS_OFF} apps can be off"))
            self._disabled_apps.add(app_id)
        self._apps_generation += 1
        log.info("app %s switched %s", app_id, "on" if request.enabled else "off")
        return scheduler_pb.SetAppResponse(switches=self._app_switches())

    def _app_switches(self) -> scheduler_pb.AppSwitches:
        return scheduler_pb.AppSwitches(
            disabled_app_ids=sorted(self._disabled_apps),
            generation=self._apps_generation,
            epoch=self._apps_epoch,
        )

    async def SetEta(
        self, request: scheduler_pb.SetEtaRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb.SetEtaResponse:
        baseline: dict[Mode, float] = {}
        for name, seconds in request.baseline_s.items():
            try:
                baseline[Mode(name)] = seconds
            except ValueError:
                await _abort(context, InvalidRequest(f"unknown mode {name!r} (audio, video, chat)"))
        try:
            eta = self._scheduler.set_eta(request.alpha or None, baseline)
        except ValueError as exc:
            await _abort(context, InvalidRequest(str(exc)))
        return scheduler_pb.SetEtaResponse(eta=_eta_to_pb(eta))


def _status_to_pb(status: StatusSnapshot, epoch: int) -> scheduler_pb.GetStatusResponse:
    """A status snapshot as GetStatus answers it (no scheduler state read: runs on a
    thread for a large fleet)."""
    return scheduler_pb.GetStatusResponse(
        workers=[
            scheduler_pb.WorkerStatus(
                worker_id=w.worker_id,
                address=w.address,
                engine=w.engine,
                slots=w.slots,
                slots_free=w.slots_free,
                modes=[modes.to_pb(m) for m in w.modes],
                health=_HEALTH_TO_PB[w.health],
                detail=w.detail,
                lease_ids=list(w.lease_ids),
                memory=_memory_to_pb(w.memory),
                limits=_limits_to_pb(w.limits),
                headroom=_headroom_to_pb(w.headroom),
                admits=[modes.to_pb(m) for m in w.admits],
                lease_modes=[
                    common_pb2.MODE_UNSPECIFIED if m is None else modes.to_pb(m)
                    for m in w.lease_modes
                ],
                leases_by_mode={
                    UNKNOWN_MODE if m is None else m.value: n for m, n in w.leases_by_mode.items()
                },
            )
            for w in status.workers
        ],
        queue_length=status.queue_length,
        queue_max=status.queue_max,
        leases_active=status.leases_active,
        leases_detached=status.leases_detached,
        mean_session_s={mode.value: s for mode, s in status.mean_session_s.items()},
        queue=[
            scheduler_pb.QueueEntry(
                ticket_id=q.ticket_id,
                mode=modes.to_pb(q.mode),
                session_id=q.session_id,
                position=q.position,
                estimated_wait_s=q.estimated_wait_s,
                waited_s=q.waited_s,
            )
            for q in status.queue
        ],
        running=[
            scheduler_pb.RunningLease(
                lease_id=r.lease_id,
                worker_id=r.worker_id,
                mode=modes.to_pb(r.mode) if r.mode else common_pb2.MODE_UNSPECIFIED,
                session_id=r.session_id,
                elapsed_s=r.elapsed_s,
                estimated_remaining_s=r.estimated_remaining_s,
            )
            for r in status.running
        ],
        eta=_eta_to_pb(status.eta) if status.eta else None,
        epoch=epoch,
    )


def _eta_to_pb(eta: EtaSnapshot) -> scheduler_pb.EtaStatus:
    return scheduler_pb.EtaStatus(
        alpha=eta.alpha,
        baseline_s={m.value: s for m, s in eta.baseline_s.items()},
        mean_s={m.value: s for m, s in eta.mean_s.items()},
        samples={m.value: n for m, n in eta.samples.items()},
    )


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the RPC with the status `error` maps to (the one mapping, in errors.py)."""
    code, details = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error in scheduler RPC", exc_info=error)
    await context.abort(code, details, trailing_metadata=SOURCE_METADATA)
    raise AssertionError("context.abort returned")  # abort always raises


def _granted_mode_to_pb(mode: Mode | None) -> common_pb2.Mode:
    """A granted lease's mode; only an orphan's lease has none, and it is never granted."""
    if mode is None:
        raise ValueError("a lease without a mode cannot be granted")
    return modes.to_pb(mode)


def _mode_from_pb(value: common_pb2.Mode) -> Mode:
    mode = modes.from_pb(value)
    if mode is None:
        raise InvalidRequest("mode must be MODE_AUDIO, MODE_VIDEO or MODE_CHAT")
    return mode


def _health_from_pb(value: common_pb2.WorkerHealth) -> Health:
    # An unspecified health is not SERVING: no leases until the worker says so.
    return _HEALTH_FROM_PB.get(value, Health.UNKNOWN)


def _hello_from_pb(hello: scheduler_pb.WorkerHello) -> WorkerHello:
    return WorkerHello(
        worker_id=hello.worker_id,
        address=hello.address,
        slots=hello.slots,
        modes=frozenset(_mode_from_pb(m) for m in hello.modes),
        engine=hello.engine,
        health=_health_from_pb(hello.health),
        active_lease_ids=tuple(hello.active_lease_ids),
        held_leases=tuple(_held_from_pb(h) for h in hello.held_leases),
        limits=_limits_from_pb(hello.limits) if hello.HasField("limits") else None,
        headroom=_headroom_from_pb(hello.headroom) if hello.HasField("headroom") else None,
    )


def _held_from_pb(held: scheduler_pb.HeldLease) -> HeldLease:
    """(A mode this scheduler does not know: none, the lease stays a taken slot.)"""
    return HeldLease(
        lease_id=held.lease_id,
        mode=modes.from_pb(held.mode),
        session_id=held.session_id,
        key=held.key,
        resume_key=held.resume_key,
        owner=held.owner,
        resume_grace_s=held.resume_grace_s,
        detached=held.detached,
        resume_left_s=held.resume_left_s,
    )


def _waited_s(value: float) -> float:
    """AcquireRequest.waited_s, checked: InvalidRequest unless finite and 0..MAX_WAITED_S."""
    if not (math.isfinite(value) and 0.0 <= value <= MAX_WAITED_S):
        raise InvalidRequest(f"waited_s must be from 0 to {MAX_WAITED_S:.0f} s, got {value}")
    return value


def _acquire_event_to_pb(event: AcquireEvent) -> scheduler_pb.AcquireResponse:
    if isinstance(event, QueueUpdate):
        return scheduler_pb.AcquireResponse(
            queued=scheduler_pb.QueuePosition(
                position=event.position,
                queue_length=event.queue_length,
                estimated_wait_s=event.estimated_wait_s,
                ticket_id=event.ticket_id,
            )
        )
    if isinstance(event, LeaseOffer):
        return scheduler_pb.AcquireResponse(
            lease=scheduler_pb.Lease(
                lease_id=event.lease_id,
                worker_id=event.worker_id,
                worker_address=event.worker_address,
                slot=event.slot,
                ticket_id=event.ticket_id,
                queue_wait_s=event.queue_wait_s,
                limits=_limits_to_pb(event.limits),
                epoch=event.epoch,
            )
        )
    if isinstance(event, LeaseMove):
        return scheduler_pb.AcquireResponse(
            lease_moved=scheduler_pb.LeaseMoved(lease_id=event.lease_id)
        )
    assert isinstance(event, LeaseLoss)
    return scheduler_pb.AcquireResponse(
        lease_lost=scheduler_pb.LeaseLost(lease_id=event.lease_id, reason=event.reason)
    )


def _memory_from_pb(msg: common_pb2.MemoryStats) -> MemoryFigures:
    return MemoryFigures(
        **{f.name: getattr(msg, f.name) for f in dataclasses.fields(MemoryFigures)}
    )


def _memory_to_pb(figures: MemoryFigures | None) -> common_pb2.MemoryStats | None:
    if figures is None:
        return None
    return common_pb2.MemoryStats(**dataclasses.asdict(figures))


def _headroom_from_pb(msg: scheduler_pb.Headroom) -> Headroom:
    costs = [(c, mode) for c in msg.costs if (mode := modes.from_pb(c.mode)) is not None]
    return Headroom(
        engine_threads=max(1, msg.engine_threads),
        session_cost={mode: max(0.0, c.session_cost) for c, mode in costs},
        added_cost={mode: max(0.0, c.added_cost) for c, mode in costs},
        peak_cost={mode: max(0.0, c.peak_cost) for c, mode in costs},
        added_peak={mode: max(0.0, c.added_peak) for c, mode in costs},
        late_recent=msg.late_units_recent,
        late_total=msg.late_units_total,
        late_window_s=msg.late_window_s,
        unit_p95_ratio=msg.unit_p95_ratio,
        late_by_lease=dict(msg.late_units_by_lease),
    )


def _headroom_to_pb(room: Headroom | None) -> scheduler_pb.Headroom | None:
    if room is None:
        return None
    return scheduler_pb.Headroom(
        engine_threads=room.engine_threads,
        costs=[
            scheduler_pb.ModeCost(
                mode=modes.to_pb(mode),
                session_cost=cost,
                added_cost=room.added_cost[mode],
                peak_cost=room.peak_cost.get(mode, 0.0),
                added_peak=room.added_peak.get(mode, 0.0),
            )
            for mode, cost in room.session_cost.items()
        ],
        late_units_recent=room.late_recent,
        late_units_total=room.late_total,
        late_window_s=room.late_window_s,
        unit_p95_ratio=room.unit_p95_ratio,
        late_units_by_lease=room.late_by_lease,
    )


def _limits_from_pb(msg: common_pb2.EngineLimits) -> EngineLimits:
    return engine_limits.from_pb(msg)


def _limits_to_pb(limits: EngineLimits | None) -> common_pb2.EngineLimits | None:
    return None if limits is None else engine_limits.to_pb(limits)
