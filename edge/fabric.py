"""gRPC clients of the fabric: one channel to the scheduler, one per worker address, and
the wait for a lease on an Acquire (or Reattach) stream. What the messages hold and what a
failed call's status means for the client are edge.worker_client's.

Active/standby schedulers (several addresses in OMNI_EDGE_SCHEDULER): `scheduler` calls the
one that leads, as a background task learns by asking each (common.schedulers) every half
second; a call made during a switch may reach the old one and be refused (UNAVAILABLE).

TLS (OMNI_FABRIC_TLS_*): with a CA the edge dials the scheduler and the workers over TLS
and checks their certificates against that CA; with a certificate and key as well it
presents them (servers that were given a CA require that). Without a CA: plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc

from omnifabric.common import schedulers, tls
from omnifabric.edge import events as ev
from omnifabric.edge.errors import ServiceUnavailable
from omnifabric.edge.worker_client import (
    Lease,
    _from_scheduler,
    acquire_reply,
    lease_error,
    queued_position,
)
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc

log = logging.getLogger(__name__)

#: A forgotten worker channel stays open this long for the calls still on it.
CHANNEL_LINGER_S = 30.0
#: How long a session's start, failed in the transport, waits for the worker's connection
#: to be made again before its one retry (``redial_worker``): more than the channels' longest
#: reconnect backoff (2 s, ``channel_options``), which a new channel to the same address
#: shares (gRPC's subchannels are shared), so a link that just came back is dialled.
REDIAL_WAIT_S = 3.0
#: The scheduler answers an Acquire at once (a queue position or a lease); no answer by
#: then means it cannot be reached (a host that drops packets never refuses the connect).
FIRST_REPLY_TIMEOUT_S = 5.0


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Keepalive and size limits for the edge's channels.

    Pings every 5 s with a 5 s timeout notice a dead or hung peer in ~10 s even when
    no unit is in flight (without them, a hung peer takes minutes to notice).
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 5000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.ping_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
        # A lost scheduler is dialled again within 2 s of coming back (gRPC's default
        # backoff grows to 120 s, refusing every new session meanwhile).
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def channel_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials for the fabric's channels, or None for plaintext (no CA).

    Raises ValueError when cert and key are not set together or are set without a CA,
    OSError naming a file that cannot be read.
    """
    if (cert is None) != (key is None):
        raise ValueError(
            "OMNI_FABRIC_TLS_CERT and OMNI_FABRIC_TLS_KEY "
            "(--fabric-tls-cert, --fabric-tls-key) must be set together"
        )
    if ca is None:
        if cert is not None:
            raise ValueError(
                "OMNI_FABRIC_TLS_CERT needs OMNI_FABRIC_TLS_CA (--fabric-tls-ca) on the edge"
            )
        return None
    return tls.channel_credentials(ca, cert, key)


class Fabric:
    """The edge's connections into the fabric, shared by all its sessions."""

    def __init__(
        self,
        scheduler_address: str,
        max_message_bytes: int,
        *,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        """Raises ValueError or OSError for a bad TLS setting (see channel_credentials)."""
        self._options = channel_options(max_message_bytes)
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.scheduler_addresses = schedulers.addresses(scheduler_address)
        self._scheduler_channels = [self._channel(a) for a in self.scheduler_addresses]
        self._scheduler_stubs = [
            scheduler_grpc.SchedulerServiceStub(c) for c in self._scheduler_channels
        ]
        self.leader_index = 0
        """Which scheduler address leads, as last learned."""
        self.scheduler_epoch = 0
        self._watch: asyncio.Task[None] | None = None
        self.scheduler: scheduler_grpc.SchedulerServiceStub = self._scheduler_stubs[0]
        """The scheduler's stub (several addresses: one that calls whichever leads)."""
        if len(self._scheduler_stubs) > 1:
            self.scheduler = cast(scheduler_grpc.SchedulerServiceStub, _LeaderStub(self))
        self._workers: dict[str, tuple[grpc.aio.Channel, worker_grpc.WorkerServiceStub]] = {}
        self._retired: set[grpc.aio.Channel] = set()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def scheduler_stubs(self) -> tuple[scheduler_grpc.SchedulerServiceStub, ...]:
        """One stub per configured scheduler address, in their order (each calls that one)."""
        return tuple(self._scheduler_stubs)

    def start(self) -> None:
        """With several scheduler addresses: start learning which leads (on the loop)."""
        if len(self._scheduler_stubs) > 1 and self._watch is None:
            self._watch = asyncio.ensure_future(self._follow_leader())

    async def find_leader(self) -> bool:
        """Ask every scheduler which leads now and call that one from here on; False when
        none does."""
        answer, highest = await schedulers.find_leader(self._scheduler_stubs)
        if answer is None:
            return False
        if answer.index != self.leader_index or answer.epoch != self.scheduler_epoch:
            log.info(
                "scheduler %s leads (epoch %d)",
                self.scheduler_addresses[answer.index],
                answer.epoch,
            )
        self.leader_index, self.scheduler_epoch = answer.index, max(answer.epoch, highest)
        return True

    async def _follow_leader(self) -> None:
        while True:
            try:
                await self.find_leader()
            except Exception:
                log.exception("asking the schedulers which leads failed")
            await asyncio.sleep(schedulers.WATCH_INTERVAL_S)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, self._options)
        return grpc.aio.secure_channel(address, self._credentials, self._options)

    def worker(self, address: str) -> worker_grpc.WorkerServiceStub:
        """The stub for a worker; channels are cached and multiplex all its sessions."""
        entry = self._workers.get(address)
        if entry is None:
            channel = self._channel(address)
            entry = (channel, worker_grpc.WorkerServiceStub(channel))
            self._workers[address] = entry
        return entry[1]

    def forget_worker(self, address: str) -> None:
        """Drop the cached channel to a worker that was lost, so the next session dials it
        anew: a channel that lived through a cut link can stall a new call until its
        keepalive declares the connection dead (up to 10 s). Calls still on the old channel
        keep it until they end; it is closed after CHANNEL_LINGER_S."""
        entry = self._workers.pop(address, None)
        if entry is None:
            return
        channel = entry[0]
        self._retired.add(channel)

        async def close_later() -> None:
            await asyncio.sleep(CHANNEL_LINGER_S)
            if channel in self._retired:
                self._retired.discard(channel)
                await channel.close()

        # Held until done: the loop keeps only a weak reference to a task.
        task = asyncio.ensure_future(close_later())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def redial_worker(self, address: str, timeout_s: float = REDIAL_WAIT_S) -> bool:
        """Forget the worker's channel (``forget_worker``) and wait up to ``timeout_s`` for a
        new one to connect; whether it did. A start retried at once failed again where the
        connection was still in its reconnect backoff (a link just back: the multi-host
        test's restored host, 1 run in ~20)."""
        self.forget_worker(address)
        self.worker(address)
        channel = self._workers[address][0]
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Close every channel."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for scheduler_channel in self._scheduler_channels:
            await scheduler_channel.close()
        for channel in [*(c for c, _ in self._workers.values()), *self._retired]:
            await channel.close()
        self._workers.clear()
        self._retired.clear()
        for task in self._closing:
            task.cancel()


class _LeaderStub:
    """A SchedulerServiceStub that sends each call to the scheduler leading now; Acquire and
    Reattach move to the next leader when refused before their first answer."""

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric

    def __getattr__(self, name: str) -> Any:
        fabric = self._fabric
        method = getattr(fabric._scheduler_stubs[fabric.leader_index], name)
        if name not in ("Acquire", "Reattach"):
            return method
        return lambda request, **kwargs: _LeaderCall(fabric, name, request, kwargs)


class _LeaderCall:
    """A server-streaming call (read, cancel) to the leading scheduler. Refused before its
    lease by a standby, a draining scheduler or a dead one, it asks every scheduler which
    leads and calls that one (for up to FIRST_REPLY_TIMEOUT_S without a leader): a switch
    of leader refuses no new session. A caller that was waiting in the old leader's queue
    says how long it has waited (AcquireRequest.waited_s): the new leader puts it back in
    its place by its original arrival."""

    def __init__(self, fabric: Fabric, name: str, request: Any, kwargs: dict[str, Any]) -> None:
        self._fabric = fabric
        self._name, self._request, self._kwargs = name, request, kwargs
        self._leased = False
        self._last_try = False
        self._started = time.monotonic()
        self._position = 0
        """The request's last position in a leader's queue (0: never queued): a re-sent
        one says it, and how long it waited."""
        self._call = self._issue()

    def _issue(self) -> grpc.aio.UnaryStreamCall:
        fabric = self._fabric
        stub = fabric._scheduler_stubs[fabric.leader_index]
        request = self._request
        if self._position and self._name == "Acquire":
            request = type(request)()
            request.CopyFrom(self._request)
            request.waited_s = time.monotonic() - self._started
            request.previous_position = self._position
        return getattr(stub, self._name)(request, **self._kwargs)

    async def read(self) -> Any:
        while True:
            try:
                message = await self._call.read()
            except grpc.aio.AioRpcError as err:
                if (
                    self._leased
                    or self._last_try
                    or not schedulers.elsewhere(err, _from_scheduler(err))
                ):
                    raise
                # Without a leader for that long the refusal stands (it says why: a standby
                # that cannot reach the election store names it). A caller not answered yet
                # gets it before its first answer is overdue (wait_for_lease).
                deadline = time.monotonic() + FIRST_REPLY_TIMEOUT_S
                if not self._position:
                    deadline = min(deadline, self._started + FIRST_REPLY_TIMEOUT_S - 0.5)
                while not await self._fabric.find_leader():
                    if time.monotonic() > deadline:
                        # Once more, for the refusal as it stands now (why nobody leads).
                        self._last_try = True
                        break
                    await asyncio.sleep(schedulers.WATCH_INTERVAL_S / 5)
                self._call = self._issue()
                continue
            self._last_try = False
            if message is not grpc.aio.EOF:
                position = queued_position(message)
                if position is not None:
                    self._position = position
                else:
                    self._leased = True
            return message

    def cancel(self) -> bool:
        return bool(self._call.cancel())


async def wait_for_lease(
    call: grpc.aio.UnaryStreamCall, on_queued: Callable[[ev.Queued], Awaitable[None]]
) -> Lease:
    """Read an Acquire stream until its lease, reporting queue positions via on_queued.

    The call stays open (the lease lives as long as it); on any error it is cancelled.
    Raises ServiceUnavailable when the scheduler does not answer within
    FIRST_REPLY_TIMEOUT_S or ends the stream without a lease, and the edge error of a failed
    call (worker_client.lease_error: QueueFull, TooManySessions, Resume*, ...).
    """
    first = True
    try:
        while True:
            if first:
                try:
                    response = await asyncio.wait_for(call.read(), FIRST_REPLY_TIMEOUT_S)
                except TimeoutError:
                    raise ServiceUnavailable("the scheduler cannot be reached") from None
            else:
                response = await call.read()
            if response is grpc.aio.EOF:
                raise ServiceUnavailable("the scheduler ended the queue without a lease")
            reply = acquire_reply(response, first)
            if isinstance(reply, ev.Queued):
                await on_queued(reply)
                first = False
            elif reply is not None:
                return reply
            else:
                raise ServiceUnavailable("the worker was lost before the session started")
    except grpc.aio.AioRpcError as err:
        call.cancel()
        raise lease_error(err) from None
    except BaseException:
        call.cancel()
        raise
