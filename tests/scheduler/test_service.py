"""SchedulerService over real gRPC: registration, queueing, leases, loss and status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.scheduler.server import SERVICE_NAME
from tests.conftest import scaled
from tests.scheduler.clients import Holder, WorkerStream
from tests.scheduler.conftest import Harness, StartScheduler

AUDIO = common_pb2.MODE_AUDIO
VIDEO = common_pb2.MODE_VIDEO
CHAT = common_pb2.MODE_CHAT
SERVING = common_pb2.WORKER_HEALTH_SERVING
NOT_SERVING = common_pb2.WORKER_HEALTH_NOT_SERVING


async def status(harness: Harness) -> scheduler_pb.GetStatusResponse:
    return await asyncio.wait_for(
        harness.stub.GetStatus(scheduler_pb.GetStatusRequest()), scaled(2)
    )


async def status_where(
    harness: Harness,
    holds: Callable[[scheduler_pb.GetStatusResponse], bool],
    timeout_s: float = 5.0,
) -> scheduler_pb.GetStatusResponse:
    """GetStatus, polled until `holds` is true of it (what the scheduler does after a call
    or a stream message ends is asynchronous); AssertionError with the last snapshot after
    timeout_s (scaled)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while not holds(snapshot := await status(harness)):
        assert time.monotonic() < deadline, f"not within {scaled(timeout_s)} s: {snapshot}"
        await asyncio.sleep(0.01)
    return snapshot


async def test_free_slot_is_granted_at_once_and_worker_hears_first(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    order: list[tuple[str, str]] = []
    worker = await WorkerStream(harness.stub, "w1", slots=1, order=order).start()
    holder = Holder(harness.stub, AUDIO, session_id="sess-1", order=order)

    first = await holder.next()
    assert first.WhichOneof("kind") == "lease", "no queued message when a slot is free"
    granted = (await worker.expect("lease_granted")).lease_granted
    assert order == [("worker", "lease_granted"), ("holder", "lease")]

    lease = first.lease
    assert lease.lease_id == granted.lease_id and len(lease.lease_id) == 32
    assert (lease.worker_id, lease.worker_address, lease.slot) == ("w1", worker.address, 0)
    assert lease.ticket_id and lease.queue_wait_s < scaled(1)
    assert (granted.slot, granted.mode, granted.session_id) == (0, AUDIO, "sess-1")
    await worker.close()


async def test_queue_positions_eta_and_fifo_grants(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(eta_initial_s=30.0)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    first = Holder(harness.stub, AUDIO, "a")
    lease_a = await first.expect_lease()
    await worker.expect("lease_granted")

    # One at a time: separate calls may reach the server in any order.
    waiting = []
    tickets = []
    for n, session_id in enumerate(("b", "c", "d"), start=1):
        waiting.append(holder := Holder(harness.stub, AUDIO, session_id))
        queued = (await holder.expect("queued")).queued
        assert (queued.position, queued.queue_length) == (n, n)
        assert queued.estimated_wait_s == pytest.approx(30.0 * n)
        tickets.append(queued.ticket_id)
    assert len(set(tickets)) == 3

    # The first holder leaves: b is granted once the worker has released the slot.
    first.cancel()
    await worker.revoke_and_release(lease_a.lease_id)
    lease_b = await waiting[0].expect_lease()
    assert lease_b.ticket_id == tickets[0] and lease_b.slot == 0
    await worker.expect("lease_granted")
    assert (await waiting[1].expect_position(1)).queue_length == 2
    await waiting[2].expect_position(2)

    # c gives up while queued: d moves up without any slot freeing.
    waiting[1].cancel()
    await waiting[2].expect_position(1)

    waiting[0].cancel()
    await worker.revoke_and_release(lease_b.lease_id)
    lease_d = await waiting[2].expect_lease()
    assert lease_d.ticket_id == tickets[2]
    assert lease_d.queue_wait_s > 0
    await worker.close()


async def test_waiting_client_gets_periodic_updates(start_scheduler: StartScheduler) -> None:
    interval = 0.15
    harness = await start_scheduler(queue_update_interval_s=interval)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    await holder.expect_lease()
    waiting = Holder(harness.stub, AUDIO)

    await waiting.expect("queued")
    arrivals = [time.monotonic()]
    for _ in range(3):
        queued = (await waiting.expect("queued", timeout=interval * 5)).queued
        assert queued.position == 1
        arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert all(gap < interval + scaled(0.3) for gap in gaps), gaps
    await worker.close()


async def test_queue_full_is_resource_exhausted(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(queue_max=2)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    await Holder(harness.stub, AUDIO).expect_lease()
    for _ in range(2):
        await Holder(harness.stub, AUDIO).expect("queued")

    error = await Holder(harness.stub, AUDIO).error()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details().startswith("queue_full:")
    assert harness.core.counters.queue_full_rejections == 1
    assert (await status(harness)).queue_length == 2
    await worker.close()


async def test_a_keys_session_limit_counts_waiting_and_leased(
    start_scheduler: StartScheduler,
) -> None:
    """A key with limit 2: one lease and one waiting request hold it; a third request is
    refused with key_session_limit (RESOURCE_EXHAUSTED), other keys and unlimited requests
    are not; the waiting request's cancel gives its place back."""
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    team = {"key": "k" * 64, "key_session_limit": 2}
    await Holder(harness.stub, AUDIO, **team).expect_lease()
    waiting = Holder(harness.stub, AUDIO, **team)
    await waiting.expect("queued")
    error = await Holder(harness.stub, AUDIO, **team).error()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        "key_session_limit: this API key holds 2 sessions across the fabric, its limit is 2"
    )
    assert harness.core.counters.key_limit_rejections == 1
    await Holder(harness.stub, AUDIO, key="o" * 64, key_session_limit=2).expect("queued")
    await Holder(harness.stub, AUDIO, key="k" * 64).expect("queued")  # no limit given
    waiting.cancel()
    await status_where(harness, lambda s: s.queue_length == 2)
    await Holder(harness.stub, AUDIO, **team).expect("queued")
    await worker.close()


async def test_no_worker_for_mode_is_unavailable(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    error = await Holder(harness.stub, AUDIO).error()
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "no worker serves mode audio"

    worker = await WorkerStream(harness.stub, "w1", modes=[AUDIO]).start()
    error = await Holder(harness.stub, VIDEO).error()
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "no worker serves mode video"
    await worker.close()


async def test_unspecified_mode_is_invalid_argument(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1").start()
    error = await Holder(harness.stub, common_pb2.MODE_UNSPECIFIED).error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    await worker.close()


async def test_register_must_start_with_hello(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    call = harness.stub.Register()
    await call.write(scheduler_pb.RegisterRequest(report=scheduler_pb.WorkerReport(health=SERVING)))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await asyncio.wait_for(call.read(), scaled(2))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    call = harness.stub.Register()
    await call.write(
        scheduler_pb.RegisterRequest(hello=scheduler_pb.WorkerHello(worker_id="w", slots=1))
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await asyncio.wait_for(call.read(), scaled(2))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_holder_cancel_revokes_and_release_frees_slot(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    lease = await holder.expect_lease()
    await worker.expect("lease_granted")
    waiting = Holder(harness.stub, AUDIO)
    await waiting.expect("queued")

    holder.cancel()
    revoked = (await worker.expect("lease_revoked")).lease_revoked
    assert revoked.lease_id == lease.lease_id
    # Until the worker releases, the slot stays taken.
    snapshot = await status(harness)
    assert snapshot.workers[0].slots_free == 0
    assert list(snapshot.workers[0].lease_ids) == [lease.lease_id]
    assert snapshot.leases_active == 0

    await worker.release(lease.lease_id)
    granted = (await worker.expect("lease_granted")).lease_granted
    next_lease = await waiting.expect_lease()
    assert next_lease.lease_id == granted.lease_id
    snapshot = await status(harness)
    assert list(snapshot.workers[0].lease_ids) == [next_lease.lease_id]
    assert snapshot.leases_active == 1

    waiting.cancel()
    await worker.revoke_and_release(next_lease.lease_id)
    snapshot = await status_where(harness, lambda s: s.workers[0].slots_free == 1)
    assert snapshot.workers[0].slots_free == 1 and snapshot.leases_active == 0
    counters = harness.core.counters
    assert (counters.leases_granted, counters.leases_returned, counters.leases_lost) == (2, 2, 0)
    await worker.close()


async def test_unanswered_revocation_frees_slot_after_timeout(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler(release_timeout_s=0.2)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    await holder.expect_lease()
    await worker.expect("lease_granted")
    waiting = Holder(harness.stub, AUDIO)
    await waiting.expect("queued")

    holder.cancel()
    await worker.expect("lease_revoked")
    await worker.expect("lease_granted")  # no lease_released sent
    await waiting.expect_lease()
    await worker.close()


async def test_lost_worker_ends_its_leases(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=2).start()
    holders = [Holder(harness.stub, AUDIO) for _ in range(2)]
    leases = [await h.expect_lease() for h in holders]
    waiting = Holder(harness.stub, AUDIO)
    await waiting.expect("queued")

    worker.cancel()
    for holder, lease in zip(holders, leases, strict=True):
        lost = (await holder.expect("lease_lost")).lease_lost
        assert lost.lease_id == lease.lease_id
        assert lost.reason == "worker w1 lost"
        await holder.expect_end()
    snapshot = await status(harness)
    assert (len(snapshot.workers), snapshot.leases_active, snapshot.queue_length) == (0, 0, 1)
    assert harness.core.counters.leases_lost == 2

    # The waiting request stays queued and is served by the next worker.
    replacement = await WorkerStream(harness.stub, "w2", slots=1).start()
    lease = await waiting.expect_lease()
    assert lease.worker_id == "w2"
    await replacement.close()


async def test_not_serving_worker_gets_no_leases(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=2).start()
    await worker.report(NOT_SERVING, "draining")
    # GetStatus after the report is read: polled, the report is asynchronous.
    snapshot = await status_where(harness, lambda s: s.workers[0].health == NOT_SERVING)
    assert (snapshot.workers[0].health, snapshot.workers[0].detail) == (NOT_SERVING, "draining")

    holder = Holder(harness.stub, AUDIO)
    assert (await holder.expect("queued")).queued.position == 1
    await worker.expect_nothing()

    await worker.report(SERVING)
    granted = (await worker.expect("lease_granted")).lease_granted
    assert (await holder.expect_lease()).lease_id == granted.lease_id
    await worker.close()


async def test_active_lease_ids_keep_slots_until_released(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=2, active_lease_ids=["old-1"]).start()
    snapshot = await status(harness)
    assert snapshot.workers[0].slots_free == 1
    assert list(snapshot.workers[0].lease_ids) == ["old-1"]

    first = Holder(harness.stub, AUDIO)
    assert (await first.expect_lease()).slot == 1
    second = Holder(harness.stub, AUDIO)
    await second.expect("queued")

    await worker.release("old-1")
    lease = await second.expect_lease()
    assert lease.slot == 0
    await worker.close()


async def test_reregistration_replaces_old_stream(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    old = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    lease = await holder.expect_lease()
    await old.expect("lease_granted")

    new = await WorkerStream(harness.stub, "w1", slots=1, active_lease_ids=[lease.lease_id]).start()
    await asyncio.wait_for(old.ended.wait(), scaled(2))
    snapshot = await status(harness)
    assert len(snapshot.workers) == 1
    assert list(snapshot.workers[0].lease_ids) == [lease.lease_id]
    assert snapshot.leases_active == 1

    # The adopted lease is still the holder's: returning it goes to the new stream.
    holder.cancel()
    await new.revoke_and_release(lease.lease_id)
    await new.close()


async def test_status_contents(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(queue_max=5, eta_initial_s=42.0)
    audio = await WorkerStream(harness.stub, "w-audio", slots=2, modes=[AUDIO]).start()
    both = await WorkerStream(harness.stub, "w-both", slots=1, modes=[VIDEO, CHAT]).start()
    holder = Holder(harness.stub, AUDIO, "s1")
    lease = await holder.expect_lease()

    snapshot = await status(harness)
    assert (snapshot.queue_length, snapshot.queue_max, snapshot.leases_active) == (0, 5, 1)
    assert dict(snapshot.mean_session_s) == {"audio": 42.0, "video": 42.0, "chat": 42.0}
    by_id = {w.worker_id: w for w in snapshot.workers}
    assert list(by_id) == ["w-audio", "w-both"]
    first = by_id["w-audio"]
    assert (first.address, first.engine, first.slots, first.slots_free) == (
        audio.address,
        "synthetic",
        2,
        1,
    )
    assert list(first.modes) == [AUDIO] and first.health == SERVING
    assert list(first.lease_ids) == [lease.lease_id]
    assert list(by_id["w-both"].modes) == [VIDEO, CHAT]
    assert by_id["w-both"].slots_free == 1

    # A finished session feeds the mean session length of its mode.
    holder.cancel()
    await audio.expect("lease_granted")
    await audio.revoke_and_release(lease.lease_id)
    snapshot = await status(harness)
    assert snapshot.mean_session_s["audio"] < scaled(2)
    assert snapshot.mean_session_s["video"] == 42.0
    await audio.close()
    await both.close()


async def test_lease_and_status_carry_the_workers_limits(start_scheduler: StartScheduler) -> None:
    """The limits a worker's hello declares come back unchanged on every lease on that
    worker and in GetStatus; a worker that declares none gets leases without them."""
    harness = await start_scheduler()
    limits = common_pb2.EngineLimits(
        min_slice_nums=1, max_slice_nums=3, min_unit_samples=4000, max_unit_samples=32000
    )
    video = await WorkerStream(harness.stub, "w-video", modes=[VIDEO], limits=limits).start()
    plain = await WorkerStream(harness.stub, "w-plain", modes=[AUDIO]).start()

    lease = await Holder(harness.stub, VIDEO, "s1").expect_lease()
    assert lease.worker_id == "w-video" and lease.limits == limits
    await video.expect("lease_granted")
    lease = await Holder(harness.stub, AUDIO, "s2").expect_lease()
    assert lease.worker_id == "w-plain" and not lease.HasField("limits")
    await plain.expect("lease_granted")

    by_id = {w.worker_id: w for w in (await status(harness)).workers}
    assert by_id["w-video"].limits == limits
    assert not by_id["w-plain"].HasField("limits")
    await video.close()
    await plain.close()


async def test_hello_with_inverted_limits_is_invalid_argument(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    call = harness.stub.Register()
    hello = WorkerStream(
        harness.stub,
        "w1",
        limits=common_pb2.EngineLimits(
            min_slice_nums=3, max_slice_nums=2, min_unit_samples=1, max_unit_samples=2
        ),
    ).hello
    await call.write(scheduler_pb.RegisterRequest(hello=hello))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await asyncio.wait_for(call.read(), scaled(2))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.limits" in (raised.value.details() or "")


async def test_health_service_reports_serving(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    health = health_pb2_grpc.HealthStub(harness.channel)
    for service in ("", SERVICE_NAME):
        reply = await asyncio.wait_for(
            health.Check(health_pb2.HealthCheckRequest(service=service)), scaled(2)
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE_NAME == "omni.realtime.v1.SchedulerService"


async def test_grant_prefers_most_free_slots_then_oldest(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    older = await WorkerStream(harness.stub, "older", slots=1).start()
    newer = await WorkerStream(harness.stub, "newer", slots=2).start()
    holders = []
    for expected in ("newer", "older", "newer"):
        holders.append(Holder(harness.stub, AUDIO))
        assert (await holders[-1].expect_lease()).worker_id == expected
    await older.close()
    await newer.close()


async def test_worker_release_of_held_lease_keeps_slot_until_holder_leaves(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    lease = await holder.expect_lease()
    await worker.expect("lease_granted")
    waiting = Holder(harness.stub, AUDIO)
    await waiting.expect("queued")

    # The session closed on the worker, but the holder still holds the lease.
    await worker.release(lease.lease_id)
    await worker.expect_nothing()

    holder.cancel()
    await worker.expect("lease_granted")  # no revocation: the worker already released it
    await waiting.expect_lease()
    await worker.close()


async def test_worker_half_close_counts_as_lost(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO)
    await holder.expect_lease()
    assert worker.call is not None
    await worker.call.done_writing()
    assert (await holder.expect("lease_lost")).lease_lost.reason == "worker w1 lost"
    await holder.expect_end()
    await asyncio.wait_for(worker.ended.wait(), scaled(2))
    assert len((await status(harness)).workers) == 0


async def test_second_hello_is_invalid_argument(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1").start()
    assert worker.call is not None
    await worker.call.write(scheduler_pb.RegisterRequest(hello=worker.hello))
    await asyncio.wait_for(worker.ended.wait(), scaled(2))
    assert await worker.call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len((await status(harness)).workers) == 0


async def test_status_lists_the_queue_and_the_running_leases(
    start_scheduler: StartScheduler,
) -> None:
    harness = await start_scheduler(eta_initial_s=40.0)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO, "running")
    lease = await holder.expect_lease()
    waiting = []
    for session_id in ("q1", "q2"):
        waiting.append(Holder(harness.stub, AUDIO, session_id))
        await waiting[-1].expect("queued")
    snapshot = await status(harness)
    assert [(q.session_id, q.position, q.mode) for q in snapshot.queue] == [
        ("q1", 1, AUDIO),
        ("q2", 2, AUDIO),
    ]
    assert [q.estimated_wait_s for q in snapshot.queue] == [pytest.approx(40), pytest.approx(80)]
    assert all(0 <= q.waited_s < scaled(2) for q in snapshot.queue)
    (running,) = snapshot.running
    assert (running.lease_id, running.worker_id, running.session_id) == (
        lease.lease_id,
        "w1",
        "running",
    )
    assert 0 <= running.elapsed_s < scaled(2)
    assert running.estimated_remaining_s == pytest.approx(40 - running.elapsed_s, abs=0.5)
    assert snapshot.eta.alpha == pytest.approx(0.2) and snapshot.eta.baseline_s["audio"] == 40
    await worker.close()


async def test_status_is_bounded_and_finds_one_ticket_alone(
    start_scheduler: StartScheduler,
) -> None:
    """Issue 55: a large fleet's GetStatus lists the first entries of the queue, of the
    running leases and of the workers' lease ids (--status-entries, or the request's own
    bound) with whole counts, and one waiting request can be asked for alone."""
    harness = await start_scheduler(status_entries=2)
    worker = await WorkerStream(harness.stub, "w1", slots=3, modes=(AUDIO, CHAT)).start()
    leases = []
    for session_id, mode in (("r1", AUDIO), ("r2", CHAT), ("r3", AUDIO)):
        leases.append(await Holder(harness.stub, mode, session_id).expect_lease())
    waiting, tickets = [], []
    for session_id in ("q1", "q2", "q3"):
        waiting.append(Holder(harness.stub, AUDIO, session_id))
        tickets.append((await waiting[-1].expect("queued")).queued.ticket_id)

    bounded = await status(harness)
    assert [q.session_id for q in bounded.queue] == ["q1", "q2"]
    assert [r.session_id for r in bounded.running] == ["r1", "r2"]  # longest-running first
    assert (bounded.queue_length, bounded.leases_active) == (3, 3)
    (w,) = bounded.workers  # its three leases would pass the bound: counted, not listed
    assert not w.lease_ids and not w.lease_modes
    assert dict(w.leases_by_mode) == {"audio": 2, "chat": 1}

    request = scheduler_pb.GetStatusRequest(max_entries=10)
    whole = await asyncio.wait_for(harness.stub.GetStatus(request), scaled(2))
    assert [q.session_id for q in whole.queue] == ["q1", "q2", "q3"]
    assert [r.session_id for r in whole.running] == ["r1", "r2", "r3"]
    (w,) = whole.workers
    assert len(w.lease_ids) == 3 and sorted(w.lease_modes) == sorted([AUDIO, AUDIO, CHAT])
    assert dict(zip(w.lease_ids, w.lease_modes, strict=True))[leases[1].lease_id] == (CHAT)
    assert dict(w.leases_by_mode) == {"audio": 2, "chat": 1}

    request = scheduler_pb.GetStatusRequest(ticket_id=tickets[2])
    alone = await asyncio.wait_for(harness.stub.GetStatus(request), scaled(2))
    assert [(q.session_id, q.position) for q in alone.queue] == [("q3", 3)]
    assert not alone.running and alone.queue_length == 3
    assert not alone.workers  # nor the fleet: the answer does not grow with it
    request = scheduler_pb.GetStatusRequest(ticket_id="no-such-ticket")
    assert not (await asyncio.wait_for(harness.stub.GetStatus(request), scaled(2))).queue
    await worker.close()


async def test_an_operator_cancels_a_waiting_request(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    await Holder(harness.stub, AUDIO, "running").expect_lease()
    first, second = Holder(harness.stub, AUDIO, "a"), None
    ticket = (await first.expect("queued")).queued.ticket_id
    second = Holder(harness.stub, AUDIO, "b")
    await second.expect_position(2)

    reply = await harness.stub.CancelTicket(scheduler_pb.CancelTicketRequest(ticket_id=ticket))
    assert reply.cancelled
    error = await first.error()
    assert error.code() == grpc.StatusCode.ABORTED and "cancelled" in error.details()
    await second.expect_position(1)  # the one behind moves up
    assert [q.session_id for q in (await status(harness)).queue] == ["b"]
    again = await harness.stub.CancelTicket(scheduler_pb.CancelTicketRequest(ticket_id=ticket))
    assert not again.cancelled
    unknown = await harness.stub.CancelTicket(scheduler_pb.CancelTicketRequest(ticket_id="x"))
    assert not unknown.cancelled
    await worker.close()


async def test_eta_settings_change_at_run_time(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(eta_initial_s=60.0)
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    await Holder(harness.stub, AUDIO, "running").expect_lease()
    waiting = Holder(harness.stub, AUDIO, "w")
    assert (await waiting.expect("queued")).queued.estimated_wait_s == pytest.approx(60)

    reply = await harness.stub.SetEta(
        scheduler_pb.SetEtaRequest(alpha=0.5, baseline_s={"audio": 12.0})
    )
    assert reply.eta.alpha == 0.5 and reply.eta.baseline_s["audio"] == 12.0
    assert reply.eta.baseline_s["video"] == 60.0  # not named: unchanged
    # The waiting client hears its new estimate at once.
    queued = (await waiting.expect("queued")).queued
    assert queued.estimated_wait_s == pytest.approx(12)
    for bad in (
        scheduler_pb.SetEtaRequest(alpha=1.5),
        scheduler_pb.SetEtaRequest(baseline_s={"audio": -1.0}),
        scheduler_pb.SetEtaRequest(baseline_s={"karaoke": 5.0}),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await harness.stub.SetEta(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await status(harness)).eta.alpha == 0.5  # a refused change changed nothing
    await worker.close()


async def test_app_switches_are_kept_for_the_fabric(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    first = (await harness.stub.GetApps(scheduler_pb.GetAppsRequest())).switches
    assert list(first.disabled_app_ids) == [] and first.generation == 0 and first.epoch
    request = scheduler_pb.SetAppRequest(app_id="omni", enabled=False)
    off = (await harness.stub.SetApp(request)).switches
    assert list(off.disabled_app_ids) == ["omni"] and off.generation == 1
    assert off.epoch == first.epoch
    await harness.stub.SetApp(scheduler_pb.SetAppRequest(app_id="audio_duplex", enabled=False))
    request = scheduler_pb.SetAppRequest(app_id="omni", enabled=True)
    on = (await harness.stub.SetApp(request)).switches
    assert list(on.disabled_app_ids) == ["audio_duplex"] and on.generation == 3
    read = (await harness.stub.GetApps(scheduler_pb.GetAppsRequest())).switches
    assert list(read.disabled_app_ids) == ["audio_duplex"] and read.generation == 3
    for bad in ("", "x" * 65):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await harness.stub.SetApp(scheduler_pb.SetAppRequest(app_id=bad, enabled=False))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for i in range(63):  # 64 off at most: the catalog is a handful
        await harness.stub.SetApp(scheduler_pb.SetAppRequest(app_id=f"a{i}", enabled=False))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.SetApp(scheduler_pb.SetAppRequest(app_id="one-more", enabled=False))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await harness.stub.GetApps(scheduler_pb.GetAppsRequest())).switches.generation == 66


class _Context:
    """What Acquire asks of its gRPC context, for driving the servicer's generator here."""

    def invocation_metadata(self) -> tuple:
        return ()


async def test_a_queued_acquire_closed_from_another_task_logs_no_error(
    start_scheduler: StartScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc closes a cancelled call's generator from a task of its own: the trace context
    Acquire made current in the RPC's task was detached there, which OpenTelemetry logged
    as an ERROR with a traceback ("Failed to detach context"; 1 cancel in 10 at a queue)."""
    from omnifabric.scheduler.service import SchedulerServicer

    harness = await start_scheduler()
    worker = await WorkerStream(harness.stub, "w1", slots=1).start()
    holder = Holder(harness.stub, AUDIO, session_id="holds")
    await holder.expect_lease()
    await worker.expect("lease_granted")
    request = scheduler_pb.AcquireRequest(mode=AUDIO, session_id="waits")
    acquire = SchedulerServicer(harness.core).Acquire(request, _Context())
    assert (await anext(acquire)).WhichOneof("kind") == "queued"
    caplog.set_level("ERROR")
    await asyncio.create_task(acquire.aclose())  # another task: a copy of the context
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
