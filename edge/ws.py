"""The public WebSocket surface: /v1/realtime (both dialects), /healthz, API keys.

One `Connection` per client drives a SessionCore: it parses frames, enforces the
state machine (queued -> connected -> active -> closed) and renders events in the
dialect the client's first init chose.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from opentelemetry import context as otel_context
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidHeader
from websockets.headers import parse_subprotocol
from websockets.http11 import Request, Response

from edge import events as ev
from edge import protocol, static
from edge.access import KeySessions, key_digest, subprotocol_key
from edge.config import EdgeConfig
from edge.errors import (
    EdgeError,
    InferenceError,
    InvalidEvent,
    InvalidPayload,
    NotReady,
    error_event,
)
from edge.fabric import Fabric
from edge.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from edge.metrics import METRICS
from edge.outbox import Outbox, keepalive
from edge.recording import SessionRecorder
from edge.session import SessionCore

log = logging.getLogger("omnifabric.edge.ws")

SUBPROTOCOL = "map.realtime"
REALTIME_PATH = "/v1/realtime"
LEGACY_DUPLEX_PREFIX = "/ws/duplex/"
LEGACY_CHAT_PATH = "/ws/chat"


def select_subprotocol(_conn: ServerConnection, offered: Any) -> str | None:
    """Pick map.realtime when offered; clients that offer none still connect. A
    `bearer.<key>` offer is never selected, so the key is never echoed."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


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


def outbox_for(
    app: EdgeApp,
    ws: ServerConnection,
    core: SessionCore,
    done: asyncio.Event,
    render_error: Callable[[EdgeError], dict[str, Any]] = error_event,
) -> Outbox:
    """The bounded outbound queue of one session's connection, sized by the edge's config.
    On overflow the session ends at once (`done` set, worker stream and lease dropped)."""
    ending: list[asyncio.Future] = []

    def overflowed() -> None:
        done.set()
        ending.append(asyncio.ensure_future(core.abort()))

    return Outbox.sized_by(app.config, ws, overflowed, render_error)


def finish_timeout_s(config: EdgeConfig) -> float:
    """Longest a connection's last frames may take to go out: past it the keepalive would
    have dropped a client that does not read."""
    return config.ping_interval_s + config.ping_timeout_s + config.ws_close_timeout_s


#: The default voice, as the reference server serves it.
DEFAULT_REF_AUDIO_PATH = "/api/default_ref_audio"


def default_ref_audio_body(path: str | None) -> dict[str, Any] | None:
    """The endpoint's JSON for the WAV at `path`, or None when there is none (a file that
    cannot be read is logged)."""
    import base64
    from pathlib import Path

    from edge.pcm import wav_to_pcm16k

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


class EdgeApp:
    """Shared state of the WebSocket server: config, fabric clients, live connections."""

    def __init__(self, config: EdgeConfig, fabric: Fabric) -> None:
        self.config = config
        self.fabric = fabric
        self.connections: set[Connection] = set()
        self.chats: set[Any] = set()
        """Chat connections (mode=chat, /ws/chat; edge.chat_endpoints): the drain ends them
        in-band too."""
        self.http_tasks: set[asyncio.Task] = set()
        """POST /api/chat exchanges in flight."""
        self.draining = False
        self._default_ref_audio: str | None = None
        """GET /api/default_ref_audio's body, made at the first request."""
        self.key_sessions = KeySessions(config)
        """Open sessions per API key, held from the upgrade to the connection's end."""

    def key_ok(self, headers: Headers) -> bool:
        """API key check for plain HTTP requests (same rule as the WebSocket upgrade)."""
        return key_allowed(self.config, headers)

    async def process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        """HTTP before the upgrade: health, status, routing and API keys (401 before upgrade)."""
        path = urlsplit(request.path).path
        if path == "/status":
            if not key_allowed(self.config, request.headers):
                return _plain(HTTPStatus.UNAUTHORIZED, "missing or invalid API key\n")
            return await self.status_response()
        if path == "/healthz":
            if self.draining:
                return _plain(
                    HTTPStatus.SERVICE_UNAVAILABLE, '{"status":"draining"}', "application/json"
                )
            return _plain(HTTPStatus.OK, '{"status":"ok"}', "application/json")
        if path == "/metrics":
            # Prometheus scrape: counts and timings only (no ids, keys or content).
            headers = Headers([("Content-Type", METRICS_CONTENT_TYPE)])
            return Response(200, "OK", headers, METRICS.exposition())
        if path == DEFAULT_REF_AUDIO_PATH:
            # The server's own voice, what the pages load before a session: no key.
            return self.default_ref_audio_response()
        if static.is_static(path):
            # The web client's pages hold no data: no key. What they open or fetch needs one.
            return static.static_response(request, path)
        if path not in (REALTIME_PATH, LEGACY_CHAT_PATH) and not (
            path.startswith(LEGACY_DUPLEX_PREFIX) and len(path) > len(LEGACY_DUPLEX_PREFIX)
        ):
            return _plain(HTTPStatus.NOT_FOUND, f"no such endpoint: {path}\n")
        if self.draining:
            return _plain(HTTPStatus.SERVICE_UNAVAILABLE, "the server is draining\n")
        offered = offered_subprotocols(request.headers)
        if subprotocol_key(offered) is not None and SUBPROTOCOL not in offered:
            # Otherwise no subprotocol is selected and browsers fail the connection silently.
            return _plain(
                HTTPStatus.BAD_REQUEST,
                f"offer the {SUBPROTOCOL} subprotocol along with bearer.<key>\n",
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
            # Given back when the TCP connection ends, whatever ends it (http_api).
            conn.held_key = digest  # type: ignore[union-attr]
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

    async def status_response(self) -> Response:
        """GET /status: workers, slots, queue and sessions as JSON (no secrets, no audio)."""
        from edge.status import edge_status

        try:
            body = await edge_status(self)
        except Exception as exc:  # the scheduler is down or slow: say so, keep serving
            log.warning("status: scheduler unavailable: %s", exc)
            return _plain(
                HTTPStatus.SERVICE_UNAVAILABLE,
                json.dumps({"error": "scheduler unavailable"}),
                "application/json",
            )
        return _plain(HTTPStatus.OK, json.dumps(body), "application/json")

    async def handler(self, ws: ServerConnection) -> None:
        """One client connection, from upgrade to close, under the edge's keepalive."""
        if self.draining:  # upgraded in the instant before the drain began
            await ws.close(1001, "the server is shutting down")
            return
        pinger = asyncio.create_task(
            keepalive(ws, self.config.ping_interval_s, self.config.ping_timeout_s)
        )
        try:
            await self._route(ws)
        finally:
            pinger.cancel()

    async def _route(self, ws: ServerConnection) -> None:
        path = urlsplit(ws.request.path).path
        if path.startswith(LEGACY_DUPLEX_PREFIX):
            from edge.legacy_duplex import LegacyDuplexConnection

            await LegacyDuplexConnection(self, ws, path[len(LEGACY_DUPLEX_PREFIX) :]).run()
            return
        if path == LEGACY_CHAT_PATH:
            from edge.chat_endpoints import LegacyChatConnection

            await LegacyChatConnection(self, ws).run()
            return
        query = parse_qs(urlsplit(ws.request.path).query)
        mode = (query.get("mode") or [self.config.default_mode])[0]
        if mode == "chat":
            from edge.chat_endpoints import ChatConnection

            await ChatConnection(self, ws).run()
            return
        if mode not in ev.MODES:
            message = f"unknown mode {mode[:32]!r}: use chat, audio or video"
            await ws.send(json.dumps(error_event(InvalidPayload(message))))
            await ws.close(1008, "unsupported mode")
            return
        conn = Connection(self, ws, mode)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)


class Connection:
    """One WebSocket client session: the public state machine around a SessionCore."""

    def __init__(self, app: EdgeApp, ws: ServerConnection, mode: str) -> None:
        self.app = app
        self.ws = ws
        self.mode = mode
        self.dialect: ev.Dialect | None = None
        self.core = SessionCore(
            mode,
            app.fabric,
            self._on_event,
            start_timeout_s=app.config.worker_start_timeout_s,
            close_timeout_s=app.config.close_timeout_s,
            unit_timeout_s=app.config.unit_timeout_s,
        )
        self.renderer: protocol.OutputRenderer | None = None
        self._pending_init: ev.InitCommand | None = None
        self._leased = asyncio.Event()
        self._done = asyncio.Event()
        self.outbox = outbox_for(app, ws, self.core, self._done)
        self.finished = asyncio.Event()
        """Set once the connection is over and its last frames went out (drain waits)."""
        # Opt-in recording (--record-dir); a disabled recorder ignores every call.
        self.recorder = SessionRecorder.for_session(
            app.config, self.core.session_id, mode, ws.request.path
        )

    async def send(self, event: dict[str, Any]) -> None:
        """Queue one event for the client (never waits on the client's socket)."""
        self.recorder.outbound(event)
        self.outbox.send(event)

    async def _on_event(self, event: Any) -> None:
        if isinstance(event, ev.Queued):
            await self.send(protocol.queued_json(event))
        elif isinstance(event, ev.QueueDone):
            await self.send(protocol.queue_done_json())
        elif isinstance(event, ev.Created):
            await self.send(
                protocol.created_json(event, self.dialect or ev.Dialect.CURRENT, self.mode)
            )
        elif isinstance(event, ev.Output):
            assert self.renderer is not None
            self.recorder.output(event)
            for item in self.renderer.render(event):
                await self.send(item)
        elif isinstance(event, ev.Closed):
            if event.error_code == InferenceError.code:
                await self.send(error_event(InferenceError(event.message or "inference failed")))
            await self.send(protocol.closed_json(event, self.dialect, self.core.session_id))
            self._done.set()
            self.outbox.close(1000, event.reason)

    async def fail(self, err: EdgeError) -> None:
        """Tell the client about an error; fatal ones close the connection with their code."""
        await self.send(error_event(err))
        if err.close_code is not None:
            self._done.set()
            self.outbox.close(err.close_code, err.code)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: end the session with server_shutdown. Without the worker's confirmation
        within timeout_s the session ends here (usage then unknown)."""
        await shutdown_core(self.core, self._on_event, timeout_s)

    async def run(self) -> None:
        # The session span is current for everything this connection does (log lines
        # carry its trace id; tasks created below inherit it).
        token = otel_context.attach(self.core._trace)
        acquire = asyncio.create_task(self._acquire())
        try:
            await self._read()
        finally:
            acquire.cancel()
            if not self.core.closed.is_set():
                await self.core.abort()
            await self.outbox.finish(finish_timeout_s(self.app.config))
            self.recorder.finish()
            otel_context.detach(token)
            self.finished.set()

    async def _acquire(self) -> None:
        try:
            await self.core.acquire()
        except EdgeError as err:
            if not self.core.closed.is_set():  # not the client's own close while queued
                await self.fail(err)
            return
        self._leased.set()
        if self._pending_init is not None:
            await self._start(self._pending_init)

    async def _start(self, init: ev.InitCommand) -> None:
        try:
            self.core.check_init(init)
        except EdgeError as err:
            # Outside the leased worker's limits: refused before anything was sent or
            # recorded, the session stays as it was and a corrected init may follow.
            self._pending_init = None
            await self.fail(err)
            return
        self.dialect = init.dialect
        self.renderer = protocol.OutputRenderer(init.dialect, self.core.session_id)
        self.recorder.start(init)
        try:
            await self.core.start(init)
        except EdgeError as err:
            await self.fail(err)
            if err.close_code is None and not self.core.closed.is_set():
                await self.core.close(ev.ERROR)

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if self._done.is_set():
                    break
                if isinstance(message, bytes):
                    await self.fail(InvalidPayload("binary frames are not part of the protocol"))
                    continue
                try:
                    event = protocol.parse_frame(message)
                    cmd = protocol.command(event)
                    await self._handle(cmd)
                except protocol.InvalidJson:
                    self.outbox.close(1003, "invalid JSON")
                    return
                except EdgeError as err:
                    await self.fail(err)
        except ConnectionClosed:
            pass

    async def _handle(self, cmd: ev.InitCommand | ev.AppendCommand | ev.CloseCommand) -> None:
        if isinstance(cmd, ev.CloseCommand):
            await self._close(cmd)
        elif isinstance(cmd, ev.InitCommand):
            if self.dialect is not None or self._pending_init is not None:
                raise InvalidEvent("the session is already initialized")
            if not self._leased.is_set():
                # Sent during the queue: kept and applied once a worker is assigned.
                self._pending_init = cmd
                return
            await self._start(cmd)
        else:
            if not self.core.started:
                raise NotReady("send session.init (or session.update) after session.queue_done")
            self.recorder.append(cmd, self.dialect)
            await self.core.append(cmd)

    async def _close(self, cmd: ev.CloseCommand) -> None:
        self.recorder.close_command(cmd)
        await self.core.close(ev.USER_STOP, cmd.reason)


async def shutdown_core(core: SessionCore, emit: Any, timeout_s: float) -> None:
    """End a session with server_shutdown, confirmed by its worker; if the worker does not
    confirm within timeout_s, drop the worker stream and emit the Closed event here."""
    if core.closed.is_set():
        return
    try:
        await asyncio.wait_for(core.close(ev.SERVER_SHUTDOWN), timeout_s)
    except TimeoutError:
        pass
    if not core.closed.is_set():
        log.warning("session %s: no end confirmed by the worker: closed here", core.session_id)
        await core.abort()
        await emit(ev.Closed(ev.SERVER_SHUTDOWN, ev.Usage(), "the worker did not confirm the end"))
