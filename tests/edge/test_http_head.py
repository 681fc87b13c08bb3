"""edge.transports.http.HeadOnly: a HEAD request's answer, as the WebSocket server writes
it for the GET, loses its body (tests/e2e/test_http_front.py asks a real edge)."""

from __future__ import annotations

import asyncio
from typing import cast

from omnifabric.edge.transports.http import HeadOnly


class Wire:
    def __init__(self) -> None:
        self.sent = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True


def test_the_head_goes_out_whole_however_it_is_written_and_the_body_never():
    wire = Wire()
    head_only = HeadOnly(cast("asyncio.Transport", wire))
    head_only.write(b"HTTP/1.1 200 OK\r\nContent-Le")
    assert wire.sent == b""  # not a whole head yet
    head_only.writelines([b"ngth: 4\r\n\r", b"\nbody", b"more"])
    head_only.write(b"and more")
    assert wire.sent == b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n"
    head_only.close()  # everything but writing is the transport's
    assert wire.closed
