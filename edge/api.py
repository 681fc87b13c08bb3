"""The edge's small HTTP API beside the sessions, as the reference server offers it: page
settings, system-prompt presets, registered reference voices, the queue and its estimate.

`handle(context, method, path, body, authorization, peer)` answers one request (None: not
an API path; `peer`: the connection's own address, which the operator endpoints check
through edge.access.operator_refusal). GET requests reach it from the WebSocket server's
request hook (edge/app.py), the others from the HTTP reader (edge/transports/http.py): one
table for both. Errors have the shape of POST /api/chat's, plus `detail` as the reference
server (FastAPI) words it.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

import grpc

from omnifabric.edge import fields, queue_api, sessions_api
from omnifabric.edge.access import key_digest, operator_refusal
from omnifabric.edge.apps import Apps
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.connection import DuplexConnection
from omnifabric.edge.dialects.http_chat import HttpResponse
from omnifabric.edge.errors import ClientError, InvalidPayload
from omnifabric.edge.fabric import Fabric
from omnifabric.edge.presets import Presets
from omnifabric.edge.scheduler_client import admin_error
from omnifabric.edge.sessions_api import Recordings
from omnifabric.edge.voices import VoiceRegistry

FRONTEND_DEFAULTS = "/api/frontend_defaults"
PRESETS = "/api/presets"
VOICES = "/api/assets/ref_audio"
QUEUE = "/api/queue"
ETA = "/api/config/eta"
APPS = "/api/apps"
HALF_DUPLEX_STOP = "/api/half_duplex/stop"
ADMIN_APPS = "/api/admin/apps"


class ApiContext(Protocol):
    config: EdgeConfig
    connections: set[DuplexConnection]
    fabric: Fabric
    apps: Apps
    recordings: Recordings
    presets: Presets
    voices: VoiceRegistry


def error(status: HTTPStatus, code: str, message: str) -> HttpResponse:
    return HttpResponse(
        status, {"success": False, "error": code, "message": message, "detail": message}
    )


def body_object(body: bytes) -> dict[str, Any]:
    """A request's body as a JSON object (the events' one reader, edge.fields); ValueError
    with the message a 400 answers."""
    try:
        return fields.parse_object(body.decode("utf-8"), "the body")
    except (UnicodeDecodeError, fields.InvalidJson):
        raise ValueError("the body is not JSON") from None
    except ClientError as exc:
        raise ValueError(exc.message) from None


def is_api(path: str) -> bool:
    return path in (
        FRONTEND_DEFAULTS,
        PRESETS,
        VOICES,
        QUEUE,
        ETA,
        APPS,
        ADMIN_APPS,
        HALF_DUPLEX_STOP,
        sessions_api.PREFIX,
    ) or path.startswith(
        (PRESETS + "/", VOICES + "/", QUEUE + "/", ADMIN_APPS + "/", sessions_api.PREFIX + "/")
    )


async def handle(
    context: ApiContext, method: str, path: str, body: bytes, authorization: str, peer: str
) -> HttpResponse | sessions_api.Answer | None:
    """The answer to one API request from `peer` (the connection's address), or None when
    `path` is not the API's. Recorded sessions answer with `sessions_api.Answer` (their
    assets and downloads are bytes)."""
    if not is_api(path):
        return None
    if path == sessions_api.PREFIX or path.startswith(sessions_api.PREFIX + "/"):
        # Recordings hold users' voices: a key when keys are on, read off the event loop.
        if key_digest(context.config, authorization) is None:
            return error(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or invalid API key")
        if method != "GET":
            return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use GET")
        return await asyncio.to_thread(context.recordings.answer, path)
    if path == QUEUE or path.startswith(QUEUE + "/") or path == ETA:
        try:
            return await _queue(context, method, path, body, authorization, peer)
        except grpc.aio.AioRpcError as err:
            failure = admin_error(err)
            if isinstance(failure, InvalidPayload):
                return error(HTTPStatus.BAD_REQUEST, "invalid_request", failure.message)
            return error(HTTPStatus.SERVICE_UNAVAILABLE, "service_unavailable", failure.message)
    if path == HALF_DUPLEX_STOP:
        return await _half_duplex_stop(context, method, body, authorization)
    if path == APPS or path.startswith(ADMIN_APPS):
        try:
            return await _apps(context, method, path, body, authorization, peer)
        except grpc.aio.AioRpcError:
            return error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "service_unavailable",
                "the scheduler cannot be reached: app switches are the fabric's",
            )
    if path == FRONTEND_DEFAULTS or path.startswith(PRESETS):
        # What the pages load before a session: no key, as the reference server.
        if method != "GET":
            return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use GET")
        return _page_data(context, path)
    if key_digest(context.config, authorization) is None:
        return error(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or invalid API key")
    if path == VOICES:
        if method == "GET":
            return HttpResponse(HTTPStatus.OK, context.voices.list())
        if method == "POST":
            return _upload(context, body)
        return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use GET or POST")
    voice_id = unquote(path.removeprefix(VOICES + "/"))
    if method != "DELETE":
        return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use DELETE")
    # A registered voice is everybody's: deleting one is the operator's.
    refused = operator_refusal(context.config, authorization, peer)
    if refused is not None:
        return error(HTTPStatus.FORBIDDEN, "forbidden", refused)
    if not context.voices.delete(voice_id):
        return error(HTTPStatus.NOT_FOUND, "not_found", f"no reference audio {voice_id}")
    return HttpResponse(HTTPStatus.OK, {"success": True, "id": voice_id, "message": "deleted"})


def _page_data(context: ApiContext, path: str) -> HttpResponse:
    if path == FRONTEND_DEFAULTS:
        return HttpResponse(HTTPStatus.OK, {"playback_delay_ms": context.config.playback_delay_ms})
    if path == PRESETS:
        return HttpResponse(HTTPStatus.OK, dict(context.presets.listing()))
    parts = path.removeprefix(PRESETS + "/").split("/")
    if len(parts) == 3 and parts[2] == "audio" and all(parts[:2]):
        mode, preset_id = unquote(parts[0]), unquote(parts[1])
        audio = context.presets.audio(mode, preset_id)
        if audio is not None:
            return HttpResponse(HTTPStatus.OK, audio)
        return error(HTTPStatus.NOT_FOUND, "not_found", f"no preset {mode}/{preset_id}")
    return error(HTTPStatus.NOT_FOUND, "not_found", f"no such endpoint: {path}")


async def _queue(
    context: ApiContext, method: str, path: str, body: bytes, authorization: str, peer: str
) -> HttpResponse:
    """The queue and the wait estimate: reading them needs an API key (when keys are on),
    cancelling and changing the estimate are the operator's."""
    stub = context.fabric.scheduler
    if key_digest(context.config, authorization) is None:
        return error(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or invalid API key")
    writes = {("DELETE", "ticket"), ("PUT", "eta")}
    what = "eta" if path == ETA else "queue" if path == QUEUE else "ticket"
    allowed = {"queue": ("GET",), "ticket": ("GET", "DELETE"), "eta": ("GET", "PUT")}[what]
    if method not in allowed:
        return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", f"use {' or '.join(allowed)}")
    if (method, what) in writes:
        refused = operator_refusal(context.config, authorization, peer)
        if refused is not None:
            return error(HTTPStatus.FORBIDDEN, "forbidden", refused)
    if what == "queue":
        return await queue_api.queue(stub)
    if what == "eta":
        if method == "GET":
            return await queue_api.get_eta(stub)
        try:
            request = queue_api.eta_request(body_object(body))
        except ValueError as exc:
            return error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
        return await queue_api.set_eta(stub, request)
    ticket_id = unquote(path.removeprefix(QUEUE + "/"))
    if not ticket_id or "/" in ticket_id:
        return error(HTTPStatus.NOT_FOUND, "not_found", f"no such endpoint: {path}")
    if method == "GET":
        return await queue_api.ticket(stub, ticket_id)
    return await queue_api.cancel(stub, ticket_id)


async def _half_duplex_stop(
    context: ApiContext, method: str, body: bytes, authorization: str
) -> HttpResponse:
    """POST /api/half_duplex/stop {session_id}: end the model's answer in that call now."""
    if key_digest(context.config, authorization) is None:
        return error(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or invalid API key")
    if method != "POST":
        return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use POST")
    try:
        request = body_object(body)
    except ValueError as exc:
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
    session_id = request.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", 'send {"session_id": "..."}')
    for connection in list(context.connections):
        if connection.dialect.name == "half_duplex" and connection.dialect.session_id == session_id:
            stopped = await connection.stop_turn()
            message = "the answer was stopped" if stopped else "no answer in progress"
            return HttpResponse(HTTPStatus.OK, {"success": stopped, "message": message})
    return error(HTTPStatus.NOT_FOUND, "not_found", f"no half-duplex call {session_id}")


async def _apps(
    context: ApiContext, method: str, path: str, body: bytes, authorization: str, peer: str
) -> HttpResponse:
    """The enabled apps (public, the pages read them), every app and the switch (the
    operator's)."""
    if path == APPS:
        if method != "GET":
            return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use GET")
        return HttpResponse(HTTPStatus.OK, context.apps.public())
    refused = operator_refusal(context.config, authorization, peer)
    if refused is not None:
        return error(HTTPStatus.FORBIDDEN, "forbidden", refused)
    if path == ADMIN_APPS:
        if method != "GET":
            return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use GET")
        return HttpResponse(HTTPStatus.OK, context.apps.admin())
    if method != "PUT":
        return error(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use PUT")
    try:
        request = body_object(body)
    except ValueError as exc:
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
    if not isinstance(request.get("enabled"), bool):
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", 'send {"enabled": true|false}')
    app_id = unquote(path.removeprefix(ADMIN_APPS + "/"))
    app = await context.apps.switch(context.fabric.scheduler, app_id, request["enabled"])
    if app is None:
        return error(HTTPStatus.NOT_FOUND, "not_found", f"no app {app_id}")
    return HttpResponse(HTTPStatus.OK, {"success": True, "app": app})


def _upload(context: ApiContext, body: bytes) -> HttpResponse:
    try:
        request = body_object(body)
    except ValueError as exc:
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
    try:
        voice = context.voices.upload(request.get("name"), request.get("audio_base64"))
    except InvalidPayload as exc:
        return error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
    return HttpResponse(
        HTTPStatus.OK,
        {
            "success": True,
            "id": voice.id,
            "name": voice.name,
            "message": f"stored: {voice.duration_ms} ms at 16 kHz",
        },
    )
