"""The chat surfaces over WebSocket: /v1/realtime?mode=chat and the legacy /ws/chat.

Both validate with edge.chat.parse_chat and run each turn with edge.chat.run_turn, which
holds a worker slot only while the turn is generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from edge import events as ev
from edge import protocol
from edge.chat import ChatResult, parse_chat, run_turn, wav_base64
from edge.errors import (
    EdgeError,
    InvalidEvent,
    InvalidPayload,
    MissingField,
    NotReady,
    UnknownEvent,
    error_event,
)
from edge.pcm import encode_pcm
from edge.session import new_session_id

log = logging.getLogger("omnifabric.edge.chat")


def _metrics(result: ChatResult) -> dict[str, Any]:
    metrics: dict[str, Any] = {k: round(v, 2) for k, v in result.timings_ms.items()}
    metrics["input_tokens"] = result.input_tokens
    metrics["generated_tokens"] = result.generated_tokens
    if result.ignored:
        metrics["ignored"] = list(result.ignored)
    return metrics


class ChatConnection:
    """/v1/realtime?mode=chat: session.init (payload may be empty), then one turn per
    input.append; history is the client's (each append carries all messages)."""

    def __init__(self, app, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.session_id = new_session_id()
        self.created = False
        self.turn: asyncio.Task | None = None
        self.usage = ev.Usage()
        self.turns = 0

    async def send(self, event: dict[str, Any]) -> None:
        try:
            await self.ws.send(json.dumps(event, separators=(",", ":")))
        except ConnectionClosed:
            pass

    async def run(self) -> None:
        # No slot is held between turns, so nothing to wait for: queue_done at once.
        await self.send(protocol.queue_done_json())
        try:
            async for message in self.ws:
                if isinstance(message, bytes):
                    await self.send(
                        error_event(InvalidPayload("binary frames are not part of the protocol"))
                    )
                    continue
                try:
                    event = protocol.parse_frame(message)
                    if await self._handle(event):
                        return
                except protocol.InvalidJson:
                    await self.ws.close(1003, "invalid JSON")
                    return
                except EdgeError as err:
                    await self.send(error_event(err))
                    if err.close_code is not None:
                        await self.ws.close(err.close_code, err.code)
                        return
        except ConnectionClosed:
            pass
        finally:
            if self.turn is not None:
                self.turn.cancel()

    async def _handle(self, event: dict[str, Any]) -> bool:
        """Handle one event; True when the session is over."""
        kind = event["type"]
        if kind == "session.init":
            payload = event.get("payload", {})
            if not isinstance(payload, dict):
                raise InvalidPayload("'payload' must be an object")
            if self.created:
                raise InvalidEvent("the session is already initialized")
            self.created = True
            await self.send(
                {
                    "type": "session.created",
                    "session_id": self.session_id,
                    "mode": "turn_based",
                    "metrics": {},
                }
            )
        elif kind == "input.append":
            if not self.created:
                raise NotReady("send session.init first")
            if self.turn is not None and not self.turn.done():
                raise InvalidEvent("a turn is still being generated: wait for response.done")
            body = event.get("input")
            if body is None:
                raise MissingField("'input' is required")
            if not isinstance(body, dict):
                raise InvalidPayload("'input' must be an object")
            # Off the loop: base64, audio resampling and video decoding take milliseconds to
            # seconds, and other sessions share this loop.
            chat = await asyncio.to_thread(parse_chat, body)
            self.turns += 1
            self.turn = asyncio.create_task(self._turn(chat, self.turns))
        elif kind == "session.close":
            if self.turn is not None:
                self.turn.cancel()
            reason = event.get("reason") if isinstance(event.get("reason"), str) else "user_stop"
            await self.send(
                {
                    "type": "session.closed",
                    "session_id": self.session_id,
                    "reason": reason,
                    "usage": protocol.usage_json(self.usage),
                }
            )
            await self.ws.close(1000, reason)
            return True
        else:
            raise UnknownEvent(f"unknown event type {kind[:64]!r}")
        return False

    async def _turn(self, chat, number: int) -> None:
        response_id = f"resp_{self.session_id}_{number}"
        base = {
            "type": "response.output.delta",
            "session_id": self.session_id,
            "response_id": response_id,
            "input_id": f"input_{number}",
        }

        waited = []

        async def queued(q: ev.Queued) -> None:
            waited.append(q)
            await self.send(protocol.queued_json(q))

        async def leased() -> None:
            if waited:  # the turn had to wait: tell the client it is over
                await self.send(protocol.queue_done_json())

        async def prefilled(_: int) -> None:
            return None

        async def delta(text: str, pcm: bytes) -> None:
            if not chat.streaming:
                return
            if text:
                await self.send({**base, "kind": "text", "text": text, "metrics": {}})
            if pcm:
                await self.send(
                    {
                        **base,
                        "kind": "audio",
                        "audio": encode_pcm(pcm),
                        "metrics": {},
                        "usage": protocol.usage_json(self.usage),
                    }
                )

        try:
            result = await run_turn(
                self.app.fabric, chat, self.session_id, queued, prefilled, delta, leased
            )
        except EdgeError as err:
            await self.send(error_event(err))
            if err.close_code is not None:
                await self.ws.close(err.close_code, err.code)
            return
        self.usage = _add(self.usage, result.usage)
        if not chat.streaming:
            await self.send({**base, "kind": "text", "text": result.text, "metrics": {}})
            audio = b"".join(result.audio)
            if audio:
                await self.send(
                    {
                        **base,
                        "kind": "audio",
                        "audio": encode_pcm(audio),
                        "metrics": {},
                        "usage": protocol.usage_json(self.usage),
                    }
                )
        await self.send(
            {
                "type": "response.done",
                "session_id": self.session_id,
                "response_id": response_id,
                "text": result.text,
                "reason": result.reason,
                "usage": protocol.usage_json(self.usage),
                "metrics": _metrics(result),
            }
        )


def _add(a: ev.Usage, b: ev.Usage) -> ev.Usage:
    """Cumulative session usage."""
    return ev.Usage(**{k: getattr(a, k) + getattr(b, k) for k in a.__dataclass_fields__})


class LegacyChatConnection:
    """/ws/chat: one request message, prefill_done, chunk..., done, then the server closes;
    any error is `error{error}` and a close."""

    def __init__(self, app, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.session_id = f"chat_{new_session_id().removeprefix('rt_')}"

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event, separators=(",", ":")))

    async def run(self) -> None:
        try:
            message = await asyncio.wait_for(self.ws.recv(), self.app.config.open_timeout_s * 6)
            if isinstance(message, bytes):
                raise InvalidPayload("the request must be a JSON text message")
            try:
                body = protocol.parse_object(message)
            except protocol.InvalidJson:
                raise InvalidPayload("the request is not valid JSON") from None
            chat = await asyncio.to_thread(parse_chat, body)

            async def queued(q: ev.Queued) -> None:
                event = protocol.queued_json(q)
                event["type"] = event["type"].removeprefix("session.")
                await self.send(event)

            async def leased() -> None:
                await self.send({"type": "queue_done"})

            async def prefilled(tokens: int) -> None:
                await self.send({"type": "prefill_done", "input_tokens": tokens})

            async def delta(text: str, pcm: bytes) -> None:
                if chat.streaming:
                    await self.send(
                        {
                            "type": "chunk",
                            "text_delta": text,
                            "audio_data": encode_pcm(pcm) if pcm else None,
                        }
                    )

            result = await run_turn(
                self.app.fabric, chat, self.session_id, queued, prefilled, delta, leased
            )
            audio = result.audio if not chat.streaming else result.audio[-1:]
            await self.send(
                {
                    "type": "done",
                    "text": result.text,
                    "generated_tokens": result.generated_tokens,
                    "input_tokens": result.input_tokens,
                    "audio_data": encode_pcm(b"".join(audio)) if any(audio) else None,
                    "recording_session_id": None,
                    "metrics": _metrics(result),
                }
            )
            await self.ws.close(1000, "done")
        except EdgeError as err:
            await self._error(err.message)
        except TimeoutError:
            await self._error("no request received")
        except ConnectionClosed:
            pass

    async def _error(self, text: str) -> None:
        try:
            await self.send({"type": "error", "error": text})
            await self.ws.close(1000, "error")
        except ConnectionClosed:
            pass


__all__ = ["ChatConnection", "LegacyChatConnection", "wav_base64"]
