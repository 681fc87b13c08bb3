"""Plain HTTP requests with a body on the WebSocket port: `POST /api/chat`.

The websockets server only parses body-less GET handshakes, so the connection class
sniffs the first bytes: a `POST` is taken over by a small HTTP/1.1 exchange (one request,
`Connection: close`); anything else goes to the WebSocket handshake untouched. With API
keys configured a request needs a valid key (401) and holds one of the key's sessions while
its turn runs (429 at the key's limit, as the WebSocket endpoints answer before the upgrade).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers

from edge.access import key_digest
from edge.errors import EdgeError, QueueFull, ServiceUnavailable

log = logging.getLogger("omnifabric.edge.http")

MAX_HEAD_BYTES = 16 * 1024


class _Detached:
    """Stands in for a transport handed to the HTTP exchange: the websockets server aborts
    connections whose handshake did not open; that must not cut our response."""

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class HttpExchange:
    """One HTTP/1.1 request read from raw bytes, answered once, then the socket closes."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.buffer = b""
        self.head_done = False
        self.method = self.path = ""
        self.headers = Headers()
        self.length = 0
        self.ready = asyncio.get_running_loop().create_future()

    def feed(self, data: bytes) -> None:
        if self.ready.done():
            return
        self.buffer += data
        if not self.head_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self.ready.set_result((HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "head"))
                return
            head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4 :]
            self.head_done = True
            lines = head.split("\r\n")
            try:
                self.method, self.path, _ = lines[0].split(" ", 2)
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    self.headers[name.strip()] = value.strip()
                self.length = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                self.ready.set_result((HTTPStatus.BAD_REQUEST, "malformed request"))
                return
            if self.length < 0:
                self.ready.set_result((HTTPStatus.LENGTH_REQUIRED, "Content-Length required"))
                return
            if self.length > self.max_body:
                self.ready.set_result((HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large"))
                return
        if len(self.buffer) >= self.length:
            self.ready.set_result(None)

    def lost(self) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("client went away"))


def response_bytes(status: HTTPStatus, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + data


async def api_chat(app, body: bytes) -> tuple[HTTPStatus, dict[str, Any]]:
    """POST /api/chat: the chat request body -> the whole answer as JSON (text, a base64
    WAV of the speech, token counts, queue wait)."""
    from edge.chat import parse_chat, run_turn, wav_base64
    from edge.protocol import InvalidJson, parse_object, usage_json
    from edge.session import new_session_id

    t0 = time.monotonic()
    try:
        try:
            request = parse_object(body.decode("utf-8"))
        except (InvalidJson, UnicodeDecodeError):
            return HTTPStatus.BAD_REQUEST, {
                "success": False,
                "error": "invalid_payload",
                "message": "the body is not JSON",
            }
        chat = await asyncio.to_thread(parse_chat, request)
        waited: list[float] = []

        async def queued(q) -> None:
            waited.append(q.estimated_wait_s)

        async def nothing(*_: Any) -> None:
            return None

        result = await run_turn(
            app.fabric, chat, f"chat_{new_session_id()[3:]}", queued, nothing, nothing
        )
    except (QueueFull, ServiceUnavailable) as err:
        return HTTPStatus.SERVICE_UNAVAILABLE, {
            "success": False,
            "error": err.code,
            "message": err.message,
        }
    except EdgeError as err:
        status = (
            HTTPStatus.BAD_REQUEST
            if err.kind == "client_error"
            else HTTPStatus.INTERNAL_SERVER_ERROR
        )
        return status, {"success": False, "error": err.code, "message": err.message}
    audio = wav_base64(result.audio) if chat.speech and any(result.audio) else None
    return HTTPStatus.OK, {
        "success": True,
        "text": result.text,
        "audio_data": audio,
        "audio_sample_rate": 24000 if audio else None,
        "input_tokens": result.input_tokens,
        "generated_tokens": result.generated_tokens,
        "tokens_generated": result.generated_tokens,
        "reason": result.reason,
        "usage": usage_json(result.usage),
        "duration_ms": round((time.monotonic() - t0) * 1000.0),
        "queue_wait_ms": round(result.timings_ms.get("queue_ms", 0.0)),
        "estimated_queue_wait_s": round(waited[0], 1) if waited else 0.0,
        "ignored": list(result.ignored),
    }


def connection_class(app) -> type[ServerConnection]:
    """A ServerConnection that also answers POST /api/chat (and 404/405 other bodies)."""

    class EdgeConnection(ServerConnection):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._sniffed = b""
            self.held_key: str | None = None
            """Digest of the API key whose session slot this connection holds."""
            self._http: HttpExchange | None = None
            self._decided = asyncio.get_running_loop().create_future()
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._http is not None:
                self._http.feed(data)
                return
            if self._decided.done():
                super().data_received(data)
                return
            self._sniffed += data
            if len(self._sniffed) < 5 and b"\r\n" not in self._sniffed:
                return
            first, self._sniffed = self._sniffed, b""
            if first.startswith(b"POST "):
                self._http = HttpExchange(app.config.max_frame_bytes)
                self._decided.set_result(True)
                self._http.feed(first)
            else:
                self._decided.set_result(False)
                super().data_received(first)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._decided.done():
                self._decided.set_result(False)
            if self._http is not None:
                self._http.lost()
            # Called once whatever ends the connection: the key's session slot comes back.
            held, self.held_key = self.held_key, None
            if held is not None:
                app.key_sessions.give_back(held)
            super().connection_lost(exc)

        async def handshake(self, *args: Any, **kwargs: Any) -> None:
            await asyncio.wait(
                [self._decided, self.connection_lost_waiter], return_when=asyncio.FIRST_COMPLETED
            )
            if self._http is None:
                await super().handshake(*args, **kwargs)
                return
            # The exchange owns the socket from here; the server's abort hits a stand-in.
            transport, self.transport = self.transport, _Detached()
            task = asyncio.ensure_future(self._serve(transport))
            app.http_tasks.add(task)
            task.add_done_callback(app.http_tasks.discard)

        async def _serve(self, transport: asyncio.Transport) -> None:
            exchange = self._http
            assert exchange is not None
            try:
                problem = await self._request(exchange)
            except (ConnectionError, TimeoutError):
                transport.abort()
                return
            if problem is not None:
                status, body = problem[0], {"success": False, "error": problem[1]}
            elif exchange.path.split("?")[0] != "/api/chat":
                status, body = HTTPStatus.NOT_FOUND, {"success": False, "error": "not found"}
            else:
                status, body = await self._chat(exchange)
            transport.write(response_bytes(status, body))
            transport.close()  # close() flushes the buffered response first

        async def _chat(self, exchange: HttpExchange) -> tuple[HTTPStatus, dict[str, Any]]:
            """The API key check (401), the key's session limit (429, as on the WebSocket
            endpoints: the turn holds one of its sessions while it runs), then the turn."""
            if app.draining:
                return HTTPStatus.SERVICE_UNAVAILABLE, {
                    "success": False,
                    "error": "the server is draining",
                }
            digest = key_digest(app.config, exchange.headers.get("Authorization", ""))
            if digest is None:
                return HTTPStatus.UNAUTHORIZED, {
                    "success": False,
                    "error": "missing or invalid API key",
                }
            if digest and not app.key_sessions.take(digest):
                limit = app.key_sessions.limit(digest)
                return HTTPStatus.TOO_MANY_REQUESTS, {
                    "success": False,
                    "error": "too_many_sessions",
                    "message": f"this API key already holds {limit} open sessions, its "
                    "limit: close one and retry",
                }
            try:
                return await api_chat(app, exchange.buffer[: exchange.length])
            finally:
                if digest:
                    app.key_sessions.give_back(digest)

        async def _request(self, exchange: HttpExchange) -> tuple[HTTPStatus, str] | None:
            """Wait for the whole request: the head within the open timeout, like a
            WebSocket handshake (a trickled head is dropped), the body within 6 times it.
            Raises TimeoutError (head) or ConnectionError."""
            limit = app.config.open_timeout_s
            try:
                return await asyncio.wait_for(asyncio.shield(exchange.ready), limit)
            except TimeoutError:
                if not exchange.head_done:
                    log.info("HTTP request head not received within %.1fs: dropped", limit)
                    exchange.ready.cancel()  # nothing waits on it any more
                    raise
            try:
                return await asyncio.wait_for(asyncio.shield(exchange.ready), 5 * limit)
            except TimeoutError:
                exchange.ready.cancel()
                return HTTPStatus.REQUEST_TIMEOUT, "request body not received in time"

    return EdgeConnection
