"""GET /status on the edge: the fabric as operators and the admin page see it.

Workers (engine, slots, health, memory), the queue, this edge's own sessions, and every
scheduler it is configured with (active/standby: which one leads); never keys, audio or
transcripts.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from omnifabric.common import grpc_io, schedulers
from omnifabric.edge import queue_api
from omnifabric.edge import scheduler_client as sc

if TYPE_CHECKING:
    from omnifabric.edge.connection import EdgeContext


async def snapshot(app: EdgeContext) -> sc.Snapshot:
    """The scheduler's snapshot (grpc.aio.AioRpcError when it cannot be reached)."""
    return await sc.get_status(app.fabric.scheduler)


async def scheduler_list(app: EdgeContext) -> dict[str, Any]:
    """Every scheduler this edge is configured with, asked at once (GetLeader): its address,
    pid, whether it answers, whether it says it leads, its epoch, the leaderships it began
    and its last rebuild, s; and the address of the one that leads (the highest epoch of
    those that say so, as the edge follows it; None: none does). Raises nothing."""
    fabric = app.fabric
    answers = await sc.leadership(fabric.scheduler_stubs)
    leader = schedulers.leader(answers)
    return {
        "schedulers": [
            {
                "address": address,
                "pid": answer.pid if answer else None,
                "answers": answer is not None,
                "leading": answer.leading if answer else False,
                "epoch": answer.epoch if answer else None,
                "leaderships": answer.terms if answer else None,
                "rebuild_s": answer.rebuild_s if answer else None,
            }
            for address, answer in zip(fabric.scheduler_addresses, answers, strict=True)
        ],
        "scheduler_leader": fabric.scheduler_addresses[leader.index] if leader else None,
    }


def reference_workers(snap: sc.Snapshot) -> list[dict[str, Any]]:
    """Workers as the reference server's GET /workers lists them (its WorkerInfo). A worker
    here serves several sessions: `status` is `duplex_active` when one of them is a duplex
    session, `busy_chat` when they are chats, `idle` with none, `loading` while it does not
    take sessions; `current_session_id` is the first; `gpu_id` the CUDA index (-1: CPU).
    The status and `sessions` come from the worker's own leases (every one its slots hold);
    the current session from the scheduler's running list, which a fleet larger than its
    --status-entries lists in part (the longest-running): None for a worker not in it."""
    running: dict[str, list[sc.RunningLease]] = {}
    for lease in snap.running:
        running.setdefault(lease.worker_id, []).append(lease)
    out = []
    for w in snap.workers:
        host, _, port = w.address.rpartition(":")
        leases = running.get(w.worker_id, [])
        names = w.modes_held - {"unspecified"}
        if w.health != sc.SERVING:
            status = "loading"
        elif names - {"chat"}:
            status = "duplex_active"
        elif names:
            status = "busy_chat"
        else:
            status = "idle"
        device = w.memory.device if w.memory is not None else ""
        index = device.partition(":")[2] if device.startswith("cuda") else ""
        first = max(leases, key=lambda r: r.elapsed_s) if leases else None
        out.append(
            {
                "worker_id": w.worker_id,
                "host": host,
                "port": int(port) if port.isdigit() else 0,
                "gpu_id": int(index) if index.isdigit() else (0 if device == "cuda" else -1),
                "status": status,
                "current_session_id": first.session_id if first else None,
                "current_request_type": (
                    queue_api.REQUEST_TYPES.get(first.mode) if first else None
                ),
                "task_started_at": (
                    queue_api.started_at(first.elapsed_s) if first is not None else None
                ),
                "sessions": w.lease_count,
                "slots": w.slots,
            }
        )
    return out


def reference_summary(snap: sc.Snapshot) -> dict[str, Any]:
    """The reference server's GET /status fields (its ServiceStatus)."""
    workers = reference_workers(snap)
    count = {s: sum(w["status"] == s for w in workers) for s in ("idle", "loading")}
    return {
        "gateway_healthy": True,
        "total_workers": len(workers),
        "idle_workers": count["idle"],
        "busy_workers": sum(w["status"] == "busy_chat" for w in workers),
        "duplex_workers": sum(w["status"] == "duplex_active" for w in workers),
        "loading_workers": count["loading"],
        "error_workers": 0,
        "offline_workers": 0,
        "queue_length": snap.queue_length,
        "max_queue_size": snap.queue_max,
        "running_tasks": queue_api.running_tasks(snap),
    }


async def edge_status(app: EdgeContext) -> dict[str, Any]:
    """Ask the scheduler for its snapshot and add this edge's sessions and the schedulers.
    Raises on an unreachable scheduler (grpc.aio.AioRpcError)."""
    snap, fleet = await asyncio.gather(snapshot(app), scheduler_list(app))
    workers = [worker_entry(w) for w in snap.workers]
    sessions = _sessions(app, snap)
    return {
        "edge": {
            "pid": os.getpid(),
            "process": app.config.process_index,
            "draining": app.draining,
            "sessions": len(sessions),
            "chat_sessions": len(app.chats),
            "grpc_io": grpc_io.report(),
        },
        **fleet,
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
        # The reference server's names for the same, for its clients.
        **reference_summary(snap),
    }


def worker_entry(w: sc.Worker) -> dict[str, Any]:
    """One worker of the scheduler's snapshot, as /status lists it."""
    worker: dict[str, Any] = {
        "worker_id": w.worker_id,
        "address": w.address,
        "engine": w.engine,
        "slots": w.slots,
        "slots_free": w.slots_free,
        "modes": list(w.modes),
        "health": w.health,
        "detail": w.detail,
        "leases": w.lease_count,
    }
    if w.memory is not None:
        worker["memory"] = _memory(w.memory)
    worker["admits"] = list(w.admits)
    if w.headroom is not None:
        h = w.headroom
        worker["headroom"] = {
            "engine_threads": h.engine_threads,
            "session_cost": {mode: round(cost, 3) for mode, cost in h.session_cost.items()},
            "peak_cost": {mode: round(cost, 3) for mode, cost in h.peak_cost.items()},
            "late_units_recent": h.late_units_recent,
            "late_units_total": h.late_units_total,
            "late_window_s": h.late_window_s,
            "unit_p95_ratio": round(h.unit_p95_ratio, 3),
            "late_units_by_lease": dict(h.late_units_by_lease),
        }
    if w.limits is not None:
        lim = w.limits
        worker["limits"] = {
            "max_slice_nums": [lim.min_slice_nums, lim.max_slice_nums],
            "unit_samples": [lim.min_unit_samples, lim.max_unit_samples],
        }
    return worker


def _memory(m: sc.Memory) -> dict[str, Any]:
    """A worker's memory report, as /status lists it (`kv`: only for engines with KV slots
    allocated at start)."""
    memory: dict[str, Any] = {
        "device": m.device,
        "allocated_bytes": m.allocated_bytes,
        "baseline_bytes": m.baseline_bytes,
        "before_cleanup_bytes": m.before_cleanup_bytes,
        "cleanups": m.cleanups,
    }
    if m.kv is not None:
        memory["kv"] = {
            "slots": m.kv.slots,
            "slot_tokens": m.kv.slot_tokens,
            "slot_bytes": m.kv.slot_bytes,
            "slots_more": m.kv.slots_more,
        }
    return memory


def _sessions(app: EdgeContext, snap: sc.Snapshot) -> list[dict[str, Any]]:
    """This edge's sessions, with the late units their workers reported (None: its worker's
    leases were past the scheduler's --status-entries, not listed)."""
    late = {
        lease: n
        for w in snap.workers
        if w.headroom is not None
        for lease, n in w.headroom.late_units_by_lease.items()
    }
    unlisted = {w.worker_id for w in snap.workers if not w.leases_listed}
    sessions = [
        {
            "session_id": core.session_id,
            "mode": c.mode,
            "worker_id": core.worker_id,
            "started": core.started,
            "units": core.units_sent,
            # Units its worker answered later than one unit length after they arrived.
            "late_units": None if core.worker_id in unlisted else late.get(core.lease_id, 0),
        }
        for c in list(app.connections)
        if (core := c.core) is not None  # always: a connection is listed once it has one
    ]
    return sessions
