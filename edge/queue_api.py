"""The queue as the reference server shows it: `GET /api/queue`, `GET|DELETE
/api/queue/{ticket}`, `GET|PUT /api/config/eta`, answered from the scheduler (GetStatus,
CancelTicket, SetEta, through edge.scheduler_client). Shapes follow the reference server's
models; session types are named as it names them (`audio_duplex`, `omni_duplex`, `chat`)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from typing import Any

from omnifabric.edge import fields
from omnifabric.edge import scheduler_client as sc
from omnifabric.edge.dialects.http_chat import HttpResponse

#: Scheduler mode -> the reference server's session type.
REQUEST_TYPES = {"audio": "audio_duplex", "video": "omni_duplex", "chat": "chat"}
#: PUT /api/config/eta field -> scheduler mode.
ETA_FIELDS = {"eta_chat_s": "chat", "eta_audio_duplex_s": "audio", "eta_omni_duplex_s": "video"}


def _type(mode: str) -> str:
    return REQUEST_TYPES.get(mode, mode)


def started_at(ago_s: float) -> str:
    """ISO time `ago_s` seconds ago."""
    return (datetime.now(UTC) - timedelta(seconds=ago_s)).isoformat(timespec="milliseconds")


def _item(entry: sc.QueueEntry) -> dict[str, Any]:
    return {
        "ticket_id": entry.ticket_id,
        "request_type": _type(entry.mode),
        "session_id": entry.session_id,
        "position": entry.position,
        "estimated_wait_s": round(entry.estimated_wait_s, 1),
        "enqueued_at": started_at(entry.waited_s),
        "wait_elapsed_s": round(entry.waited_s, 1),
    }


def running_tasks(snap: sc.Snapshot) -> list[dict[str, Any]]:
    """The sessions on workers as the reference server lists them (RunningTaskInfo)."""
    return [
        {
            "worker_id": r.worker_id,
            "request_type": _type(r.mode),
            "session_id": r.session_id,
            "started_at": started_at(r.elapsed_s),
            "elapsed_s": round(r.elapsed_s, 1),
            "estimated_remaining_s": round(r.estimated_remaining_s, 1),
        }
        for r in snap.running
    ]


async def queue(stub: Any) -> HttpResponse:
    snap = await sc.get_status(stub)
    body = {
        "queue_length": snap.queue_length,
        "max_queue_size": snap.queue_max,
        "items": [_item(q) for q in snap.queue],
        "running_tasks": running_tasks(snap),
    }
    return HttpResponse(HTTPStatus.OK, body)


async def ticket(stub: Any, ticket_id: str) -> HttpResponse:
    found = await sc.find_ticket(stub, ticket_id)
    if found is None:
        message = "not waiting: already served, gone, cancelled or unknown"
        return HttpResponse(HTTPStatus.OK, {"found": False, "message": message})
    return HttpResponse(HTTPStatus.OK, {"found": True, "ticket": _item(found)})


async def cancel(stub: Any, ticket_id: str) -> HttpResponse:
    return HttpResponse(HTTPStatus.OK, {"success": await sc.cancel_ticket(stub, ticket_id)})


def eta_body(eta: sc.Eta) -> dict[str, Any]:
    """The wait estimate as the reference server shapes it. Half-duplex has no queue of its own
    yet: its figures are the audio duplex ones."""
    config = {f: eta.baseline_s.get(mode, 0.0) for f, mode in ETA_FIELDS.items()}
    config["eta_half_duplex_s"] = config["eta_audio_duplex_s"]
    body: dict[str, Any] = {"config": config, "ema_alpha": eta.alpha}
    names = {"chat": "chat", "audio": "audio_duplex", "video": "omni_duplex"}
    for mode, name in names.items():
        body[f"ema_{name}_s"] = eta.mean_s[mode] if mode in eta.mean_s else None
        body[f"ema_{name}_samples"] = eta.samples.get(mode, 0)
    body["ema_half_duplex_s"] = body["ema_audio_duplex_s"]
    body["ema_half_duplex_samples"] = body["ema_audio_duplex_samples"]
    return body


async def get_eta(stub: Any) -> HttpResponse:
    return HttpResponse(HTTPStatus.OK, eta_body(await sc.get_eta(stub)))


def eta_request(request: dict[str, Any]) -> sc.EtaChange:
    """PUT /api/config/eta's body (an object, edge.api.body_object) as the change it asks
    for; ValueError naming the bad field."""
    known = {*ETA_FIELDS, "eta_half_duplex_s", "ema_alpha"}
    unknown = sorted(set(request) - known)
    if unknown:
        raise ValueError(
            f"unknown field {fields.shown(unknown[0])} (use {', '.join(sorted(known))})"
        )
    alpha = 0.0
    baseline_s: dict[str, float] = {}
    for field, value in request.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{field} must be a number")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{field} must be a positive number")
        if field == "ema_alpha":
            alpha = float(value)
        elif field in ETA_FIELDS:
            baseline_s[ETA_FIELDS[field]] = float(value)
    return sc.EtaChange(alpha, baseline_s)


async def set_eta(stub: Any, change: sc.EtaChange) -> HttpResponse:
    return HttpResponse(HTTPStatus.OK, eta_body(await sc.set_eta(stub, change)))
