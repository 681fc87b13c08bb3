"""A thin client over a real WebSocket: send events, await typed events (the soak's F1
sessions, and the end-to-end tests' client).

Every timeout is multiplied by `time_factor` (1 here; the tests set OMNI_TEST_TIME_FACTOR).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from omnifabric.tools.client import pcm_b64


class WsClient:
    """One client connection; `events` keeps everything received, in order."""

    #: Multiplies every timeout (a class default; a client may set its own).
    time_factor: float = 1.0

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> WsClient:
        kwargs.setdefault("compression", None)
        kwargs.setdefault("max_size", None)
        return cls(await connect(url, **kwargs))

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout_s: float = 10.0) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout_s * self.time_factor))
        self.events.append(event)
        return event

    async def until(self, *types: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Receive until an event whose type (or `type.kind`) is one of `types`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s * self.time_factor
        while True:
            event = await self.recv(max(0.01, deadline - loop.time()) / self.time_factor)
            key = event["type"]
            if key == "response.output.delta":
                key = f"delta.{event['kind']}"
            if event["type"] in types or key in types:
                return event

    async def start(self, dialect: str = "current", prompt: str = "hi") -> dict[str, Any]:
        await self.until("session.queue_done", timeout_s=30)
        if dialect == "first":
            await self.send({"type": "session.update", "session": {"instructions": prompt}})
        else:
            await self.send({"type": "session.init", "payload": {"system_prompt": prompt}})
        return await self.until("session.created")

    async def append(self, samples: np.ndarray, dialect: str = "current", **extra: Any) -> None:
        if dialect == "first":
            await self.send(
                {"type": "input_audio_buffer.append", "audio": pcm_b64(samples), **extra}
            )
        else:
            await self.send({"type": "input.append", "input": {"audio": pcm_b64(samples), **extra}})

    async def close(self) -> None:
        await self.ws.close()
