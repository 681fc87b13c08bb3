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
