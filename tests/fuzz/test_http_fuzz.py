"""Fuzzing the edge's HTTP request reader (edge.transports.http.HttpRequestReader, fed by
FrontProtocol.data_received with whatever the socket gives): near-valid requests (odd
Content-Lengths, duplicated and malformed headers, chunked bodies, bad request lines, long
heads), byte flips and arbitrary bytes, each cut into arbitrary pieces.

The reader never raises: a request is complete (its body as long as its Content-Length) or
refused with 400, 411, 413 or 431; a well-formed request is read exactly. OMNI_FUZZ_EXAMPLES
examples per property (tests.fuzz.EXAMPLES), derandomized, without a database.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omnifabric.edge.transports.http import MAX_HEAD_BYTES, HttpRequestReader
from tests.fuzz import EXAMPLES

#: Thousands of requests a property (~30 s): CI's long group (tests/conftest.py).
pytestmark = pytest.mark.ci_long

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_BODY = 4096
#: The statuses a malformed request may be answered with.
#: Headers the generator of well-formed requests writes itself (one of each).
SINGLE = {"content-length", "transfer-encoding", "host", "authorization", "content-type"}
REFUSALS = {
    HTTPStatus.BAD_REQUEST,
    HTTPStatus.LENGTH_REQUIRED,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
}


def read(pieces: list[bytes], eof: bool = True) -> tuple[HttpRequestReader, object]:
    """Feed `pieces` to a reader as data_received would, then (`eof`) the client's
    half-close: the reader and its outcome (None: complete, (status, text): refused,
    "pending": still waiting for bytes, only without the half-close)."""

    async def run() -> tuple[HttpRequestReader, object]:
        reader = HttpRequestReader(MAX_BODY)
        for piece in pieces:
            reader.feed(piece)
        if eof:
            reader.eof()
        return reader, reader.ready.result() if reader.ready.done() else "pending"

    return asyncio.run(run())


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """`data` in pieces at `points` (positions modulo its length)."""
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)] or [b""]


ODD_LENGTHS = st.sampled_from(
    ["+5", "-5", "0_5", "5 5", "0x5", "5.0", "1e3", "", "\u0665", "\u00b2", "5,5"]
    + ["00005", "9" * 19, "9" * 5000, str(MAX_BODY + 1)]
)
GOOD_NAMES = st.sampled_from(["Content-Type", "X-Any", "Accept", "User-Agent"])
#: Arbitrary bytes after a method: what FrontProtocol hands this reader.
JUNK = b"POST ".__add__
ODD_NAMES = st.sampled_from(
    ["Content-Length", "Transfer-Encoding", "Host", "Authorization", "Bad Name", ""]
    + ["Bad:Colon", " Leading", "Trailing ", "\x00", "content-type"]
)
VALUES = st.sampled_from(["x", "application/json", "Bearer k", "", " padded\t", "a\tb"])
ODD_VALUES = st.sampled_from(["chunked", "gzip, chunked", "a\x00b", "a\x7fb", "a\rb", "a\nb"])
LINES = st.sampled_from(["POST /api/chat HTTP/1.1", "PUT /api/x HTTP/1.0", "DELETE /x HTTP/1.1"])
ODD_LINES = st.sampled_from(
    ["POST /api/chat", "POST  /api/chat HTTP/1.1", "POST /api/chat HTTP/2.0", "POST /a b HTTP/1.1"]
    + ["POST api/chat HTTP/1.1", "POST //[x HTTP/1.1", "POST /\x01 HTTP/1.1", "POST /x HTTP/1.1 "]
)


def sometimes(draw, usual, odd, one_in: int = 4):
    """`odd` once in `one_in` draws, else `usual`."""
    return draw(odd if draw(st.integers(1, one_in)) == 1 else usual)


@st.composite
def requests(draw) -> bytes:
    """Near-valid requests: mostly well-formed, with now and then a bad request line, odd
    or duplicated headers, a Content-Length of another spelling or a second one, a
    continuation line or a head past the limit, and a body that may be short or long."""
    body = draw(st.binary(max_size=64))
    headers = [("Host", "x"), ("Content-Length", str(len(body)))]
    for _ in range(draw(st.integers(0, 3))):
        headers.append(
            (sometimes(draw, GOOD_NAMES, ODD_NAMES), sometimes(draw, VALUES, ODD_VALUES))
        )
    if draw(st.integers(1, 4)) == 1:
        headers[1] = ("Content-Length", draw(ODD_LENGTHS))
    if draw(st.integers(1, 12)) == 1:
        headers[draw(st.integers(0, 1))] = ("Transfer-Encoding", "chunked")
    if draw(st.integers(1, 8)) == 1:
        headers.append(("Content-Length", draw(st.sampled_from([str(len(body)), "0"]))))
    lines = [f"{name}: {value}" for name, value in draw(st.permutations(headers))]
    if draw(st.integers(1, 10)) == 1:
        lines.insert(draw(st.integers(0, len(lines))), " folded")
    if draw(st.integers(1, 10)) == 1:
        lines.append("X-Big: " + "a" * (MAX_HEAD_BYTES + draw(st.integers(-64, 64))))
    line = sometimes(draw, LINES, ODD_LINES)
    head = "\r\n".join([line, *lines]).encode("latin-1", "replace") + b"\r\n\r\n"
    return head + body[: draw(st.integers(0, len(body)))] + draw(st.binary(max_size=8))


@FUZZ
@given(
    data=st.one_of(requests(), requests(), requests(), st.binary(max_size=300).map(JUNK)),
    flips=st.one_of(st.just([]), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)))),
    points=st.lists(st.integers(0, 20_000), max_size=6),
    eof=st.booleans(),
)
def test_only_complete_requests_or_refusals(data, flips, points, eof):
    raw = bytearray(data)
    for at, value in flips:
        if at < len(raw):
            raw[at] = value
    reader, outcome = read(cut(bytes(raw), points), eof)
    event(str(outcome if outcome is None or outcome == "pending" else outcome[0]))
    assert eof is False or outcome != "pending"
    if outcome is None:
        assert reader.method in ("POST", "PUT", "DELETE") and reader.target.startswith("/")
        assert len(reader.body) == reader.length <= MAX_BODY
    elif outcome != "pending":
        status, text = outcome
        assert status in REFUSALS and text


@FUZZ
@given(
    method=st.sampled_from(["POST", "PUT", "DELETE"]),
    path=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30),
    extra=st.lists(
        st.tuples(
            st.text("abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12),
            st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
        ),
        max_size=5,
    ),
    body=st.binary(max_size=MAX_BODY),
    points=st.lists(st.integers(0, 20_000), max_size=6),
)
def test_well_formed_requests_are_read_exactly(method, path, extra, body, points):
    target = "/" + path.lstrip("/")  # "//[x" is no URL: refused (the cases above)
    extra = [(n, v) for n, v in extra if n.lower() not in SINGLE]
    lines = [f"{method} {target} HTTP/1.1", "Host: x", *[f"{n}: {v}" for n, v in extra]]
    lines.append(f"Content-Length: {len(body)}")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    reader, outcome = read(cut(data, points))
    assert outcome is None, outcome
    assert (reader.method, reader.target, reader.body) == (method, target, body)
    for name, value in extra:
        assert value.strip(" \t") in reader.headers.get_all(name)
