"""edge/status.py: a worker's entry in /status, from the scheduler's snapshot."""

from __future__ import annotations

from omnifabric.edge import scheduler_client, status
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb


def test_kv_slots_are_listed_under_memory_when_the_worker_has_them():
    memory = common_pb2.MemoryStats(
        device="cuda", kv_slots=64, kv_slot_tokens=5120, kv_slot_bytes=1 << 30, kv_slots_more=3
    )
    entry = status.worker_entry(
        scheduler_client.worker_from(
            scheduler_pb.WorkerStatus(
                worker_id="gpu", modes=[common_pb2.MODE_AUDIO, common_pb2.MODE_CHAT], memory=memory
            )
        )
    )
    assert entry["modes"] == ["audio", "chat"]
    assert entry["memory"]["kv"] == {
        "slots": 64,
        "slot_tokens": 5120,
        "slot_bytes": 1 << 30,
        "slots_more": 3,
    }
    plain = status.worker_entry(
        scheduler_client.worker_from(
            scheduler_pb.WorkerStatus(worker_id="cpu", memory=common_pb2.MemoryStats(device="cpu"))
        )
    )
    assert "kv" not in plain["memory"]


def test_reference_workers_tell_a_busy_worker_from_its_own_leases_when_the_list_is_cut():
    """Issue 55: GetStatus lists the longest-running leases only (--status-entries); a
    worker none of whose sessions made the list is still duplex_active or busy_chat, with
    its sessions counted, from the modes of its own leases."""
    reply = scheduler_pb.GetStatusResponse(
        workers=[
            scheduler_pb.WorkerStatus(
                worker_id="listed",
                address="10.0.0.1:7000",
                health=common_pb2.WORKER_HEALTH_SERVING,
                lease_ids=["a"],
                lease_modes=[common_pb2.MODE_AUDIO],
            ),
            scheduler_pb.WorkerStatus(
                worker_id="duplex",
                address="10.0.0.2:7000",
                health=common_pb2.WORKER_HEALTH_SERVING,
                lease_ids=["b", "c"],
                lease_modes=[common_pb2.MODE_CHAT, common_pb2.MODE_VIDEO],
            ),
            scheduler_pb.WorkerStatus(
                worker_id="chats",
                address="10.0.0.3:7000",
                health=common_pb2.WORKER_HEALTH_SERVING,
                lease_ids=["d"],
                lease_modes=[common_pb2.MODE_CHAT],
            ),
            scheduler_pb.WorkerStatus(
                worker_id="idle", address="10.0.0.4:7000", health=common_pb2.WORKER_HEALTH_SERVING
            ),
        ],
        leases_active=4,
        running=[
            scheduler_pb.RunningLease(
                lease_id="a", worker_id="listed", mode=common_pb2.MODE_AUDIO, session_id="s-a"
            )
        ],
    )
    workers = {
        w["worker_id"]: w for w in status.reference_workers(scheduler_client.snapshot_from(reply))
    }
    assert {k: (w["status"], w["sessions"]) for k, w in workers.items()} == {
        "listed": ("duplex_active", 1),
        "duplex": ("duplex_active", 2),
        "chats": ("busy_chat", 1),
        "idle": ("idle", 0),
    }
    assert workers["listed"]["current_session_id"] == "s-a"
    assert workers["duplex"]["current_session_id"] is None  # not among the listed


def test_workers_whose_lease_lists_were_cut_are_told_by_their_counts():
    """Issue 55: past the status's bound a worker's lease ids are not listed; its leases by
    mode still say what it serves and how many (and /status's `leases` counts them)."""
    serving = common_pb2.WORKER_HEALTH_SERVING
    reply = scheduler_pb.GetStatusResponse(
        workers=[
            scheduler_pb.WorkerStatus(
                worker_id="cut",
                address="10.0.0.5:7000",
                health=serving,
                slots=64,
                leases_by_mode={"audio": 40, "chat": 2},
            ),
            scheduler_pb.WorkerStatus(
                worker_id="chats",
                address="10.0.0.6:7000",
                health=serving,
                leases_by_mode={"chat": 3},
            ),
            scheduler_pb.WorkerStatus(  # an older scheduler: no counts, the list whole
                worker_id="older",
                address="10.0.0.7:7000",
                health=serving,
                lease_ids=["x", "y"],
                lease_modes=[common_pb2.MODE_VIDEO, common_pb2.MODE_CHAT],
            ),
        ],
        leases_active=47,
    )
    snap = scheduler_client.snapshot_from(reply)
    workers = {w["worker_id"]: w for w in status.reference_workers(snap)}
    assert {k: (w["status"], w["sessions"]) for k, w in workers.items()} == {
        "cut": ("duplex_active", 42),
        "chats": ("busy_chat", 3),
        "older": ("duplex_active", 2),
    }
    assert [status.worker_entry(w)["leases"] for w in snap.workers] == [42, 3, 2]
    assert [w.leases_listed for w in snap.workers] == [False, False, True]
