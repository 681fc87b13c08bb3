"""The edge's wiring: shared state (config, fabric clients, metrics, live connections),
the plain HTTP answers before a WebSocket upgrade (health, status, metrics, the default
voice, the web client's pages, API keys) and the routing of each upgraded connection to
its dialect (edge.dialects) and driver (edge.connection)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import InvalidHeader
from websockets.headers import parse_subprotocol
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from omnifabric.common.close_reasons import SERVER_SHUTDOWN
from omnifabric.common.paths import cache_root
from omnifabric.edge import api, dialects, static
from omnifabric.edge.access import KeySessions, key_digest, peer_host, subprotocol_key
from omnifabric.edge.apps import Apps
from omnifabric.edge.config import EdgeConfig
from omnifabric.edge.connection import ChatConnection, DuplexConnection, connection_for
from omnifabric.edge.dialects.http_chat import use_post
from omnifabric.edge.errors import InvalidPayload
from omnifabric.edge.fabric import Fabric
from omnifabric.edge.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from omnifabric.edge.metrics import EdgeMetrics
from omnifabric.edge.outbox import keepalive
from omnifabric.edge.presets import Presets
from omnifabric.edge.sessions_api import Recordings
from omnifabric.edge.transports.websocket import WebSocketTransport
from omnifabric.edge.voices import VoiceRegistry

log = logging.getLogger("omnifabric.edge.app")

SUBPROTOCOL = Subprotocol("map.realtime")
#: What OpenAI's browser clients offer beside their key.
OPENAI_SUBPROTOCOL = Subprotocol("realtime")
SUBPROTOCOLS = (SUBPROTOCOL, OPENAI_SUBPROTOCOL)


def select_subprotocol(
    _conn: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    """Pick map.realtime (or OpenAI's `realtime`) when offered; clients that offer none
    still connect. A key offer is never selected, so the key is never echoed."""
    return next((name for name in SUBPROTOCOLS if name in offered), None)


def offered_subprotocols(headers: Headers) -> list[str]:
    """The subprotocols an upgrade request offers; [] when none or malformed (the
    handshake then refuses a malformed header itself)."""
    offered: list[str] = []
    try:
        for value in headers.get_all("Sec-WebSocket-Protocol"):
            offered.extend(parse_subprotocol(value))
    except InvalidHeader:
        return []
    return offered


def request_authorization(headers: Headers) -> str:
    """The credentials of an upgrade request as an Authorization value: the header, else
    `Bearer <key>` from a `bearer.<key>` subprotocol (browsers cannot set the header)."""
    authorization = headers.get("Authorization", "")
    if authorization:
        return authorization
    key = subprotocol_key(offered_subprotocols(headers))
    return f"Bearer {key}" if key else ""


def key_allowed(config: EdgeConfig, headers: Headers) -> bool:
    """Bearer key check against the configured digests (constant-time compare)."""
    return key_digest(config, headers.get("Authorization", "")) is not None


#: The default voice, as the reference server serves it.
DEFAULT_REF_AUDIO_PATH = "/api/default_ref_audio"


def default_ref_audio_body(path: str | None) -> dict[str, Any] | None:
    """The endpoint's JSON for the WAV at `path`, or None when there is none (a file that
    cannot be read is logged)."""
    import base64
    from pathlib import Path

    from omnifabric.edge.pcm import wav_to_pcm16k

    if not path:
        return None
    try:
        pcm = wav_to_pcm16k(Path(path).read_bytes(), "default reference audio")
    except (OSError, InvalidPayload) as exc:
        log.error("default reference audio %s unusable: %s", path, exc)
        return None
    samples = len(pcm) // 4
    return {
        "name": Path(path).name,
        "duration": round(samples / 16000, 1),
        "sample_rate": 16000,
        "samples": samples,
        "base64": base64.b64encode(pcm).decode("ascii"),
    }


def _plain(status: HTTPStatus, body: str, content_type: str = "text/plain") -> Response:
    headers = Headers([("Content-Type", f"{content_type}; charset=utf-8")])
    return Response(status.value, status.phrase, headers, body.encode())


def _api_response(answer: Any) -> Response:
    """An API answer (JSON, or bytes with their type) as the WebSocket server's Response."""
    if isinstance(answer.body, bytes):
        headers = Headers([("Content-Type", answer.content_type)])
        if getattr(answer, "filename", None):
            headers["Content-Disposition"] = f'attachment; filename="{answer.filename}"'
        return Response(answer.status.value, answer.status.phrase, headers, answer.body)
    return _plain(answer.status, json.dumps(answer.body, ensure_ascii=False), "application/json")


class EdgeApp:
    """Shared state of the WebSocket server: config, fabric clients, live connections."""

    def __init__(self, config: EdgeConfig, fabric: Fabric, metrics: EdgeMetrics) -> None:
        self.config = config
        self.fabric = fabric
        self.metrics = metrics
        self.connections: set[DuplexConnection] = set()
        """Duplex sessions on every transport (WebSocket and gRPC): the drain ends them."""
        self.chats: set[ChatConnection] = set()
        """Chat connections (mode=chat, /ws/chat, POST /api/chat): the drain ends them
        in-band too."""
        self.http_tasks: set[asyncio.Task] = set()
        """POST /api/chat exchanges in flight."""
        self.draining = False
        self._default_ref_audio: str | None = None
        """GET /api/default_ref_audio's body, made at the first request."""
        self.recordings = Recordings(config.record_dir)
        """/api/sessions: this edge's recorded sessions (when it records)."""
        self.apps = Apps()
        """Which kinds of session take new sessions (/api/apps, /api/admin/apps)."""
        self.presets = Presets(config.presets_dir)
        """GET /api/presets: the operator's preset files (read again when they change)."""
        self.voices = VoiceRegistry(config.voices_dir or cache_root() / "ref_audio")
        """/api/assets/ref_audio: registered reference voices."""
        self.key_sessions = KeySessions(config)
        """Open sessions per API key, held from the upgrade to the connection's end."""
        self._held_keys: dict[ServerConnection, str] = {}
        """The key digest each upgraded connection holds a session of (released gives it
        back)."""

    def select_subprotocol(
        self, conn: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        return select_subprotocol(conn, offered)

    def released(self, conn: ServerConnection) -> None:
        """The upgraded connection is over: the key's session slot it held comes back."""
        held = self._held_keys.pop(conn, None)
        if held is not None:
            self.key_sessions.give_back(held)

    async def process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        """HTTP before the upgrade: health, status, routing and API keys (401 before upgrade)."""
        path = urlsplit(request.path).path
        if path == "/status":
            if not key_allowed(self.config, request.headers):
                return _plain(HTTPStatus.UNAUTHORIZED, "missing or invalid API key\n")
            return await self.status_response()
        if path in ("/workers", "/cache"):
            # The reference server's operator views, from the scheduler's snapshot.
            if not key_allowed(self.config, request.headers):
                return _plain(HTTPStatus.UNAUTHORIZED, "missing or invalid API key\n")
            return await self.workers_response(cache=path == "/cache")
        if path == "/health":  # the reference server's health check
            if self.draining:
                return _plain(
                    HTTPStatus.SERVICE_UNAVAILABLE, '{"status":"draining"}', "application/json"
                )
            now = datetime.now(UTC).isoformat(timespec="milliseconds")
            body = json.dumps({"status": "healthy", "timestamp": now})
            return _plain(HTTPStatus.OK, body, "application/json")
        if path in static.REFERENCE_PAGES:
            # The reference server's page paths lead to ours.
            headers = Headers([("Location", static.REFERENCE_PAGES[path])])
            return Response(302, "Found", headers, b"")
        if path == "/healthz":
            if self.draining:
                return _plain(
                    HTTPStatus.SERVICE_UNAVAILABLE, '{"status":"draining"}', "application/json"
                )
            return _plain(HTTPStatus.OK, '{"status":"ok"}', "application/json")
        if path == "/metrics":
            # Prometheus scrape: counts and timings only (no ids, keys or content).
            headers = Headers([("Content-Type", METRICS_CONTENT_TYPE)])
            return Response(200, "OK", headers, self.metrics.exposition())
        if path == DEFAULT_REF_AUDIO_PATH:
            # The server's own voice, what the pages load before a session: no key.
            return self.default_ref_audio_response()
        auth = request_authorization(request.headers)
        peer = peer_host(conn.remote_address)
        answer = await api.handle(self, "GET", path, b"", auth, peer)
        if answer is not None:
            # The HTTP API beside the sessions (edge/api.py; it checks keys).
            return _api_response(answer)
        if static.is_static(path):
            # The web client's pages hold no data: no key. What they open or fetch needs one.
            return static.static_response(request, path)
        if dialects.find(dialects.WEBSOCKET, path) is None:
            if dialects.find(dialects.HTTP, path) is not None:  # POST /api/chat
                return _api_response(use_post())
            return _plain(HTTPStatus.NOT_FOUND, f"no such endpoint: {path}\n")
        if self.draining:
            return _plain(HTTPStatus.SERVICE_UNAVAILABLE, "the server is draining\n")
        offered = offered_subprotocols(request.headers)
        if subprotocol_key(offered) is not None and not set(SUBPROTOCOLS) & set(offered):
            # Otherwise no subprotocol is selected and browsers fail the connection silently.
            return _plain(
                HTTPStatus.BAD_REQUEST,
                f"offer the {SUBPROTOCOL} subprotocol along with bearer.<key> (or "
                f"{OPENAI_SUBPROTOCOL} with openai-insecure-api-key.<key>)\n",
            )
        digest = key_digest(self.config, request_authorization(request.headers))
        if digest is None:
            return _plain(HTTPStatus.UNAUTHORIZED, "missing or invalid API key\n")
        if digest:
            if not self.key_sessions.take(digest):
                limit = self.key_sessions.limit(digest)
                return _plain(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"this API key already holds {limit} open sessions, its limit: "
                    "close one and retry\n",
                )
            # Given back when the connection is over, whatever ends it (released).
            self._held_keys[conn] = digest
        return None

    def default_ref_audio_response(self) -> Response:
        """GET /api/default_ref_audio: the default voice as float32 16 kHz PCM in base64
        with its name, duration and length (read once); 404 when none is configured."""
        if self._default_ref_audio is None:
            body = default_ref_audio_body(self.config.default_ref_audio)
            if body is None:
                return _plain(
                    HTTPStatus.NOT_FOUND,
                    json.dumps({"error": "no default reference audio configured"}),
                    "application/json",
                )
            self._default_ref_audio = json.dumps(body)
        return _plain(HTTPStatus.OK, self._default_ref_audio, "application/json")

    async def workers_response(self, cache: bool) -> Response:
        """GET /workers ({total, workers}) or GET /cache ({workers: [{worker_id, status}]})
        as the reference server answers them."""
        from omnifabric.edge.status import reference_workers, snapshot

        try:
            workers = reference_workers(await snapshot(self))
        except Exception as exc:
            log.warning("workers: scheduler unavailable: %s", exc)
            return _plain(
                HTTPStatus.SERVICE_UNAVAILABLE,
                json.dumps({"error": "scheduler unavailable"}),
                "application/json",
            )
        if cache:
            body: dict[str, Any] = {
                "workers": [{"worker_id": w["worker_id"], "status": w["status"]} for w in workers]
            }
        else:
            body = {"total": len(workers), "workers": workers}
        return _plain(HTTPStatus.OK, json.dumps(body), "application/json")

    async def status_response(self) -> Response:
        """GET /status: workers, slots, queue, sessions and schedulers as JSON (no secrets,
        no audio); 503 with the schedulers alone when the leading one cannot be asked."""
        from omnifabric.edge.status import edge_status, scheduler_list

        try:
            body = await edge_status(self)
        except Exception as exc:  # the scheduler is down or slow: say so, keep serving
            log.warning("status: scheduler unavailable: %s", exc)
            return _plain(
                HTTPStatus.SERVICE_UNAVAILABLE,
                json.dumps({"error": "scheduler unavailable", **await scheduler_list(self)}),
                "application/json",
            )
        return _plain(HTTPStatus.OK, json.dumps(body), "application/json")

    async def handler(self, ws: ServerConnection) -> None:
        """One client connection, from upgrade to close, under the edge's keepalive."""
        if self.draining:  # upgraded in the instant before the drain began
            await ws.close(1001, SERVER_SHUTDOWN)  # as every drained connection
            return
        pinger = asyncio.create_task(
            keepalive(ws, self.config.ping_interval_s, self.config.ping_timeout_s)
        )
        try:
            await self._route(ws)
        finally:
            pinger.cancel()

    async def _route(self, ws: ServerConnection) -> None:
        url = urlsplit(ws.request.path if ws.request is not None else "")
        found = dialects.find(dialects.WEBSOCKET, url.path)
        if found is None:  # process_request answered 404 before the upgrade
            await ws.close(1008, "no such endpoint")
            return
        route, rest = found
        dialect = route.open(rest, parse_qs(url.query), self.config.default_mode)
        transport = WebSocketTransport(ws, self.config)
        transport.owner = self._held_keys.get(ws, "")
        await connection_for(self, transport, dialect).run()
