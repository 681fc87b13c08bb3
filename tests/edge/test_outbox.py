"""The Outbox's writes: one unit's events in one system call, framed as websockets frames
them, in order; with permessage-deflate negotiated, through websockets' own framing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import uvloop
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.frames import Frame, Opcode

from omnifabric.edge.outbox import Outbox, text_frame_header


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 131_072, 3 * 2**20])
def test_text_frame_header_is_the_one_websockets_writes(size):
    payload = b"x" * size
    expected = Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])
    assert text_frame_header(size) + payload == expected


def write_calls() -> int:
    """write/writev calls of this thread so far (other threads of the test process, such
    as gRPC pollers left by earlier tests, are not counted)."""
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/thread-self/io")


def unit_events(n: int) -> list[dict]:
    """What one speaking unit sends: text, ~130 KB of audio, the end of the turn."""
    return [
        {"type": "response.output.delta", "kind": "text", "text": f"part {n}"},
        {"type": "response.output.delta", "kind": "audio", "audio": "QUJD" * 32_000},
        {"type": "response.output.delta", "kind": "listen", "text": ""},
    ]


async def run_outbox(compression: str | None, units: int) -> tuple[list[int], list[dict]]:
    """A real websockets server whose handler sends `units` batches through an Outbox to a
    real client; returns the write calls each batch took and what the client received."""
    writes: list[int] = []
    done = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        outbox = Outbox(ws, 64, 8 * 2**20, 1.0, None, lambda err: {"error": err.code})
        for n in range(units):
            while ws.transport.get_write_buffer_size():
                await asyncio.sleep(0.005)  # as a unit a second would find it: drained
            before = write_calls()
            outbox.send_all(unit_events(n))
            writes.append(write_calls() - before)
            await asyncio.sleep(0.02)
        await outbox.finish(5.0)
        await done.wait()

    async with serve(handler, "127.0.0.1", 0, compression=compression) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(
            f"ws://127.0.0.1:{port}", compression=compression, max_size=None
        ) as client:
            got = [json.loads(await client.recv()) for _ in range(3 * units)]
            done.set()
    return writes, got


def test_a_units_events_go_out_in_one_write_in_order():
    # On uvloop, as the edge runs: its writes are write/writev calls, which the kernel
    # counts (asyncio's own loop sends with send(), which it does not).
    writes, got = uvloop.run(run_outbox(None, 5))
    assert writes == [1] * 5  # one writev per unit, not one write per event
    assert got == [event for n in range(5) for event in unit_events(n)]


async def test_with_compression_the_events_still_arrive_whole_and_in_order():
    _, got = await run_outbox("deflate", 3)
    assert got == [event for n in range(3) for event in unit_events(n)]
