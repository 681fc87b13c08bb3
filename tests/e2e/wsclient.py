"""A thin test client over a real WebSocket: send events, await typed events."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from tests.conftest import scaled


def pcm_b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<f4").tobytes()).decode()


SILENCE = np.zeros(16000, np.float32)
rng = np.random.default_rng(7)
SPEECH = (0.2 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)


class WsClient:
    """One client connection; `events` keeps everything received, in order."""

    #: Every client opened in the running test, closed by the e2e conftest after it.
    opened: list[WsClient] = []

    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> WsClient:
        kwargs.setdefault("compression", None)
        kwargs.setdefault("max_size", None)
        client = cls(await connect(url, **kwargs))
        cls.opened.append(client)
        return client

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout_s: float = 10.0) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), scaled(timeout_s)))
        self.events.append(event)
        return event

    async def until(self, *types: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Receive until an event whose type (or `type.kind`) is one of `types`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(timeout_s)
        while True:
            event = await self.recv(max(0.01, deadline - loop.time()) / scaled(1))
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
