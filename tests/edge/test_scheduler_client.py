"""edge/scheduler_client.py: the scheduler's replies (real protobuf messages) read into the
edge's domain types, and the requests its admin calls send."""

from __future__ import annotations

import grpc
import pytest

from omnifabric.common.session_types import EngineLimits
from omnifabric.edge import scheduler_client as sc
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb


def full_worker() -> scheduler_pb.WorkerStatus:
    return scheduler_pb.WorkerStatus(
        worker_id="gpu",
        address="10.0.0.7:7001",
        engine="minicpmo",
        slots=4,
        slots_free=1,
        modes=[common_pb2.MODE_AUDIO, common_pb2.MODE_VIDEO, common_pb2.MODE_CHAT],
        health=common_pb2.WORKER_HEALTH_SERVING,
        detail="warm",
        lease_ids=["l1", "l2"],
        admits=[common_pb2.MODE_CHAT],
        memory=common_pb2.MemoryStats(
            device="cuda:1",
            allocated_bytes=5,
            baseline_bytes=4,
            before_cleanup_bytes=6,
            cleanups=2,
            kv_slots=64,
            kv_slot_tokens=5120,
            kv_slot_bytes=1 << 30,
            kv_slots_more=3,
        ),
        limits=common_pb2.EngineLimits(
            min_slice_nums=1, max_slice_nums=9, min_unit_samples=4000, max_unit_samples=64000
        ),
        headroom=scheduler_pb.Headroom(
            engine_threads=2,
            costs=[
                scheduler_pb.ModeCost(mode=common_pb2.MODE_AUDIO, session_cost=0.25, peak_cost=0.9),
                scheduler_pb.ModeCost(mode=common_pb2.MODE_CHAT, session_cost=0.5),
            ],
            late_units_recent=3,
            late_units_total=30,
            late_window_s=10.0,
            unit_p95_ratio=0.875,
            late_units_by_lease={"l1": 2},
        ),
    )


def test_a_worker_with_every_report():
    w = sc.worker_from(full_worker())
    assert (w.worker_id, w.address, w.engine, w.slots, w.slots_free, w.detail) == (
        "gpu",
        "10.0.0.7:7001",
        "minicpmo",
        4,
        1,
        "warm",
    )
    assert w.modes == ("audio", "video", "chat") and w.admits == ("chat",)
    assert w.health == sc.SERVING and w.lease_ids == ("l1", "l2")
    assert w.memory == sc.Memory(
        "cuda:1",
        5,
        4,
        6,
        2,
        sc.KvFigures(slots=64, slot_tokens=5120, slot_bytes=1 << 30, slots_more=3),
    )
    assert w.limits == EngineLimits(1, 9, 4000, 64000)
    assert w.headroom is not None
    assert dict(w.headroom.session_cost) == {"audio": 0.25, "chat": 0.5}
    assert list(w.headroom.session_cost) == ["audio", "chat"]  # the worker's order
    assert dict(w.headroom.peak_cost) == {"audio": 0.9, "chat": 0.0}
    assert w.headroom.late_units_by_lease == {"l1": 2}
    assert (w.headroom.engine_threads, w.headroom.unit_p95_ratio) == (2, 0.875)


def test_reports_a_worker_has_not_sent_are_none():
    w = sc.worker_from(
        scheduler_pb.WorkerStatus(
            worker_id="new", health=common_pb2.WORKER_HEALTH_NOT_SERVING, modes=[7]
        )
    )
    assert w.memory is None and w.headroom is None and w.limits is None
    assert w.health == "not_serving" and w.modes == ("7",)
    plain = sc.worker_from(scheduler_pb.WorkerStatus(memory=common_pb2.MemoryStats(device="cpu")))
    assert plain.memory == sc.Memory("cpu", 0, 0, 0, 0, None)  # no KV slots


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (common_pb2.WORKER_HEALTH_UNSPECIFIED, "unspecified"),
        (common_pb2.WORKER_HEALTH_SERVING, "serving"),
        (common_pb2.WORKER_HEALTH_NOT_SERVING, "not_serving"),
        (42, "42"),  # a newer scheduler's value
    ],
)
def test_health_names(value, name):
    assert sc.health_name(value) == name


def status_reply() -> scheduler_pb.GetStatusResponse:
    reply = scheduler_pb.GetStatusResponse(
        workers=[full_worker()],
        queue_length=1,
        queue_max=8,
        leases_active=2,
        leases_detached=1,
        epoch=5,
        queue=[
            scheduler_pb.QueueEntry(
                ticket_id="t1",
                mode=common_pb2.MODE_VIDEO,
                session_id="s1",
                position=1,
                estimated_wait_s=3.5,
                waited_s=1.5,
            )
        ],
        running=[
            scheduler_pb.RunningLease(
                lease_id="l1",
                worker_id="gpu",
                mode=common_pb2.MODE_AUDIO,
                session_id="s0",
                elapsed_s=9.0,
                estimated_remaining_s=2.0,
            )
        ],
    )
    reply.mean_session_s["audio"] = 12.5
    reply.eta.alpha = 0.3
    reply.eta.baseline_s.update({"audio": 60.0, "chat": 10.0})
    reply.eta.mean_s["audio"] = 45.5
    reply.eta.samples.update({"audio": 3})
    return reply


def test_the_snapshot():
    snap = sc.snapshot_from(status_reply())
    assert [w.worker_id for w in snap.workers] == ["gpu"]
    assert (snap.queue_length, snap.queue_max, snap.leases_active, snap.leases_detached) == (
        1,
        8,
        2,
        1,
    )
    assert snap.epoch == 5 and snap.mean_session_s == {"audio": 12.5}
    assert snap.queue == (sc.QueueEntry("t1", "video", "s1", 1, 3.5, 1.5),)
    assert snap.running == (sc.RunningLease("l1", "gpu", "audio", "s0", 9.0, 2.0),)
    assert snap.eta == sc.Eta(0.3, {"audio": 60.0, "chat": 10.0}, {"audio": 45.5}, {"audio": 3})


def test_an_empty_snapshot():
    snap = sc.snapshot_from(scheduler_pb.GetStatusResponse())
    assert snap.workers == () and snap.queue == () and snap.running == ()
    assert snap.eta == sc.Eta(0.0, {}, {}, {})


def test_an_eta_change_as_the_request():
    request = sc.set_eta_request(sc.EtaChange(0.5, {"chat": 3.0}))
    assert request == scheduler_pb.SetEtaRequest(alpha=0.5, baseline_s={"chat": 3.0})
    assert sc.set_eta_request(sc.EtaChange()) == scheduler_pb.SetEtaRequest()


class Scheduler:
    """A SchedulerServiceStub's admin calls, answering as a scheduler would."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object, float]] = []

    async def GetStatus(self, request, timeout):
        self.sent.append(("GetStatus", request, timeout))
        return status_reply()

    async def CancelTicket(self, request, timeout):
        self.sent.append(("CancelTicket", request, timeout))
        return scheduler_pb.CancelTicketResponse(cancelled=request.ticket_id == "t1")

    async def SetEta(self, request, timeout):
        self.sent.append(("SetEta", request, timeout))
        return scheduler_pb.SetEtaResponse(eta=scheduler_pb.EtaStatus(alpha=request.alpha))


async def test_the_calls():
    stub = Scheduler()
    assert (await sc.get_status(stub)).queue_length == 1
    assert (await sc.find_ticket(stub, "t1")) == sc.QueueEntry("t1", "video", "s1", 1, 3.5, 1.5)
    assert await sc.find_ticket(stub, "gone") is None
    assert await sc.cancel_ticket(stub, "t1") is True
    assert await sc.cancel_ticket(stub, "gone") is False
    assert (await sc.get_eta(stub)).alpha == 0.3
    assert (await sc.set_eta(stub, sc.EtaChange(0.7))).alpha == 0.7
    assert {timeout for _, _, timeout in stub.sent} == {sc.TIMEOUT_S}
    assert stub.sent[3][1] == scheduler_pb.CancelTicketRequest(ticket_id="t1")
    assert stub.sent[-1][1] == scheduler_pb.SetEtaRequest(alpha=0.7)


class Leader:
    def __init__(self, reply: scheduler_pb.GetLeaderResponse | None) -> None:
        self.reply = reply

    async def GetLeader(self, request, timeout):
        if self.reply is None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return self.reply


async def test_leadership_asks_each_in_order():
    leading = scheduler_pb.GetLeaderResponse(leading=True, epoch=3, pid=11, terms=2, rebuild_s=0.5)
    standby = scheduler_pb.GetLeaderResponse(epoch=3, pid=12)
    answers = await sc.leadership([Leader(standby), Leader(None), Leader(leading)])
    assert answers[1] is None
    assert answers[0] is not None and answers[2] is not None
    assert (answers[0].index, answers[0].leading, answers[0].rebuild_s) == (0, False, None)
    assert (answers[2].index, answers[2].leading, answers[2].pid, answers[2].rebuild_s) == (
        2,
        True,
        11,
        0.5,
    )
