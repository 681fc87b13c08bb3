"""The units every bench path sends, and their pacing: the speech-and-silence script, its
PCM and public-protocol frames, one send a second, and the wait for the last results."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import numpy as np

from omnifabric.tools.client import pcm_b64


def unit_script(seconds: int) -> list[np.ndarray]:
    """Speech and silence (tools.load's pattern): speak replies are measured as well."""
    from omnifabric.tools.load import script

    return script(seconds)


def pcm(unit: np.ndarray) -> bytes:
    """A unit as the worker takes it: float32 little-endian samples (grpc-direct sends it)."""
    return unit.astype("<f4").tobytes()


def append_frame(unit: np.ndarray) -> str:
    """The public protocol's append event carrying one unit (what fabric and echo send)."""
    return json.dumps({"type": "input.append", "input": {"audio": pcm_b64(unit)}})


async def paced(seconds: int, send: Callable[[int], Awaitable[bool]]) -> None:
    """One send a second from now, `seconds` times, until `send` returns False."""
    start = time.monotonic()
    for k in range(seconds):
        delay = start + k - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if not await send(k):
            return


async def settle(done: Callable[[], bool], closed: asyncio.Event, timeout_s: float) -> None:
    """Until `done()` holds, `closed` is set or `timeout_s` is over (the last results)."""
    deadline = time.monotonic() + timeout_s
    while not done() and not closed.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
