"""A thin test client over a real WebSocket: send events, await typed events.

WsClient is the tools' (omnifabric.tools.perf.wsclient) with the tests' time factor;
the rest (raw sockets, HTTP, polling) only the tests use.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

from omnifabric.tools.client import SILENCE_UNIT
from omnifabric.tools.client import pcm_b64 as pcm_b64  # the tests' name for it, too
from omnifabric.tools.load import SPEECH_UNIT
from omnifabric.tools.perf import metrics as _metrics
from omnifabric.tools.perf import wsclient as _wsclient
from omnifabric.tools.perf.metrics import metric as metric  # the tests' name for it, too
from tests.conftest import TIME_FACTOR, scaled

SILENCE = SILENCE_UNIT
SPEECH = SPEECH_UNIT


class WsClient(_wsclient.WsClient):
    """One client connection; `events` keeps everything received, in order."""

    #: Every client opened in the running test, closed by the e2e conftest after it.
    opened: list[WsClient] = []
    time_factor = TIME_FACTOR

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> WsClient:
        client = await super().open(url, **kwargs)
        cls.opened.append(client)
        return client


def post_json(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """POST a body, return (status, decoded JSON answer); HTTP errors are answers too."""
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class RawWs:
    """A WebSocket client on a bare socket: it sends text frames and reads only when told
    to, so it can stop reading (and never answer a ping) like a stuck client."""

    def __init__(self, sock, leftover: bytes) -> None:
        self.sock = sock
        self.buffer = leftover
        self.opened_at = time.monotonic()
        """When the handshake completed (time.monotonic())."""

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        path: str,
        rcvbuf: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> RawWs:
        """TCP connect (with a small receive buffer if asked) and the opening handshake."""
        import os
        import socket

        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 4096), scaled(10))
            if not chunk:
                raise ConnectionError("closed during the handshake")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            sock.close()
            raise ConnectionError(head.decode(errors="replace").splitlines()[0])
        return cls(sock, rest)

    @staticmethod
    def frame(text: str) -> bytes:
        """One masked text frame. The mask key is zero (valid, and the payload needs no
        XOR): the server does not care which key a client picks."""
        payload = text.encode()
        n = len(payload)
        if n < 126:
            head = bytes([0x81, 0x80 | n])
        elif n < 1 << 16:
            head = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big")
        return head + b"\0\0\0\0" + payload

    async def send_raw(self, data: bytes) -> None:
        """Raises ConnectionError once the server has closed the connection."""
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send(self, event: dict[str, Any]) -> None:
        await self.send_raw(self.frame(json.dumps(event)))

    async def read_frames(self, timeout_s: float = 10.0) -> tuple[list[dict[str, Any]], int | None]:
        """Read until the server's close frame or the end of the stream: (text events,
        close code or None). Raises TimeoutError if the server keeps the socket open."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(timeout_s)
        events: list[dict[str, Any]] = []
        buf = self.buffer
        while True:
            while len(buf) >= 2:
                opcode, size, start = buf[0] & 0x0F, buf[1] & 0x7F, 2
                if size == 126:
                    size, start = int.from_bytes(buf[2:4], "big"), 4
                elif size == 127:
                    size, start = int.from_bytes(buf[2:10], "big"), 10
                if len(buf) < start + size:
                    break
                payload, buf = buf[start : start + size], buf[start + size :]
                if opcode == 0x1:
                    events.append(json.loads(payload))
                elif opcode == 0x8:
                    return events, int.from_bytes(payload[:2], "big") if payload else 1005
            try:
                chunk = await asyncio.wait_for(
                    loop.sock_recv(self.sock, 1 << 16), max(0.01, deadline - loop.time())
                )
            except (ConnectionResetError, BrokenPipeError):
                return events, None
            if not chunk:
                return events, None
            buf += chunk

    def close(self) -> None:
        self.sock.close()


async def served_unit(client: WsClient) -> dict:
    """Send one 1 s unit of silence and await its listen result."""
    await client.append(SILENCE)
    return await client.until("delta.listen")


def scrape_metrics(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET http://address/metrics: sample name -> [(labels, value)] (the timeout scaled)."""
    return _metrics.scrape_metrics(address, timeout_s=scaled(5))


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Poll an async predicate until true; returns the seconds it took. AssertionError
    after timeout_s (scaled)."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > scaled(timeout_s):
            raise AssertionError(f"condition not met within {scaled(timeout_s)} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start
