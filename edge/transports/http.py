"""HTTP/1.1 requests with a body on the WebSocket port: `POST /api/chat`, and the API's
POST/PUT/DELETE routes (edge/api.py).

Every connection on the edge's port starts in `FrontProtocol`, which reads the first
bytes up to the request's method: a `POST`, `PUT` or `DELETE` is served here
(`HttpRequestReader` reads one request, answered once with `Connection: close`); another
method than those and `GET`/`HEAD` is answered 405, a GET with a body 400; anything else is
handed to the WebSocket server (edge.transports.websocket) with the bytes read so far (a
GET that is no upgrade without what follows its head; a `HEAD` as that GET, its answer's
body left out: `HeadOnly`). The request is read in full
before it is served, within limits: its head within the open timeout and 16 KiB (431), a
Content-Length (411, no chunked bodies) of at most the frame limit (413), the body within
6 times the open timeout (408). The head is parsed strictly (`parse_head`, fuzzed in
tests/fuzz/test_http_fuzz.py): a malformed request line or header line, a Content-Length
that is not plain decimal digits, two of a header read as one value (Content-Length,
Transfer-Encoding, Authorization, Content-Type, Host), or a Content-Length beside a
Transfer-Encoding is answered 400, never raised. A client may half-close its side once
the body is sent (as curl and many HTTP clients can): the answer still goes out. A client
that goes away cancels its turn. With API keys configured a request needs a valid key
(401) and holds one of the key's sessions while its turn runs (429 at the key's limit, as
the WebSocket endpoints answer before the upgrade).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tempfile
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any, BinaryIO, cast
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import Headers

from omnifabric.edge import api, dialects, sessions_api
from omnifabric.edge.access import key_digest, peer_host
from omnifabric.edge.connection import ChatConnection, EdgeContext
from omnifabric.edge.dialects.base import ChatDialect
from omnifabric.edge.dialects.http_chat import HttpResponse, failure, use_post
from omnifabric.edge.errors import EdgeError

log = logging.getLogger("omnifabric.edge.http")

MAX_HEAD_BYTES = 16 * 1024
#: Time an upload's body may take once its head is read, s (200 MB at ~0.35 MB/s).
UPLOAD_BODY_S = 600.0
#: The error code of a request refused while it is read, by status.
_REFUSALS = {
    HTTPStatus.UNAUTHORIZED: "unauthorized",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "too_large",
}
#: Requests this reader serves (with a body, or DELETE); anything else goes to the WebSocket
#: server (GET: upgrades, pages, health, the GET API).
HTTP_METHODS = (b"POST ", b"PUT ", b"DELETE ")
#: What the WebSocket server takes (it answers every method as GET, so no other goes there).
WEBSOCKET_METHODS = (b"GET ", b"HEAD ")


#: What a reader does with a request's body, decided once its head is read: None keeps it
#: in memory (within the frame limit), an int spools it to a temporary file within that
#: many bytes (uploads), a (status, text) refuses the request before its body is read.
BodyPlan = int | tuple[HTTPStatus, str] | None


class Malformed(Exception):
    """A request head the reader refuses: the status and the sentence it answers with."""

    def __init__(self, status: HTTPStatus, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


#: The request line: one of the methods served here, a path (origin-form) of visible ASCII,
#: HTTP/1.x, single spaces between (RFC 9112 3).
_REQUEST_LINE = re.compile(rb"(POST|PUT|DELETE) (/[\x21-\x7e]*) HTTP/1\.[01]")
#: A header's name: a token (RFC 9110 5.1), with no space before its colon.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A request line's method: a token and a space (RFC 9112 3), read once a space or a line's
#: end came, or more bytes than a method of ``_METHOD_MAX`` characters.
_METHOD = re.compile(b"(" + _TOKEN.pattern + b") ")
_METHOD_END = re.compile(rb"[ \r\n]")
_METHOD_MAX = 32
#: What a header's value may not hold: control characters other than tab (RFC 9110 5.5).
_VALUE_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: Headers read as one value: a second copy is refused rather than guessed between (two
#: Content-Lengths are the classic request-smuggling confusion).
_SINGLE = frozenset(
    {"content-length", "transfer-encoding", "authorization", "content-type", "host"}
)
#: Content-Length digits past which no body limit can be met (10**18 bytes).
_MAX_LENGTH_DIGITS = 18


def parse_head(head: bytes) -> tuple[str, str, Headers, int]:
    """(method, target, headers, body length) of a request head (without its blank line),
    or Malformed: 400 for a bad request line, header line or Content-Length, or a header
    that must be single given twice; 411 for a body of chunks or of unstated length (a
    DELETE may come without one: 0); 413 for a length no limit allows."""
    lines = head.split(b"\r\n")
    line = _REQUEST_LINE.fullmatch(lines[0])
    if line is None or not _splits(line.group(2).decode("ascii")):
        raise Malformed(HTTPStatus.BAD_REQUEST, "malformed request line")
    headers = Headers()
    for raw in lines[1:]:
        name_bytes, colon, value_bytes = raw.partition(b":")
        if not colon or not _TOKEN.fullmatch(name_bytes) or _VALUE_CONTROL.search(value_bytes):
            raise Malformed(HTTPStatus.BAD_REQUEST, "malformed header line")
        name, value = name_bytes.decode("ascii"), value_bytes.strip(b" \t").decode("latin-1")
        if name.lower() in _SINGLE and name in headers:
            raise Malformed(HTTPStatus.BAD_REQUEST, f"more than one {name} header")
        headers[name] = value
    method = line.group(1).decode("ascii")
    return method, line.group(2).decode("ascii"), headers, _body_length(method, headers)


def _splits(target: str) -> bool:
    """Whether the target is a URL urllib can take apart ("//[x" is not: the routes split
    every target)."""
    try:
        urlsplit(target)
    except ValueError:
        return False
    return True


def _body_length(method: str, headers: Headers) -> int:
    """The Content-Length of a parsed head (see parse_head for what is refused)."""
    length = headers.get("Content-Length")
    if "Transfer-Encoding" in headers:
        if length is not None:
            raise Malformed(HTTPStatus.BAD_REQUEST, "both Content-Length and Transfer-Encoding")
        raise Malformed(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length, not chunks")
    if length is None:
        if method == "DELETE":
            return 0
        raise Malformed(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
    if not length or not length.isascii() or not length.isdigit():
        raise Malformed(HTTPStatus.BAD_REQUEST, "Content-Length must be a decimal number")
    if len(length) > _MAX_LENGTH_DIGITS:
        raise Malformed(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
    return int(length)


class HttpRequestReader:
    """One HTTP/1.1 request read from raw bytes (no I/O: fed by the connection)."""

    def __init__(
        self, max_body: int, plan: Callable[[str, str, Headers], BodyPlan] | None = None
    ) -> None:
        self.max_body = max_body
        self.plan = plan
        self.buffer = bytearray()
        self.head_done = False
        self.method = self.target = ""
        self.headers = Headers()
        self.length = 0
        self.spool: BinaryIO | None = None
        """The body's file when it is spooled (an upload), else None."""
        self._spooled = 0
        self.ready = asyncio.get_running_loop().create_future()
        """None once the request is complete, or (status, text) for one that cannot be."""

    @property
    def body(self) -> bytes:
        return bytes(self.buffer[: self.length])

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()

    def feed(self, data: bytes) -> None:
        if self.ready.done():
            return
        if self.spool is not None:
            self._to_spool(data)
            return
        self.buffer += data
        if not self.head_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0 or end > MAX_HEAD_BYTES:
                if end > MAX_HEAD_BYTES or len(self.buffer) > MAX_HEAD_BYTES:
                    self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "head too large")
                return
            head, self.buffer = bytes(self.buffer[:end]), self.buffer[end + 4 :]
            self.head_done = True
            if not self._take_head(head):
                return
        if len(self.buffer) >= self.length:
            self.ready.set_result(None)

    def _take_head(self, head: bytes) -> bool:
        """Parse the head and plan the body: False when the request is refused (or its body
        goes to a spool file, which completes the request by itself)."""
        try:
            self.method, self.target, self.headers, self.length = parse_head(head)
        except Malformed as bad:
            self._refuse(bad.status, bad.text)
            return False
        plan = None if self.plan is None else self.plan(self.method, self.target, self.headers)
        if isinstance(plan, tuple):
            self._refuse(*plan)
            return False
        limit = self.max_body if plan is None else plan
        if self.length > limit:
            self._refuse(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body too large: at most {limit} bytes"
            )
            return False
        if plan is not None:
            self.spool = tempfile.TemporaryFile()
            data, self.buffer = bytes(self.buffer), bytearray()
            self._to_spool(data)
            return False
        return True

    def _to_spool(self, data: bytes) -> None:
        assert self.spool is not None
        data = data[: self.length - self._spooled]
        self.spool.write(data)
        self._spooled += len(data)
        if self._spooled >= self.length:
            self.spool.flush()
            self.ready.set_result(None)

    def eof(self) -> None:
        """The client half-closed its side: the request is whatever came before."""
        if not self.ready.done():
            what = "request body" if self.head_done else "request head"
            self._refuse(HTTPStatus.BAD_REQUEST, f"the client ended the {what} early")

    def lost(self) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("client went away"))

    def _refuse(self, status: HTTPStatus, text: str) -> None:
        self.ready.set_result((status, text))


def response_bytes(response: HttpResponse) -> bytes:
    data = json.dumps(response.body, separators=(",", ":")).encode()
    status = response.status
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + data


class HttpTransport:
    """One read request as a chat driver's transport: its body is the one message, the
    first response sent is the answer, and the end of input is the connection's loss
    (a half-close is not: the client still reads)."""

    input_end_closes = False

    def __init__(self, path: str, body: bytes, raw: asyncio.Transport, gone: asyncio.Future):
        self.path = path
        self._body: bytes | None = body
        self._raw = raw
        self._gone = gone
        self.answered = False
        self.owner = ""
        """The API key digest whose session the request is ("" without keys)."""
        self.dropped = False
        """A request holds no session to keep for a resume."""

    def bind(
        self, on_overflow: Callable[[], None], render_error: Callable[[EdgeError], Any]
    ) -> None:
        """One response, written at once: nothing waits to overflow."""

    async def receive(self) -> bytes | None:
        if self._body is not None:
            body, self._body = self._body, None
            return body
        await asyncio.shield(self._gone)
        return None

    def send(self, message: HttpResponse) -> None:
        self.answer(message)

    def send_all(self, messages: list[HttpResponse]) -> None:
        for message in messages:
            self.answer(message)

    def answer(self, response: HttpResponse) -> None:
        if self.answered:
            return
        self.answered = True
        self._raw.write(response_bytes(response))

    def close(self, code: int, reason: str) -> None:
        self._raw.close()  # close() flushes the buffered response first

    async def finish(self) -> None:
        if not self.answered:
            self.answer(failure(HTTPStatus.INTERNAL_SERVER_ERROR, "internal_error", "no answer"))
        self._raw.close()


#: A head's Upgrade header asking for a WebSocket (RFC 6455 4.1).
_UPGRADE = re.compile(rb"(?im)^upgrade:[ \t]*websocket[ \t]*\r?$")


#: A head's headers that announce a body (websockets drops a GET with one unanswered).
_BODY = re.compile(rb"(?im)^(content-length:[ \t]*0*[1-9]|transfer-encoding:)")


def _whole_head(first: bytes) -> bytes:
    """The request head in a connection's first bytes, when they hold all of it."""
    end = first.find(b"\r\n\r\n")
    return b"" if end < 0 else first[:end]


def _head_of_plain_get(first: bytes) -> bytes:
    """What the WebSocket server gets of a connection's first bytes: a GET that is no
    upgrade (a page, status, the API) loses what follows its head (a pipelined request, a
    stray line end), which websockets would read as frames and drop the connection
    unanswered; the answer closes the connection anyway."""
    head = _whole_head(first)
    if not head or len(first) == len(head) + 4 or _UPGRADE.search(head):
        return first
    return first[: len(head) + 4]


class HeadOnly:
    """The transport of a `HEAD` request that the WebSocket server answers as a GET: what is
    written goes out up to the end of the response's head (its Content-Length is the
    GET's, as HEAD's answer has it), the body is dropped. Everything else is the
    transport's."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            return
        self._head += bytes(data)
        end = self._head.find(b"\r\n\r\n")
        if end >= 0:
            self._done = True
            self._transport.write(self._head[: end + 4])

    def writelines(self, lines: Iterable[bytes | bytearray | memoryview]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class FrontProtocol(asyncio.Protocol):
    """Every TCP connection on the edge's port starts here: the first bytes tell an HTTP
    request with a body (`POST`, served here) from a WebSocket upgrade, which goes to
    `open_websocket` with the bytes read so far (and the transport, from then on).
    Bytes that say neither within the open timeout drop the connection."""

    def __init__(
        self, app: EdgeContext, open_websocket: Callable[[asyncio.Transport, bytes], None]
    ) -> None:
        self.app = app
        self.open_websocket = open_websocket
        self.transport: asyncio.Transport | None = None
        self._sniffed = b""
        self._http: HttpRequestReader | None = None
        self._handed_over = False
        self._timer: asyncio.TimerHandle | None = None
        self._gone = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's or uvloop's (no subclass of asyncio.Transport, so
        # the type is asserted, not checked).
        self.transport = cast(asyncio.Transport, transport)
        limit = self.app.config.open_timeout_s
        self._timer = asyncio.get_running_loop().call_later(limit, self._undecided)

    def _undecided(self) -> None:
        if not self._handed_over and self._http is None and self.transport is not None:
            log.info("no request within %.1fs: connection dropped", self.app.config.open_timeout_s)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._http is not None:
            self._http.feed(data)
            return
        self._sniffed += data
        if len(self._sniffed) <= _METHOD_MAX and not _METHOD_END.search(self._sniffed):
            return  # the method is not whole yet
        if self._timer is not None:
            self._timer.cancel()
        first, self._sniffed = self._sniffed, b""
        assert self.transport is not None
        method = _METHOD.match(first)
        if method is not None and not first.startswith(HTTP_METHODS + WEBSOCKET_METHODS):
            self._not_served(method.group(1).decode("ascii"))
            return
        if not first.startswith(HTTP_METHODS):
            head = _whole_head(first)
            if _BODY.search(head):
                self._refuse(HTTPStatus.BAD_REQUEST, "invalid_request", "a GET takes no body")
                return
            transport: asyncio.Transport = self.transport
            if first.startswith(b"HEAD "):
                if _UPGRADE.search(head):
                    self._not_served("HEAD with a WebSocket upgrade (an upgrade is a GET)")
                    return
                # websockets answers every request as a GET: it gets one, and the answer's
                # body stops here.
                first, transport = b"GET " + first[5:], cast(asyncio.Transport, HeadOnly(transport))
            self._handed_over = True
            self.open_websocket(transport, _head_of_plain_get(first))
            return
        self._http = HttpRequestReader(self.app.config.max_frame_bytes, self._plan)
        self._http.feed(first)
        task = asyncio.ensure_future(self._serve(self._http, self.transport))
        self.app.http_tasks.add(task)
        task.add_done_callback(self.app.http_tasks.discard)

    def _not_served(self, method: str) -> None:
        """405 for a method no route takes (PATCH, OPTIONS, TRACE, ...): the WebSocket
        server would have answered it as a GET."""
        text = f"{method} is not served: GET (pages, status, the API) and POST, PUT, DELETE"
        self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "method", text)

    def _refuse(self, status: HTTPStatus, code: str, text: str) -> None:
        """Answer a request this front does not pass on, and close."""
        assert self.transport is not None
        self.transport.write(response_bytes(failure(status, code, text)))
        self.transport.close()

    def _plan(self, method: str, target: str, headers: Headers) -> BodyPlan:
        """Uploads (POST /api/sessions/{id}/upload-recording) are spooled to a file, once
        their key is checked; other bodies stay in memory."""
        if method != "POST" or self.app.recordings.upload_target(urlsplit(target).path) is None:
            return None
        if key_digest(self.app.config, headers.get("Authorization", "")) is None:
            return HTTPStatus.UNAUTHORIZED, "missing or invalid API key"
        return sessions_api.UPLOAD_MAX_BYTES + sessions_api.UPLOAD_FRAMING_BYTES

    def eof_received(self) -> bool | None:
        if self._http is not None:
            self._http.eof()
            return True  # keep the socket open for the answer
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._http is not None:
            self._http.lost()
        if not self._gone.done():
            self._gone.set_result(None)

    async def _serve(self, reader: HttpRequestReader, raw: asyncio.Transport) -> None:
        try:
            problem = await self._request(reader)
        except (ConnectionError, TimeoutError):
            reader.close()
            raw.abort()
            return
        path = urlsplit(reader.target).path
        found = dialects.find(dialects.HTTP, path)
        transport = HttpTransport(path, reader.body, raw, self._gone)
        authorization = reader.headers.get("Authorization", "")
        if problem is not None:
            code = _REFUSALS.get(problem[0], "invalid_request")
            transport.answer(failure(problem[0], code, problem[1]))
        elif reader.spool is not None:
            sid = self.app.recordings.upload_target(path)
            assert sid is not None  # spooled only for an upload
            content_type = reader.headers.get("Content-Type", "")
            try:
                upload = await asyncio.to_thread(
                    self.app.recordings.upload, sid, content_type, reader.spool
                )
            finally:
                reader.close()
            transport.answer(HttpResponse(upload.status, upload.body))
        elif found is None:
            peer = peer_host(raw.get_extra_info("peername"))
            answer = await api.handle(
                self.app, reader.method, path, reader.body, authorization, peer
            )
            if answer is None:
                answer = failure(HTTPStatus.NOT_FOUND, "not_found", f"no {path}")
            transport.answer(HttpResponse(answer.status, answer.body))  # JSON: not a GET
        elif reader.method != "POST":
            transport.answer(use_post())
        else:
            route, rest = found
            query = parse_qs(urlsplit(reader.target).query)
            await self._chat(transport, reader, route.open(rest, query, ""))
        await transport.finish()

    async def _chat(
        self, transport: HttpTransport, reader: HttpRequestReader, dialect: ChatDialect
    ) -> None:
        """The drain (503), the API key check (401), the key's session limit (429, as on the
        WebSocket endpoints: the turn holds one of its sessions while it runs), the turn."""
        app = self.app
        if app.draining:
            transport.answer(
                failure(HTTPStatus.SERVICE_UNAVAILABLE, "draining", "the server is draining")
            )
            return
        digest = key_digest(app.config, reader.headers.get("Authorization", ""))
        if digest is None:
            transport.answer(
                failure(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or invalid API key")
            )
            return
        if digest and not app.key_sessions.take(digest):
            limit = app.key_sessions.limit(digest)
            transport.answer(
                failure(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    "too_many_sessions",
                    f"this API key already holds {limit} open sessions, its limit: "
                    "close one and retry",
                )
            )
            return
        transport.owner = digest  # the key whose session the turn is, also fabric-wide
        try:
            await ChatConnection(app, transport, dialect).run()
        finally:
            if digest:
                app.key_sessions.give_back(digest)

    async def _request(self, reader: HttpRequestReader) -> tuple[HTTPStatus, str] | None:
        """Wait for the whole request: the head within the open timeout, like a WebSocket
        handshake (a trickled head is dropped), the body within 6 times it. Raises
        TimeoutError (head) or ConnectionError."""
        limit = self.app.config.open_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(reader.ready), limit)
        except TimeoutError:
            if not reader.head_done:
                log.info("HTTP request head not received within %.1fs: dropped", limit)
                reader.ready.cancel()  # nothing waits on it any more
                raise
        body_limit = UPLOAD_BODY_S if reader.spool is not None else 5 * limit
        try:
            return await asyncio.wait_for(asyncio.shield(reader.ready), body_limit)
        except TimeoutError:
            reader.ready.cancel()
            reader.close()
            return HTTPStatus.REQUEST_TIMEOUT, "request body not received in time"
