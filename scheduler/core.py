"""The scheduler's state machine: registry, queue and leases, driven from one event loop.

Every mutation is synchronous (no await between reading and writing state), so the
event loop serializes them and no lock is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.errors import (
    Cancelled,
    InvalidRequest,
    KeySessionLimit,
    NoWorker,
    QueueFull,
    ResumeExpired,
    ResumeForbidden,
    ResumeUnknown,
    SchedulerError,
    ShuttingDown,
    UnknownLease,
)
from omnifabric.scheduler.leadership import Leadership
from omnifabric.scheduler.leases import (
    Lease,
    LeaseGrantNotice,
    LeaseRevokeNotice,
    LeaseState,
    LeaseTable,
    Signal,
    first_set,
)
from omnifabric.scheduler.liveness import LOST_GRACE_S, AttendedTimer, Liveness, LoopClock
from omnifabric.scheduler.metrics import Counters, SchedulerMetrics
from omnifabric.scheduler.queue import SessionLengths, Ticket, WaitQueue, estimate_wait_s
from omnifabric.scheduler.registry import (
    EngineLimits,
    Headroom,
    Health,
    MemoryFigures,
    Mode,
    Registry,
    Worker,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldLease:
    """A session a registering worker serves, as its grant described it."""

    lease_id: str
    mode: Mode | None = None
    """None: not said (an id alone, from older workers, or a mode this scheduler does not
    know): the lease is a taken slot and nothing more."""
    session_id: str = ""
    key: str = ""
    resume_key: str = ""
    owner: str = ""
    resume_grace_s: float = 0.0
    detached: bool = False
    """No stream carries it: it waits `resume_left_s` more for a resume."""
    resume_left_s: float = 0.0


@dataclass(frozen=True)
class WorkerHello:
    """What a worker declares when it registers."""

    worker_id: str
    address: str
    slots: int
    modes: frozenset[Mode]
    engine: str
    health: Health
    active_lease_ids: tuple[str, ...] = ()
    held_leases: tuple[HeldLease, ...] = ()
    """The sessions behind active_lease_ids, as their grants described them (workers that
    do not say: only the ids, which then count as taken slots and nothing more)."""
    limits: EngineLimits | None = None
    """What the worker's engine accepts; None from workers that do not say."""
    headroom: Headroom | None = None
    """Its real-time headroom as measured at warm-up; None from workers that do not say."""


@dataclass(frozen=True)
class QueueUpdate:
    """A waiting request's place in the queue."""

    position: int
    queue_length: int
    estimated_wait_s: float
    ticket_id: str


@dataclass(frozen=True)
class LeaseOffer:
    """The lease handed to a request's holder."""

    lease_id: str
    worker_id: str
    worker_address: str
    slot: int
    ticket_id: str
    queue_wait_s: float
    limits: EngineLimits | None = None
    """The leased worker's limits, for the holder to check requests against."""
    epoch: int = 0
    """The granting leader's epoch (0 without an election)."""


@dataclass(frozen=True)
class LeaseLoss:
    """The holder's lease ended with its worker."""

    lease_id: str
    reason: str


@dataclass(frozen=True)
class LeaseMove:
    """Another holder reattached the lease: this holder's stream ends."""

    lease_id: str


AcquireEvent = QueueUpdate | LeaseOffer | LeaseLoss | LeaseMove
#: The longest earlier wait a re-sent request may claim (AcquireRequest.waited_s), seconds.
MAX_WAITED_S = 86_400.0
#: Resume keys of ended sessions remembered (to tell an expired window from an unknown
#: token), at most.
MAX_ENDED_RESUMES = 10000


@dataclass(frozen=True)
class WorkerSnapshot:
    worker_id: str
    address: str
    engine: str
    slots: int
    slots_free: int
    modes: tuple[Mode, ...]
    health: Health
    detail: str
    lease_ids: tuple[str, ...]
    memory: MemoryFigures | None = None
    limits: EngineLimits | None = None
    headroom: Headroom | None = None
    admits: tuple[Mode, ...] = ()
    """The modes it would take one more session of now."""
    lease_modes: tuple[Mode | None, ...] = ()
    """The mode of each of `lease_ids` (None: not known)."""
    leases_by_mode: Mapping[Mode | None, int] = field(default_factory=dict)
    """How many leases it holds of each mode (None: not known), whole where `lease_ids`
    was cut by the status's bound."""


@dataclass(frozen=True)
class QueueEntry:
    ticket_id: str
    mode: Mode
    session_id: str
    position: int
    estimated_wait_s: float
    waited_s: float


@dataclass(frozen=True)
class RunningLease:
    lease_id: str
    worker_id: str
    mode: Mode | None
    session_id: str
    elapsed_s: float
    estimated_remaining_s: float


@dataclass(frozen=True)
class EtaSnapshot:
    alpha: float
    baseline_s: dict[Mode, float]
    mean_s: dict[Mode, float]
    """Observed modes only."""
    samples: dict[Mode, int]


@dataclass(frozen=True)
class StatusSnapshot:
    workers: tuple[WorkerSnapshot, ...]
    queue_length: int
    queue_max: int
    leases_active: int
    mean_session_s: dict[Mode, float]
    leases_detached: int = 0
    queue: tuple[QueueEntry, ...] = ()
    running: tuple[RunningLease, ...] = ()
    eta: EtaSnapshot | None = None


@dataclass
class _Ending:
    """Set when every stream of the present state must end: a drain, or a lost leadership;
    `error` is what their callers are told."""

    event: Signal = field(default_factory=Signal)
    error: SchedulerError = field(default_factory=ShuttingDown)


class Scheduler:
    """Owns the worker registry, the FIFO queue and the leases.

    With an election (--ha) it grants only while its `leadership` leads: a standby refuses
    requests and registrations with NotLeader, and one that stops leading ends every stream
    and forgets its state (the next leader rebuilds it from the workers and edges that come
    to it).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.registry = Registry()
        self.queue = WaitQueue(config.queue_max)
        self.leases = LeaseTable()
        self.sessions = SessionLengths(config.eta_alpha, config.eta_initial_s)
        self.counters = Counters()
        self.clock = LoopClock()
        """The scheduler's own pulse: its loop's lateness, and time net of its stalls."""
        self.liveness = Liveness(config.worker_timeout_s, self.clock)
        self.lost_grace_s = LOST_GRACE_S
        """Attended seconds a lost worker's leases wait for it to register again."""
        self._lost: dict[str, AttendedTimer] = {}
        """Lost workers whose leases wait out their grace, by worker id."""
        self.leadership = Leadership()
        self.metrics = SchedulerMetrics(self)
        self.draining = False
        """Set by drain(): no new registrations, requests or grants; leases stay as they are."""
        self._ended_resumes: dict[str, str] = {}
        """Resume keys of freed resumable leases -> "expired" or "closed" (newest last)."""
        self._ending = _Ending()

    # --- leadership ------------------------------------------------------------------

    def _check_open(self) -> None:
        """Refuse a call while draining (ShuttingDown) or not leading (NotLeader)."""
        if self.draining:
            raise ShuttingDown()
        self.leadership.check()

    def lead(self, epoch: int, name: str = "") -> None:
        """Start leading with `epoch` (Leadership.lead): from an empty state, which workers
        (registering) and edges (acquiring) rebuild."""
        self.leadership.lead(epoch, name)

    def follow(self, leader: str = "", epoch: int = 0) -> None:
        """Be (or stay) a standby of `leader` (its `epoch`, when known): refuse everything
        with NotLeader naming it. A scheduler that led ends every Acquire and Register
        stream (leases are not revoked: running sessions go on with their workers, which
        register with the next leader) and forgets its registry, queue and leases."""
        if not self.leadership.follow(leader, epoch):
            return
        error = self.leadership.not_leader()
        log.warning(
            "standing by: %d waiting requests and %d registrations ended, %d leases left to "
            "their workers",
            len(self.queue),
            len(self.registry),
            self.leases.count(LeaseState.ACTIVE),
        )
        ending, self._ending = self._ending, _Ending()
        ending.error = error
        ending.event.set()
        self._forget_lost()
        for ticket in self.queue:
            ticket.refused = error
            ticket.changed.set()
        for worker in self.registry:
            worker.outbox.put_nowait(None)
        # Handlers of the old state still finish: each finds its records unknown to the new
        # one and changes nothing.
        self.registry = Registry()
        self.queue = WaitQueue(self.config.queue_max)
        self.leases = LeaseTable()
        self._ended_resumes = {}

    def refusal(self) -> SchedulerError | None:
        """Why streams are being ended now (drain or standby); None while leading."""
        if self.draining:
            return ShuttingDown()
        return self.leadership.refusal()

    # --- workers ---------------------------------------------------------------------

    def register(self, hello: WorkerHello) -> Worker:
        """Add a worker (replacing a live one with the same id); returns its record.

        Raises InvalidRequest when the hello is incomplete, ShuttingDown while draining,
        NotLeader while a standby.
        """
        self._check_open()
        _check_hello(hello)
        worker = Worker(
            worker_id=hello.worker_id,
            address=hello.address,
            slots=hello.slots,
            modes=hello.modes,
            engine=hello.engine,
            health=hello.health,
            limits=hello.limits,
            headroom=hello.headroom,
        )
        self.liveness.seen(worker)
        old = self.registry.add(worker)
        claimed = set(hello.active_lease_ids)
        held = {h.lease_id: h for h in hello.held_leases if h.lease_id in claimed}
        if old is not None:
            log.info("worker %s re-registered; replacing its previous stream", worker.worker_id)
            self._adopt(old.worker_id, worker, claimed)
            old.outbox.put_nowait(None)
        elif (grace := self._lost.pop(worker.worker_id, None)) is not None:
            grace.cancel()
            log.info("worker %s is back within its grace: its sessions go on", worker.worker_id)
            self._adopt(worker.worker_id, worker, claimed)
        for lease_id in hello.active_lease_ids:
            if lease_id in worker.lease_slots:
                continue
            known = self.leases.get(lease_id)
            if known is not None:
                log.warning(
                    "worker %s claims lease %s of worker %s; ignored",
                    worker.worker_id,
                    lease_id,
                    known.worker_id,
                )
                continue
            self.leases.add(self._rebuilt(worker, lease_id, held.get(lease_id)))
        log.info(
            "worker %s registered at %s: %d slots, modes %s, engine %s, %s",
            worker.worker_id,
            worker.address,
            worker.slots,
            ",".join(sorted(m.value for m in worker.modes)),
            worker.engine,
            worker.health.value,
        )
        self.leadership.rebuilt_by(time.monotonic())
        self._dispatch()
        return worker

    def _rebuilt(self, worker: Worker, lease_id: str, held: HeldLease | None) -> Lease:
        """The lease of a session a registering worker serves that this scheduler did not
        grant (it began to lead since, or restarted): holderless (ORPHAN), freed on
        release. With its detail it counts for its key and can be reattached by its resume
        key, and a detached one waits out its time left; without, it is a taken slot."""
        if held is None or held.mode is None:
            held = HeldLease(lease_id)
        lease = Lease(
            worker_id=worker.worker_id,
            slot=worker.take_slot(lease_id, mode=held.mode),
            mode=held.mode,
            session_id=held.session_id,
            lease_id=lease_id,
            state=LeaseState.ORPHAN,
            key=held.key,
            resume_key=held.resume_key,
            owner=held.owner,
            resume_grace_s=held.resume_grace_s,
        )
        lease.announced.set()
        if held.detached and held.resume_key:
            left = max(0.0, min(held.resume_left_s, held.resume_grace_s))
            self.leases.set_state(lease, LeaseState.DETACHED)
            lease.detached_at = time.monotonic() - (held.resume_grace_s - left)
            lease.release_timer = asyncio.get_running_loop().call_later(
                left + self.config.release_timeout_s, self._detach_overdue, lease_id
            )
        return lease

    def report(
        self,
        worker: Worker,
        health: Health,
        detail: str,
        memory: MemoryFigures | None = None,
        headroom: Headroom | None = None,
        slots: int = 0,
    ) -> None:
        """Record a worker's health (and memory figures, headroom, slots now); a SERVING
        worker may take waiting requests."""
        self.counters.worker_reports += 1
        if not self.registry.is_current(worker):
            return
        if worker.health is not health:
            log.info(
                "worker %s is %s%s",
                worker.worker_id,
                health.value,
                f" ({detail})" if detail else "",
            )
        moved = worker.health is not health or bool(slots and slots != worker.slots)
        worker.health = health
        worker.detail = detail
        if memory is not None:
            worker.memory = memory
        if headroom is not None:
            worker.headroom = headroom
        if slots and slots != worker.slots:
            log.info(
                "worker %s holds %d sessions at most (was %d)",
                worker.worker_id,
                slots,
                worker.slots,
            )
            worker.slots = slots
        self.registry.touch(worker, reindex=moved)
        if health is Health.SERVING:
            self._dispatch()

    def release(self, worker: Worker, lease_id: str) -> None:
        """The worker is done with `lease_id`. Raises UnknownLease if it holds no such lease."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker_id != worker.worker_id:
            raise UnknownLease(lease_id)
        if lease.state is LeaseState.ACTIVE:
            # The holder still has the lease: keep the slot until its stream ends, so the
            # same slot is never leased twice.
            lease.worker_released = True
            return
        self._free(lease)

    def unregister(self, worker: Worker) -> None:
        """The worker's stream ended: it is gone, and every lease on it ends unless it
        registers again with them within `lost_grace_s` of attended time (its stream broke
        but it lives, or it was only slow): then its sessions go on, their holders none the
        wiser."""
        worker.outbox.put_nowait(None)
        if not self.registry.remove(worker):
            return
        if self.draining:
            # This scheduler ended the stream: the worker lives on, and so do its sessions.
            return
        self.counters.workers_lost += 1
        worker_id = worker.worker_id
        held = self.leases.on_worker(worker_id)
        if not held or self.lost_grace_s <= 0 or not _in_loop():
            log.warning("worker %s lost", worker_id)
            self._drop_leases(held, f"worker {worker_id} lost")
            return
        log.warning(
            "worker %s lost: its %d leases wait %.1f s for it to register again",
            worker_id,
            len(held),
            self.lost_grace_s,
        )
        self._lost[worker_id] = AttendedTimer(
            self.clock, self.lost_grace_s, self._grace_over, worker_id
        )

    def _grace_over(self, worker_id: str) -> None:
        """A lost worker did not come back within its grace: its leases end."""
        if self._lost.pop(worker_id, None) is None or self.registry.get(worker_id) is not None:
            return
        self._drop_leases(self.leases.on_worker(worker_id), f"worker {worker_id} lost")

    def _forget_lost(self) -> None:
        """Stop every lost worker's grace (a drain keeps their leases; a standby forgets
        them)."""
        for grace in self._lost.values():
            grace.cancel()
        self._lost = {}

    async def watch(self) -> None:
        """The scheduler's pulse and its workers' watchdog, for as long as it serves
        (server.start_server runs it): the probe wakes every `clock.tick_s` and notes how
        late (the loop's lag: metrics, and the stalls `attended` time leaves out); a few
        times per worker timeout every registration silent past it is ended
        (`_hang_up_silent`)."""
        clock = self.clock
        period_s = min(0.25, self.config.worker_timeout_s / 4)
        sweep_every = max(1, round(period_s / clock.tick_s))
        clock.start()
        try:
            for n in itertools.count(1):
                await asyncio.sleep(clock.tick_s)
                self.metrics.observe_loop_lag(clock.tick())
                if n % sweep_every == 0:
                    self._hang_up_silent()
        finally:
            clock.stop()

    def _hang_up_silent(self) -> None:
        """End the registration of every worker silent past the timeout while this
        scheduler listened (alive but hung: the TCP connection stays up, so only its
        missing reports tell). Its stream's end unregisters it; no new lease goes to it
        meanwhile."""
        for worker in self.registry:
            if worker.hung_up or not self.liveness.hung(worker):
                continue
            worker.hung_up = True
            self.counters.workers_hung += 1
            log.warning(
                "worker %s silent for %.1fs: treating it as hung",
                worker.worker_id,
                self.liveness.silence_s(worker),
            )
            worker.outbox.put_nowait(None)

    def lease_announced(self, lease: Lease) -> None:
        """The worker's stream has passed on the grant of `lease`."""
        lease.announced.set()

    # --- requests --------------------------------------------------------------------

    async def acquire(
        self,
        mode: Mode,
        session_id: str,
        resume_key: str = "",
        owner: str = "",
        resume_grace_s: float = 0.0,
        key: str = "",
        key_limit: int = 0,
        waited_s: float = 0.0,
        previous_position: int = 0,
    ) -> AsyncGenerator[AcquireEvent, None]:
        """Queue updates, then the lease, then (if its worker is lost) the loss.

        The lease lasts until this generator is closed (a resumable one, `resume_key` and
        a grace, waits detached for a Reattach then). Raises NoWorker, QueueFull,
        KeySessionLimit (`key` holds `key_limit` sessions: waiting, leased or detached),
        ShuttingDown when the scheduler drains (the lease, if any, stays with its worker)
        and NotLeader from a standby (or a leader that steps down meanwhile).

        `waited_s` > 0: a caller re-sent after a switch of leader, which an earlier leader
        had queued (at `previous_position`): it waits ahead of the callers that came here
        first, in its earlier order, and is not refused again for its key's limit or a full
        queue (the new leader may over-admit for a moment instead, before every request
        and worker has come back to it).
        """
        self._check_open()
        now = time.monotonic()
        if not self.registry.serves(mode) and not self.leadership.rebuilding(now):
            raise NoWorker(mode.value)
        resent = waited_s > 0
        if resent:
            self.leadership.rebuilt_by(now)
        if key and key_limit and not resent:
            held = self.leases.held_by(key) + self.queue.with_key(key)
            if held >= key_limit:
                self.counters.key_limit_rejections += 1
                raise KeySessionLimit(held, key_limit)
        ticket = Ticket(
            mode=mode,
            session_id=session_id,
            key=key if key_limit else "",
            enqueued_at=now - min(max(waited_s, 0.0), MAX_WAITED_S),
            previous_position=previous_position if resent else 0,
        )
        if resume_key and resume_grace_s > 0:
            ticket.resume_key, ticket.owner = resume_key, owner
            ticket.resume_grace_s = resume_grace_s
        # Behind anyone already waiting for this mode: the queue is FIFO.
        waiting = self.queue.waiting(mode) > 0
        worker = None if waiting else self.registry.pick(mode, self.config.realtime_margin)
        if worker is not None:
            # After every change the queue is dispatched, so nobody waiting can use this slot.
            self._grant(ticket, worker)
        else:
            try:
                self.queue.push(ticket, over_max=resent)
            except QueueFull:
                self.counters.queue_full_rejections += 1
                raise
        moved: Signal | None = None
        try:
            async for update in self._wait(ticket):
                yield update
            lease = ticket.lease
            assert lease is not None
            moved = lease.moved
            async for event in self._hold(
                lease, ticket.ticket_id, lease.granted_at - ticket.enqueued_at
            ):
                yield event
        finally:
            if ticket.lease is not None:
                if moved is None or not moved.is_set():
                    self._holder_gone(ticket.lease)
            elif self.queue.remove(ticket):
                self._notify_waiting()

    async def reattach(self, resume_key: str, owner: str) -> AsyncGenerator[AcquireEvent, None]:
        """A resumable session's lease for a new holder: the offer at once, then as acquire.

        A detached lease is taken back; one still held moves (its holder is told). Raises
        ResumeUnknown, ResumeExpired or ResumeForbidden (NotLeader from a standby).
        """
        self._check_open()
        lease = self.leases.by_resume_key(resume_key)
        if lease is None or lease.state is LeaseState.RETURNING:
            if lease is not None or self._ended_resumes.get(resume_key) == "expired":
                raise ResumeExpired()
            raise ResumeUnknown()
        if not hmac.compare_digest(lease.owner, owner):
            raise ResumeForbidden()
        if lease.worker_released or lease.worker_id in self._lost:
            # The session ended (its holder has not let go yet), or its worker is lost
            # and may not come back.
            raise ResumeUnknown()
        if lease.state in (LeaseState.DETACHED, LeaseState.ORPHAN):
            # ORPHAN: rebuilt from its worker's hello after a switch of leader, with no
            # holder here (its edge's stream went with the old leader); the worker still
            # tells whether the session can be resumed.
            if lease.release_timer is not None:
                lease.release_timer.cancel()
                lease.release_timer = None
            self.leases.set_state(lease, LeaseState.ACTIVE)
            log.info("lease %s reattached (session %s)", lease.lease_id, lease.session_id)
        else:  # held: the present holder is superseded
            previous, lease.moved = lease.moved, Signal()
            previous.set()
            log.info(
                "lease %s moved to a new holder (session %s)", lease.lease_id, lease.session_id
            )
        self.counters.leases_reattached += 1
        moved = lease.moved
        try:
            async for event in self._hold(lease, lease.ticket_id, 0.0):
                yield event
        finally:
            if not moved.is_set():
                self._holder_gone(lease)

    async def _hold(
        self, lease: Lease, ticket_id: str, queue_wait_s: float
    ) -> AsyncGenerator[AcquireEvent, None]:
        """The offer of `lease` to its holder, then its loss or its move; returns then."""
        moved = lease.moved
        ending = self._ending
        # The worker must know the lease before the holder can present it.
        if not await self._unless_ending(ending, lease.announced):
            raise ending.error
        if lease.lost_reason is None:
            worker = self.registry.get(lease.worker_id)
            yield LeaseOffer(
                lease_id=lease.lease_id,
                worker_id=lease.worker_id,
                worker_address=worker.address if worker else "",
                slot=lease.slot,
                ticket_id=ticket_id,
                queue_wait_s=queue_wait_s,
                limits=worker.limits if worker else None,
                epoch=self.leadership.epoch,
            )
            if not await self._unless_ending(ending, lease.lost, moved):
                raise ending.error
            if moved.is_set() and not lease.lost.is_set():
                yield LeaseMove(lease.lease_id)
                return
        yield LeaseLoss(lease.lease_id, lease.lost_reason or "lease lost")

    async def _unless_ending(self, ending: _Ending, *events: Signal) -> bool:
        """Wait for any of `events`; False if `ending` (drain, step-down) comes first."""
        await first_set(ending.event, *events)
        return any(e.is_set() for e in events)

    async def _wait(self, ticket: Ticket) -> AsyncIterator[QueueUpdate]:
        """Updates while `ticket` waits: on every position change and at least every interval.

        Raises ShuttingDown when the scheduler drains before the ticket is granted.
        """
        interval = self.config.queue_update_interval_s
        last_position = 0
        last_sent = 0.0
        while ticket.lease is None:
            if ticket.refused is not None:
                raise ticket.refused
            if self.draining:
                raise ShuttingDown()
            if ticket.cancelled:
                raise Cancelled()
            ticket.changed.clear()
            position = self.queue.position(ticket)
            # A new position, or a new way to estimate (SetEta), goes out at once.
            if (
                position != last_position
                or ticket.estimate_changed
                or time.monotonic() - last_sent >= interval
            ):
                ticket.estimate_changed = False
                yield self._queue_update(ticket, position)
                last_position, last_sent = position, time.monotonic()
                continue
            try:
                async with asyncio.timeout(max(0.0, last_sent + interval - time.monotonic())):
                    await ticket.changed.wait()
            except TimeoutError:
                pass

    def _queue_update(self, ticket: Ticket, position: int) -> QueueUpdate:
        return QueueUpdate(
            position=position,
            queue_length=len(self.queue),
            estimated_wait_s=estimate_wait_s(
                position,
                self.sessions.mean_s(ticket.mode),
                self.registry.serving_capacity(ticket.mode, self.config.realtime_margin),
                self.leases.grants(ticket.mode),
                time.monotonic(),
            ),
            ticket_id=ticket.ticket_id,
        )

    def cancel(self, ticket_id: str) -> bool:
        """An operator takes a waiting request out of the queue: its Acquire stream ends
        with Cancelled. False when no request with that ticket waits (NotLeader from a
        standby)."""
        self._check_open()
        ticket = self.queue.get(ticket_id)
        if ticket is None or not self.queue.remove(ticket):
            return False
        ticket.cancelled = True
        ticket.changed.set()
        self._notify_waiting()
        log.info("ticket %s (session %s) cancelled by an operator", ticket_id, ticket.session_id)
        return True

    def eta(self) -> EtaSnapshot:
        """How waits are estimated now."""
        lengths = self.sessions
        return EtaSnapshot(
            alpha=lengths.alpha,
            baseline_s=dict(lengths.baseline_s),
            mean_s={m: s for m in Mode if (s := lengths.observed_s(m)) is not None},
            samples=dict(lengths.samples),
        )

    def set_eta(self, alpha: float | None, baseline_s: dict[Mode, float]) -> EtaSnapshot:
        """Change the estimate at run time (ValueError out of range); waiting clients get
        their new estimate with their next update (NotLeader from a standby)."""
        self._check_open()
        self.sessions.configure(alpha, baseline_s)
        for ticket in self.queue:
            ticket.estimate_changed = True
        self._notify_waiting()
        return self.eta()

    def drain(self) -> None:
        """Stop for good: refuse new registrations and requests, end every Acquire stream
        (waiting ones with ShuttingDown, lease holders too) and every Register stream,
        without revoking or losing any lease: running sessions go on with their workers,
        which re-register with them at the next scheduler."""
        if self.draining:
            return
        self.draining = True
        log.info(
            "draining: %d waiting requests refused, %d leases left to their workers",
            len(self.queue),
            self.leases.count(LeaseState.ACTIVE),
        )
        self._ending.event.set()
        self._forget_lost()
        for ticket in self.queue:
            ticket.changed.set()
        for worker in self.registry:
            worker.outbox.put_nowait(None)

    # --- status ----------------------------------------------------------------------

    def _queue_entry(self, ticket: Ticket, now: float) -> QueueEntry:
        position = self.queue.position(ticket)
        return QueueEntry(
            ticket_id=ticket.ticket_id,
            mode=ticket.mode,
            session_id=ticket.session_id,
            position=position,
            estimated_wait_s=self._queue_update(ticket, position).estimated_wait_s,
            waited_s=now - ticket.enqueued_at,
        )

    def _worker_snapshot(self, w: Worker, listed: bool) -> WorkerSnapshot:
        """One worker as the status shows it; its lease ids (their modes, and its headroom's
        late units per lease) only when `listed`, their counts by mode always."""
        ids = tuple(sorted(w.lease_slots, key=w.lease_slots.__getitem__)) if listed else ()
        room = w.headroom
        if room is not None and room.late_by_lease and not listed:
            room = dataclasses.replace(room, late_by_lease={})
        return WorkerSnapshot(
            worker_id=w.worker_id,
            address=w.address,
            engine=w.engine,
            slots=w.slots,
            slots_free=w.slots_free,
            modes=tuple(m for m in Mode if m in w.modes),
            health=w.health,
            detail=w.detail,
            lease_ids=ids,
            lease_modes=tuple(w.lease_modes.get(lease_id) for lease_id in ids),
            leases_by_mode=dict(w.mode_counts),
            memory=w.memory,
            limits=w.limits,
            headroom=room,
            admits=tuple(
                m for m in Mode if m in w.modes and w.can_take(m, self.config.realtime_margin)
            ),
        )

    def _worker_snapshots(self, max_entries: int | None) -> tuple[WorkerSnapshot, ...]:
        """Every worker; their lease lists whole, in registry order, until the next would
        take the ids listed past `max_entries` (None: all), the rest without theirs."""
        budget = math.inf if max_entries is None else max_entries
        out = []
        for w in self.registry:
            listed = len(w.lease_slots) <= budget
            budget = budget - len(w.lease_slots) if listed else 0
            out.append(self._worker_snapshot(w, listed))
        return tuple(out)

    def status(self, max_entries: int | None = None, ticket_id: str = "") -> StatusSnapshot:
        """A consistent snapshot of workers, queue and leases: the first `max_entries` of
        the queue, of the running leases (longest-running first) and of the workers' lease
        ids (None: all), or with `ticket_id` that waiting request's entry alone (none if it
        does not wait), no lease and no worker. The counts are always the whole fleet's."""
        workers = () if ticket_id else self._worker_snapshots(max_entries)
        now = time.monotonic()
        if ticket_id:
            found = self.queue.get(ticket_id)
            tickets: list[Ticket] = [found] if found is not None else []
        else:
            tickets = list(itertools.islice(self.queue.ordered(), max_entries))
        queue = tuple(self._queue_entry(t, now) for t in tickets)
        running = tuple(
            RunningLease(
                lease_id=lease.lease_id,
                worker_id=lease.worker_id,
                mode=lease.mode,
                session_id=lease.session_id,
                elapsed_s=now - lease.granted_at,
                estimated_remaining_s=max(
                    0.0,
                    (self.sessions.mean_s(lease.mode) if lease.mode else 0.0)
                    - (now - lease.granted_at),
                ),
            )
            for lease in ([] if ticket_id else self.leases.active(max_entries))
        )
        return StatusSnapshot(
            workers=workers,
            queue_length=len(self.queue),
            queue_max=self.queue.queue_max,
            leases_active=self.leases.count(LeaseState.ACTIVE),
            leases_detached=self.leases.count(LeaseState.DETACHED),
            mean_session_s={mode: self.sessions.mean_s(mode) for mode in Mode},
            queue=queue,
            running=running,
            eta=self.eta(),
        )

    # --- internals -------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant, in FIFO order, every waiting request that a free slot can serve. Once no
        worker takes a mode, no later request of it can be served: the walk stops when
        that holds for every mode waiting (a full fleet: after one look, not the queue)."""
        if self.draining or not self.leadership.leads() or not len(self.queue):
            return
        granted: list[Ticket] = []
        full: set[Mode] = set()
        waiting = self.queue.modes()
        for ticket in self.queue.ordered():
            if ticket.mode in full:
                continue
            worker = self.registry.pick(ticket.mode, self.config.realtime_margin)
            if worker is None:
                full.add(ticket.mode)
                if full >= waiting:
                    break
                continue
            self._grant(ticket, worker)
            granted.append(ticket)
        for ticket in granted:
            self.queue.remove(ticket)
        if granted:
            self._notify_waiting()

    def _grant(self, ticket: Ticket, worker: Worker) -> None:
        lease = Lease(
            worker_id=worker.worker_id,
            slot=0,
            mode=ticket.mode,
            session_id=ticket.session_id,
            ticket_id=ticket.ticket_id,
            key=ticket.key,
            resume_key=ticket.resume_key,
            owner=ticket.owner,
            resume_grace_s=ticket.resume_grace_s,
        )
        lease.slot = worker.take_slot(lease.lease_id, mode=ticket.mode)
        self.leases.add(lease)
        self.counters.leases_granted += 1
        self.metrics.observe_queue_wait(ticket.mode.value, lease.granted_at - ticket.enqueued_at)
        worker.outbox.put_nowait(LeaseGrantNotice(lease))
        ticket.lease = lease
        ticket.changed.set()
        log.info(
            "lease %s: worker %s slot %d, %s, session %s",
            lease.lease_id,
            worker.worker_id,
            lease.slot,
            ticket.mode.value,
            ticket.session_id or "-",
            # Granted from whichever task freed the slot: name the session explicitly.
            extra={"session_id": ticket.session_id or None},
        )

    def _notify_waiting(self) -> None:
        for ticket in self.queue:
            ticket.changed.set()

    def _holder_gone(self, lease: Lease) -> None:
        """The holder's stream ended: ask the worker to release the lease."""
        if self.draining:
            return  # the stream was ended by the drain: the session goes on
        if lease.state is not LeaseState.ACTIVE or self.leases.get(lease.lease_id) is not lease:
            return
        assert lease.mode is not None
        self.sessions.observe(lease.mode, time.monotonic() - lease.granted_at)
        self.counters.leases_returned += 1
        if lease.worker_released:
            self._free(lease)
            return
        worker = self.registry.get(lease.worker_id)
        if lease.resume_grace_s > 0 and worker is not None:
            # The worker keeps the session detached for the grace and releases the lease
            # when it passes; past grace + release timeout the slot is taken back anyway.
            self.leases.set_state(lease, LeaseState.DETACHED)
            lease.detached_at = time.monotonic()
            lease.release_timer = asyncio.get_running_loop().call_later(
                lease.resume_grace_s + self.config.release_timeout_s,
                self._detach_overdue,
                lease.lease_id,
            )
            # A lease whose session never started has nothing to resume: the worker
            # releases it at once.
            worker.outbox.put_nowait(
                LeaseRevokeNotice(lease.lease_id, "holder gone", unused_only=True)
            )
            log.info(
                "lease %s detached: resumable for %.0f s (session %s)",
                lease.lease_id,
                lease.resume_grace_s,
                lease.session_id,
            )
            return
        self.leases.set_state(lease, LeaseState.RETURNING)
        if worker is None:
            self._free(lease)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Finalized outside the loop (shutdown): nobody is left to wait for the worker.
            self._free(lease)
            return
        worker.outbox.put_nowait(LeaseRevokeNotice(lease.lease_id, "holder gone"))
        lease.release_timer = loop.call_later(
            self.config.release_timeout_s, self._release_overdue, lease.lease_id
        )

    def _detach_overdue(self, lease_id: str) -> None:
        """A detached lease the worker did not release after its grace: revoke it."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.DETACHED:
            return
        lease.release_timer = None
        self.leases.set_state(lease, LeaseState.RETURNING)
        worker = self.registry.get(lease.worker_id)
        if worker is None:
            self._free(lease)
            return
        worker.outbox.put_nowait(LeaseRevokeNotice(lease.lease_id, "resume window passed"))
        lease.release_timer = asyncio.get_running_loop().call_later(
            self.config.release_timeout_s, self._release_overdue, lease.lease_id
        )

    def _release_overdue(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.RETURNING:
            return
        lease.release_timer = None
        self.counters.leases_expired += 1
        log.warning(
            "worker %s did not release lease %s within %.1f s; freeing slot %d anyway",
            lease.worker_id,
            lease_id,
            self.config.release_timeout_s,
            lease.slot,
        )
        self._free(lease)

    def _free(self, lease: Lease) -> None:
        self.leases.pop(lease.lease_id)
        if lease.resume_key:
            # A resume after this is refused with why: the window passed (the lease was
            # detached or being taken back) or the session ended.
            # (a detached session the worker ended before its grace passed was closed:
            # its close raced the holder's end, or it reached its time limit)
            waited = time.monotonic() - lease.detached_at
            expired = lease.state is LeaseState.RETURNING or (
                lease.state is LeaseState.DETACHED and waited >= lease.resume_grace_s - 0.5
            )
            fate = "expired" if expired else "closed"
            self._ended_resumes[lease.resume_key] = fate
            while len(self._ended_resumes) > MAX_ENDED_RESUMES:
                self._ended_resumes.pop(next(iter(self._ended_resumes)))
        worker = self.registry.get(lease.worker_id)
        if worker is not None:
            worker.free_slot(lease.lease_id)
        self._dispatch()

    def _adopt(self, worker_id: str, new: Worker, claimed: set[str]) -> None:
        """Move the leases of `worker_id`'s previous registration that the new one still
        serves; the rest end."""
        dropped = []
        for lease in self.leases.on_worker(worker_id):
            if lease.lease_id not in claimed:
                dropped.append(lease)
                continue
            lease.slot = new.take_slot(lease.lease_id, preferred=lease.slot, mode=lease.mode)
            lease.announced.set()
            if lease.state is LeaseState.RETURNING:
                new.outbox.put_nowait(LeaseRevokeNotice(lease.lease_id, "holder gone"))
        self._drop_leases(dropped, f"worker {worker_id} re-registered without the lease")

    def _drop_leases(self, leases: Iterable[Lease], reason: str) -> None:
        """End leases whose worker no longer serves them; their holders are told."""
        for lease in leases:
            self.leases.pop(lease.lease_id)
            if lease.state is LeaseState.ACTIVE:
                self.counters.leases_lost += 1
                lease.lost_reason = reason
                lease.lost.set()
                lease.announced.set()
                log.warning("lease %s lost: %s", lease.lease_id, reason)


def _in_loop() -> bool:
    """True when called on a running event loop (timers can be set)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _check_hello(hello: WorkerHello) -> None:
    if not hello.worker_id:
        raise InvalidRequest("hello.worker_id must not be empty")
    if not hello.address:
        raise InvalidRequest("hello.address must not be empty")
    if hello.slots < 1:
        raise InvalidRequest("hello.slots must be at least 1")
    if not hello.modes:
        raise InvalidRequest("hello.modes must name at least one mode")
    limits = hello.limits
    if limits is not None and not (
        1 <= limits.min_slice_nums <= limits.max_slice_nums
        and 1 <= limits.min_unit_samples <= limits.max_unit_samples
    ):
        raise InvalidRequest("hello.limits: each minimum must be from 1 to its maximum")
