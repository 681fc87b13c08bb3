"""The worker's side of SchedulerService.Register: hello, reports, lease grants and releases.

The worker is registered while the stream lives. When it breaks (scheduler restart), the
worker keeps serving its sessions and reconnects with backoff forever, re-sending hello
with the leases still in use.

Active/standby schedulers (several addresses): the worker registers with the one that leads
(common.schedulers), keeps asking the others while registered, and moves at once to one
that leads with a higher epoch (its own may be paused or cut off). It remembers the highest
epoch seen and refuses grants (and registrations) of a lower one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnifabric.common import limits as engine_limits
from omnifabric.common import modes, schedulers
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.worker.engine import EngineLimits
from omnifabric.worker.errors import StaleLease
from omnifabric.worker.headroom import HeadroomFigures
from omnifabric.worker.leases import LeaseGrant
from omnifabric.worker.runtime import Health, WorkerRuntime

log = logging.getLogger("omnifabric.worker.registration")

#: Seconds between reports sent even when nothing changed: the scheduler's liveness signal.
HEARTBEAT_S = 1.0


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Client channel options: keepalive to notice a dead or hung scheduler within seconds."""
    return [
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.ping_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def limits_pb(limits: EngineLimits) -> common_pb2.EngineLimits:
    """The engine's limits as the hello carries them to the scheduler (and on to edges)."""
    return engine_limits.to_pb(limits)


def headroom_pb(figures: HeadroomFigures | None) -> scheduler_pb.Headroom | None:
    """The worker's headroom as hello and reports carry it (None before warm-up)."""
    if figures is None:
        return None
    return scheduler_pb.Headroom(
        engine_threads=figures.engine_threads,
        costs=[
            scheduler_pb.ModeCost(
                mode=modes.to_pb(mode),
                session_cost=cost.session_cost,
                added_cost=cost.added_cost,
                peak_cost=cost.peak_cost,
                added_peak=cost.added_peak,
            )
            for mode, cost in sorted(figures.costs.items())
            if mode in modes.NAMES
        ],
        late_units_recent=figures.late_recent,
        late_units_total=figures.late_total,
        late_window_s=figures.late_window_s,
        unit_p95_ratio=figures.unit_p95_ratio,
        late_units_by_lease=figures.late_by_lease,
    )


def _health_value(health: Health) -> common_pb2.WorkerHealth:
    if health.serving:
        return common_pb2.WORKER_HEALTH_SERVING
    return common_pb2.WORKER_HEALTH_NOT_SERVING


class Registration:
    """Keeps this worker registered with the scheduler; feeds the runtime's lease book."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        worker_id: str,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.runtime = runtime
        self.credentials = credentials
        """TLS credentials for the scheduler channel; None = plaintext."""
        self.worker_id = worker_id
        self.address = address
        self.config = runtime.config
        self.registered = asyncio.Event()
        """Set while a Register stream is up and the scheduler answered `registered`."""
        self.registrations = 0
        """Successful registrations so far (reconnects included)."""
        self._outbox: asyncio.Queue[scheduler_pb.RegisterRequest | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.addresses = schedulers.addresses(self.config.scheduler_address)
        """Every scheduler address (several: active/standby schedulers)."""
        self._index = 0
        self._epoch = 0
        """The epoch of the present registration."""
        self._probes: list[grpc.aio.Channel] = []
        runtime.leases.on_released = self.lease_released
        runtime.health_listeners.append(self.report)
        runtime.memory_listeners.append(lambda: self.report(runtime.health))

    @property
    def scheduler_address(self) -> str:
        """The scheduler registered with (or tried next)."""
        return self.addresses[self._index]

    def start(self) -> None:
        if len(self.addresses) > 1:
            options = channel_options(self.config.max_message_bytes)
            self._probes = [
                grpc.aio.insecure_channel(a, options=options)
                if self.credentials is None
                else grpc.aio.secure_channel(a, self.credentials, options=options)
                for a in self.addresses
            ]
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (lease releases, last report), half-close the stream and
        wait up to `flush_timeout` s for the scheduler to end it, then cancel what is left.

        An empty outbox is not proof of delivery: gRPC may still hold the last messages,
        and cancelling the call then drops them (a lease the scheduler never sees back)."""
        self._stopping = True
        outbox, task = self._outbox, self._task
        if outbox is not None and task is not None and not task.done():
            outbox.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(task), flush_timeout)
            except TimeoutError:
                log.warning("scheduler did not end the registration within %.1f s", flush_timeout)
            except Exception:
                pass  # _run logged it
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for channel in self._probes:
            await channel.close()

    def report(self, health: Health) -> None:
        """Tell the scheduler the health changed (hello carries it when disconnected)."""
        self._send(self._report_request(health))

    def _report_request(self, health: Health) -> scheduler_pb.RegisterRequest:
        return scheduler_pb.RegisterRequest(
            report=scheduler_pb.WorkerReport(
                health=_health_value(health),
                detail=health.detail,
                memory=self._memory(),
                headroom=headroom_pb(self.runtime.headroom_figures()),
                slots=self.runtime.slots,
            )
        )

    def _memory(self) -> common_pb2.MemoryStats | None:
        runtime = self.runtime
        base, last = runtime.baseline, runtime.last_cleanup
        if base is None:
            return None
        current = last or base
        stats = common_pb2.MemoryStats(
            device=current.device,
            allocated_bytes=current.after_bytes,
            baseline_bytes=base.after_bytes,
            before_cleanup_bytes=last.before_bytes if last else 0,
            cleanups=runtime.cleanups,
        )
        kv = runtime.engine.kv_figures()
        if kv is not None:
            stats.kv_slots = kv.slots
            stats.kv_slot_tokens = kv.slot_tokens
            stats.kv_slot_bytes = kv.slot_bytes
            stats.kv_slots_more = kv.more_slots
        return stats

    def lease_released(self, lease_id: str) -> None:
        """Tell the scheduler the lease's session is freed (hello omits it when disconnected)."""
        self._send(
            scheduler_pb.RegisterRequest(
                lease_released=scheduler_pb.LeaseReleased(lease_id=lease_id)
            )
        )

    def _send(self, request: scheduler_pb.RegisterRequest) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(request)

    def _hello(self) -> scheduler_pb.RegisterRequest:
        runtime = self.runtime
        held = self._held_leases()
        return scheduler_pb.RegisterRequest(
            hello=scheduler_pb.WorkerHello(
                worker_id=self.worker_id,
                address=self.address,
                slots=runtime.slots,
                modes=sorted(modes.to_pb(m) for m in runtime.engine.modes if m in modes.NAMES),
                engine=runtime.engine.name,
                health=_health_value(runtime.health),
                active_lease_ids=[h.lease_id for h in held],
                limits=limits_pb(runtime.engine.limits),
                headroom=headroom_pb(runtime.headroom_figures()),
                held_leases=held,
            )
        )

    def _held_leases(self) -> list[scheduler_pb.HeldLease]:
        """Every lease standing (sessions served now, then grants not used yet), as its
        grant described it, and whether its session waits detached for a resume (a new
        leader rebuilds its lease table from these)."""
        held = []
        for grant in self.runtime.leases.held():
            session = self.runtime.sessions.get(grant.lease_id)
            left = session.resume_left_s() if session is not None else None
            held.append(
                scheduler_pb.HeldLease(
                    lease_id=grant.lease_id,
                    mode=(
                        modes.to_pb(grant.mode)
                        if grant.mode in modes.NAMES
                        else common_pb2.MODE_UNSPECIFIED
                    ),
                    session_id=grant.session_id,
                    key=grant.key,
                    resume_key=grant.resume_key,
                    owner=grant.owner,
                    resume_grace_s=grant.resume_grace_s,
                    detached=left is not None,
                    resume_left_s=left or 0.0,
                )
            )
        return held

    async def _run(self) -> None:
        backoff = self.config.register_backoff_s
        while True:
            if self._probes:
                await self._find_leader()
            try:
                if await self._connect_once():
                    backoff = self.config.register_backoff_s
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "registration with %s %s: %s %s%s",
                    self.scheduler_address,
                    "broke" if self.registered.is_set() else "failed",
                    exc.code().name,
                    exc.details() or "",
                    self._tls_hint(exc),
                )
            except Exception:
                log.exception("registration with %s failed", self.scheduler_address)
            finally:
                self.registered.clear()
                self._outbox = None
            if self._stopping:
                return
            # Grants not used yet stay a while (their holders may have them; the next
            # registration reports them), then go back.
            kept = self.runtime.leases.expire_unused()
            if kept:
                log.info("%d lease grants not used yet: kept for their holders", len(kept))
            if self._probes:
                # The leader is asked anew first; its answers pace the retries.
                await asyncio.sleep(self.config.register_backoff_s)
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.register_backoff_max_s)

    async def _find_leader(self) -> None:
        """Ask every scheduler until one leads; register with it next."""
        stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in self._probes]
        while True:
            answer, highest = await schedulers.find_leader(stubs)
            self.runtime.leases.observe_epoch(highest)
            if answer is not None and answer.epoch >= self.runtime.leases.epoch:
                self._index = answer.index
                return
            await asyncio.sleep(self.config.register_backoff_s)

    async def _watch_leader(self) -> None:
        """While registered: return once another scheduler leads with a higher epoch than
        the present registration's (this one may be paused, or cut off from the store)."""
        stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in self._probes]
        while True:
            await asyncio.sleep(schedulers.WATCH_INTERVAL_S)
            answer, highest = await schedulers.find_leader(stubs)
            # Grants of an older leadership are refused from here on.
            self.runtime.leases.observe_epoch(highest)
            if answer is not None and answer.index != self._index and answer.epoch > self._epoch:
                log.warning(
                    "scheduler %s leads with epoch %d (registered with %s, epoch %d): moving",
                    self.addresses[answer.index],
                    answer.epoch,
                    self.scheduler_address,
                    self._epoch,
                )
                self._index = answer.index
                return

    def _tls_hint(self, exc: grpc.aio.AioRpcError) -> str:
        """A hint for the log when a connection failure may be a TLS mismatch."""
        refused = "connection refused" in (exc.details() or "").lower()
        if exc.code() is not grpc.StatusCode.UNAVAILABLE or self.registered.is_set() or refused:
            return ""  # not a handshake problem: nobody listens there (yet)
        if self.credentials is None:
            return (
                " (plaintext channel: a scheduler that speaks TLS refuses it; "
                "set OMNI_FABRIC_TLS_CA / --fabric-tls-ca)"
            )
        return " (TLS channel: check that the scheduler's certificate is signed by the CA)"

    async def _connect_once(self) -> bool:
        """One Register stream from hello to its end; True if it got registered."""
        outbox: asyncio.Queue[scheduler_pb.RegisterRequest | None] = asyncio.Queue()
        outbox.put_nowait(self._hello())
        self._outbox = outbox

        async def requests() -> AsyncIterator[scheduler_pb.RegisterRequest]:
            while True:
                request = await outbox.get()
                if request is None:
                    return
                yield request

        async def heartbeat() -> None:
            # The scheduler drops a worker whose reports stop (hung process): report every
            # HEARTBEAT_S even when nothing changed.
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                outbox.put_nowait(self._report_request(self.runtime.health))

        beats = asyncio.ensure_future(heartbeat())
        options = channel_options(self.config.max_message_bytes)
        address = self.scheduler_address
        if self.credentials is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            channel = grpc.aio.secure_channel(address, self.credentials, options=options)
        self._epoch = 0
        registered: list[bool] = []
        tasks: list[asyncio.Future[Any]] = [beats]
        try:
            async with channel as ch:
                if not self._probes:
                    return await self._serve_stream(ch, requests(), registered)
                serve = asyncio.ensure_future(self._serve_stream(ch, requests(), registered))
                watch = asyncio.ensure_future(self._watch_leader())
                tasks += [serve, watch]
                await asyncio.wait((serve, watch), return_when=asyncio.FIRST_COMPLETED)
                if serve.done():
                    return serve.result()
                return bool(registered)  # another leads: the stream is cancelled below
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve_stream(
        self,
        ch: grpc.aio.Channel,
        requests: AsyncIterator[scheduler_pb.RegisterRequest],
        registered: list[bool],
    ) -> bool:
        """Read the Register stream until it ends (appending to `registered` once the
        scheduler answers); True if it got registered."""
        call = scheduler_grpc.SchedulerServiceStub(ch).Register(requests)
        async for response in call:
            kind = response.WhichOneof("kind")
            if kind == "registered":
                epoch = response.registered.epoch
                if not self.runtime.leases.observe_epoch(epoch):
                    log.warning(
                        "scheduler %s registered us with epoch %d, older than epoch %d: leaving it",
                        self.scheduler_address,
                        epoch,
                        self.runtime.leases.epoch,
                    )
                    call.cancel()
                    return False
                self._epoch = epoch
                registered.append(True)
                self.registrations += 1
                self.registered.set()
                log.info(
                    "registered with scheduler %s as %s%s",
                    self.scheduler_address,
                    self.worker_id,
                    f" (epoch {epoch})" if epoch else "",
                )
            elif kind == "lease_granted":
                try:
                    self._on_granted(response.lease_granted)
                except StaleLease as exc:
                    # An old leader that has not heard it lost: nothing it grants holds.
                    log.warning("scheduler %s: %s; leaving it", self.scheduler_address, exc)
                    call.cancel()
                    return bool(registered)
            elif kind == "lease_revoked":
                revoked = response.lease_revoked
                self.runtime.leases.revoke(revoked.lease_id, revoked.reason, revoked.unused_only)
        if not self._stopping:
            log.warning("scheduler %s ended the registration stream", self.scheduler_address)
        return bool(registered)

    def _on_granted(self, granted: scheduler_pb.LeaseGranted) -> None:
        mode = modes.name(granted.mode)
        if mode is None:
            log.warning("lease %s granted for an unsupported mode", granted.lease_id)
            self.lease_released(granted.lease_id)
            return
        self.runtime.leases.grant(
            LeaseGrant(
                lease_id=granted.lease_id,
                slot=granted.slot,
                mode=mode,
                session_id=granted.session_id,
                epoch=granted.epoch,
                key=granted.key,
                resume_key=granted.resume_key,
                owner=granted.owner,
                resume_grace_s=granted.resume_grace_s,
            )
        )
