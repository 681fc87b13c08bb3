"""The edge's HTTP front on a real edge: each malformed request gets its status (400, 411,
413 or 431) with `Connection: close` and the connection closed, never a traceback or an
ERROR in the edge's log, and the edge serves the next request (issue 56: two Content-Length
headers raised out of data_received, before any API-key check; `+5` and `0_5` were taken as
lengths)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import scaled
from tests.e2e.wsclient import post_json
from tests.stack import Stack

BODY = json.dumps({"messages": [{"role": "user", "content": "still here"}]}).encode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "1", "--compute-ms", "5")
        s.start_edge()
        yield s
    finally:
        s.stop()


def head(*lines: str, line: str = "POST /api/chat HTTP/1.1") -> bytes:
    return ("\r\n".join([line, "Host: x", *lines]) + "\r\n\r\n").encode("latin-1")


#: (case, request bytes, status). The body follows each head, as a client would send it.
CASES = [
    ("two Content-Lengths", head("Content-Length: 5", "Content-Length: 5") + b"hello", 400),
    ("two differing Content-Lengths", head("Content-Length: 5", "Content-Length: 2") + b"hi", 400),
    ("signed Content-Length", head("Content-Length: +5") + b"hello", 400),
    ("negative Content-Length", head("Content-Length: -1"), 400),
    ("Content-Length with underscore", head("Content-Length: 0_5") + b"hello", 400),
    ("Content-Length not a number", head("Content-Length: five") + b"hello", 400),
    ("Content-Length of 5000 digits", head("Content-Length: " + "9" * 5000), 413),
    ("Content-Length past the limit", head("Content-Length: 999999999999"), 413),
    ("no Content-Length", head("Content-Type: application/json"), 411),
    ("chunked body", head("Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n\r\n", 411),
    ("bad chunking", head("Transfer-Encoding: chunked") + b"zz\r\nhello\r\n", 411),
    (
        "chunked and a Content-Length",
        head("Transfer-Encoding: chunked", "Content-Length: 5") + b"0\r\n\r\n",
        400,
    ),
    ("oversized head", head("X-Big: " + "a" * 20_000, "Content-Length: 0"), 431),
    ("head never ending, past 16 KiB", b"POST /api/chat HTTP/1.1\r\nX: " + b"a" * 17_000, 431),
    ("request line without a version", head("Content-Length: 0", line="POST /api/chat"), 400),
    ("request line with two spaces", head("Content-Length: 0", line="POST  /x HTTP/1.1"), 400),
    ("request line of HTTP/2.0", head("Content-Length: 0", line="POST /x HTTP/2.0"), 400),
    ("target not a path", head("Content-Length: 0", line="POST api/chat HTTP/1.1"), 400),
    ("target no URL", head("Content-Length: 0", line="POST //[x HTTP/1.1"), 400),
    ("header line without a colon", head("Content-Length: 0", "no colon here"), 400),
    ("space before a header's colon", head("Content-Length : 0"), 400),
    ("control character in a value", head("Content-Length: 0", "X-A: a\x01b"), 400),
    ("continuation line", head("Content-Length: 0", "X-A: a", " folded"), 400),
    ("two Authorization headers", head("Authorization: a", "Authorization: b"), 400),
    # Methods no route takes: the WebSocket server answered each as a GET (200 and the page).
    ("PATCH on a GET route", head(line="PATCH /status HTTP/1.1"), 405),
    ("OPTIONS", head("Origin: http://x", line="OPTIONS /api/chat HTTP/1.1"), 405),
    ("TRACE", head(line="TRACE / HTTP/1.1"), 405),
    ("an unknown method", head(line="FOO /healthz HTTP/1.1"), 405),
]


async def exchange(stack: Stack, data: bytes, split_at: int = 0) -> tuple[int, bytes, bytes]:
    """Send `data` (in two writes apart, split at `split_at`, when given), read until the
    edge closes: (status, head, what came after the answer body; b"" when the connection
    was closed right after it)."""
    host, port = stack.url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if split_at:
            writer.write(data[:split_at])
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(data[split_at:])
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), scaled(10))  # to EOF: the edge closed
    finally:
        writer.close()
    response_head, _, body = raw.partition(b"\r\n\r\n")
    status = int(response_head.split(b" ", 2)[1])
    length = int(response_head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return status, response_head, body[length:]


@pytest.mark.parametrize("case, data, status", CASES, ids=[c[0] for c in CASES])
async def test_a_malformed_request_gets_its_status_and_the_edge_serves_on(
    stack, case, data, status
):
    got, response_head, after = await exchange(stack, data)
    assert got == status, response_head
    assert b"Connection: close" in response_head and after == b""
    answer = await asyncio.to_thread(post_json, f"{base(stack)}/api/nope", b"{}")
    assert answer[0] == 404  # the next request is read and routed as ever


def test_the_edge_answered_them_all_without_an_error_and_still_chats(stack):
    status, answer = post_json(f"{base(stack)}/api/chat", BODY)
    assert status == 200 and answer["text"] == "You said: still here"
    assert stack.edge is not None
    log = stack.edge.log_path.read_text()
    assert "Traceback" not in log and '"ERROR"' not in log and " ERROR " not in log, log[-3000:]


def base(stack: Stack) -> str:
    return stack.url.replace("ws://", "http://").replace("/v1/realtime", "")


def test_a_get_of_the_chat_route_is_told_to_post(stack):
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base(stack)}/api/chat", timeout=scaled(10))
    assert refused.value.code == 405
    assert json.loads(refused.value.read()) == {
        "success": False,
        "error": "method",
        "message": "use POST",
    }


@pytest.mark.parametrize(
    "data, status",
    [
        (head(line="OPTIONS /status HTTP/1.1"), 405),
        (head("Content-Length: 2", line="DELETE /api/nope HTTP/1.1") + b"{}", 404),
    ],
)
async def test_a_method_that_arrives_in_pieces_is_read_whole(stack, data, status):
    # The first 7 bytes ("OPTIONS", "DELETE ") decided where a request went.
    got, _, _ = await exchange(stack, data, split_at=3)
    assert got == status
    got, _, _ = await exchange(stack, data, split_at=7)
    assert got == status


@pytest.mark.parametrize(
    "data, answer",
    [
        (head(line="GET /healthz HTTP/1.1") + b"\r\n", b"200 OK"),
        (head(line="GET /healthz HTTP/1.1") * 2, b"200 OK"),
        (head("Content-Length: 2", line="GET /healthz HTTP/1.1") + b"{}", b"400 Bad Request"),
    ],
    ids=["a stray line end", "a pipelined request", "a body"],
)
async def test_a_get_with_bytes_after_its_head_is_answered(stack, data, answer):
    # websockets read them as frames (or refused the body) and dropped the connection with
    # no answer at all.
    host, port = stack.url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), scaled(10))
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 " + answer + b"\r\n"), raw
    if answer == b"200 OK":
        assert raw.endswith(b'{"status":"ok"}'), raw
    else:
        assert b'"message":"a GET takes no body"' in raw, raw


@pytest.mark.parametrize("path", ["/healthz", "/status", "/"])
async def test_head_is_answered_as_its_get_without_the_body(stack, path):
    # websockets answered HEAD as a GET, body and all.
    async def ask(method: str) -> bytes:
        host, port = stack.url.split("//")[1].split("/")[0].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head(line=f"{method} {path} HTTP/1.1"))
            await writer.drain()
            return await asyncio.wait_for(reader.read(), scaled(10))  # to EOF: the edge closed
        finally:
            writer.close()

    got, answered = await ask("GET"), await ask("HEAD")
    get_head, _, body = got.partition(b"\r\n\r\n")
    assert body and answered.endswith(b"\r\n\r\n") and answered.count(b"\r\n\r\n") == 1

    def fields(response_head: bytes) -> set[bytes]:  # the status line and headers, no Date
        return {f for f in response_head.split(b"\r\n") if not f.lower().startswith(b"date:")}

    assert fields(answered[:-4]) == fields(get_head), (answered, get_head)


async def test_head_with_an_upgrade_is_refused(stack):
    got, response_head, _ = await exchange(
        stack,
        head(
            "Upgrade: websocket",
            "Connection: Upgrade",
            "Sec-WebSocket-Version: 13",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            line="HEAD /v1/realtime HTTP/1.1",
        ),  # fmt: skip
    )
    assert got == 405 and b"Connection: close" in response_head
