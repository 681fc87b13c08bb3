"""GET /status on the edge: the fabric as operators and the admin page see it.

Workers (engine, slots, health, memory), the queue, and this edge's own sessions; never
keys, audio or transcripts.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

    from omnifabric.edge.connection import EdgeContext

STATUS_TIMEOUT_S = 2.0


def _name(enum_type: EnumTypeWrapper, value: int, prefix: str) -> str:
    return enum_type.Name(value).removeprefix(prefix).lower()


async def edge_status(app: EdgeContext) -> dict[str, Any]:
    """Ask the scheduler for its snapshot and add this edge's sessions. Raises on an
    unreachable scheduler (grpc.aio.AioRpcError)."""
    snap = await app.fabric.scheduler.GetStatus(
        scheduler_pb.GetStatusRequest(), timeout=STATUS_TIMEOUT_S
    )
    workers = []
    for w in snap.workers:
        worker: dict[str, Any] = {
            "worker_id": w.worker_id,
            "address": w.address,
            "engine": w.engine,
            "slots": w.slots,
            "slots_free": w.slots_free,
            "modes": [_name(common_pb2.Mode, m, "MODE_") for m in w.modes],
            "health": _name(common_pb2.WorkerHealth, w.health, "WORKER_HEALTH_"),
            "detail": w.detail,
            "leases": len(w.lease_ids),
        }
        if w.HasField("memory"):
            m = w.memory
            worker["memory"] = {
                "device": m.device,
                "allocated_bytes": m.allocated_bytes,
                "baseline_bytes": m.baseline_bytes,
                "before_cleanup_bytes": m.before_cleanup_bytes,
                "cleanups": m.cleanups,
            }
        if w.HasField("limits"):
            lim = w.limits
            worker["limits"] = {
                "max_slice_nums": [lim.min_slice_nums, lim.max_slice_nums],
                "unit_samples": [lim.min_unit_samples, lim.max_unit_samples],
            }
        workers.append(worker)
    sessions = [
        {
            "session_id": core.session_id,
            "mode": c.mode,
            "worker_id": core.worker_id,
            "started": core.started,
            "units": core.units_sent,
        }
        for c in list(app.connections)
        if (core := c.core) is not None  # always: a connection is listed once it has one
    ]
    return {
        "edge": {
            "pid": os.getpid(),
            "process": app.config.process_index,
            "draining": app.draining,
            "sessions": len(sessions),
            "chat_sessions": len(app.chats),
        },
        "queue": {"length": snap.queue_length, "max": snap.queue_max},
        "leases_active": snap.leases_active,
        "leases_detached": snap.leases_detached,
        "mean_session_s": dict(snap.mean_session_s),
        "slots": {
            "total": sum(w.slots for w in snap.workers),
            "free": sum(w.slots_free for w in snap.workers),
        },
        "workers": workers,
        "sessions": sessions,
        # This edge's units in the last 10 s (the admin page plots it over time).
        "units_recent": app.metrics.recent_units(),
    }
