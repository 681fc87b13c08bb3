"""The chat surfaces over WebSocket: /v1/realtime?mode=chat and the legacy /ws/chat.

Both validate with edge.chat.parse_chat and run each turn with edge.chat.run_turn, which
holds a worker slot only while the turn is generated. Events go out through the
connection's bounded `Outbox` (edge.outbox), like the duplex endpoints: a turn never waits
on the client's socket, and a client that stops reading gets `slow_client` (1008) and
loses its turn (the worker slot comes back at once). On an edge drain each connection
ends in-band: `session.closed{reason:"server_shutdown"}` (mode=chat) or `error{error}`
(/ws/chat), then close 1001; a turn in progress gets the drain's confirm time to finish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from edge import events as ev
from edge import protocol
from edge.chat import ChatInput, ChatResult, parse_chat, run_turn, wav_base64
from edge.errors import (
    EdgeError,
    InvalidEvent,
    InvalidPayload,
    MissingField,
    NotReady,
    UnknownEvent,
    error_event,
    legacy_error_event,
)
from edge.outbox import Outbox
from edge.pcm import encode_pcm
from edge.session import new_session_id

if TYPE_CHECKING:
    from edge.ws import EdgeApp

log = logging.getLogger("omnifabric.edge.chat")

#: Close code after the in-band end of a drain: 1001, "going away" (RFC 6455 7.4.1).
SHUTDOWN_CLOSE = 1001
SHUTDOWN_MESSAGE = "the server is shutting down"


def _metrics(result: ChatResult) -> dict[str, Any]:
    metrics: dict[str, Any] = {k: round(v, 2) for k, v in result.timings_ms.items()}
    metrics["input_tokens"] = result.input_tokens
    metrics["generated_tokens"] = result.generated_tokens
    if result.ignored:
        metrics["ignored"] = list(result.ignored)
    return metrics


async def _settle(task: asyncio.Task | None, timeout_s: float) -> None:
    """Give a turn in progress up to timeout_s to finish, then cancel it; returns once it
    has stopped."""
    if task is None or task.done():
        return
    if timeout_s > 0:
        await asyncio.wait({task}, timeout=timeout_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class ChatConnection:
    """/v1/realtime?mode=chat: session.init (payload may be empty), then one turn per
    input.append; history is the client's (each append carries all messages)."""

    def __init__(self, app: EdgeApp, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.session_id = new_session_id()
        self.created = False
        self.turn: asyncio.Task | None = None
        self.usage = ev.Usage()
        self.turns = 0
        self.ended = False
        """A close is queued (client close, fatal error, overflow, drain): no more turns."""
        self.draining = False
        self.outbox = Outbox.sized_by(app.config, ws, self._overflowed)
        self.finished = asyncio.Event()
        """Set once the connection is over and its last frames went out (drain waits)."""

    def send(self, event: dict[str, Any]) -> None:
        """Queue one event for the client (never waits on the client's socket)."""
        self.outbox.send(event)

    def _overflowed(self) -> None:
        # The outbox already queued slow_client and close 1008. The turn would only fill
        # it again: cancel it so its worker slot comes back now.
        self.ended = True
        if self.turn is not None:
            self.turn.cancel()

    def _end(self, reason: str, code: int) -> None:
        """session.closed{reason} with the session's usage, then the close."""
        if self.ended:
            return
        self.ended = True
        self.send(
            {
                "type": "session.closed",
                "session_id": self.session_id,
                "reason": reason,
                "usage": protocol.usage_json(self.usage),
            }
        )
        self.outbox.close(code, reason)

    def _fail(self, err: EdgeError) -> None:
        """Tell the client; errors with a close code also close the connection."""
        self.send(error_event(err))
        if err.close_code is not None and not self.ended:
            self.ended = True
            self.outbox.close(err.close_code, err.code)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: a turn in progress gets up to timeout_s to finish (its response.done goes
        out), then session.closed{server_shutdown} and close 1001."""
        self.draining = True
        await _settle(self.turn, timeout_s)
        self._end(ev.SERVER_SHUTDOWN, SHUTDOWN_CLOSE)

    async def run(self) -> None:
        """Serve the client until either side ends; a turn in progress is cancelled
        (its worker slot returned) when the connection ends."""
        self.app.chats.add(self)
        try:
            # No slot is held between turns, so nothing to wait for: queue_done at once.
            self.send(protocol.queue_done_json())
            await self._read()
        finally:
            self.app.chats.discard(self)
            self.ended = True
            if self.turn is not None:
                self.turn.cancel()
                await asyncio.gather(self.turn, return_exceptions=True)
            await self.outbox.finish(_finish_timeout_s(self.app))
            self.finished.set()

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if self.ended:
                    break
                if isinstance(message, bytes):
                    self._fail(InvalidPayload("binary frames are not part of the protocol"))
                    continue
                try:
                    event = protocol.parse_frame(message)
                    if await self._handle(event):
                        return
                except protocol.InvalidJson:
                    self.ended = True
                    self.outbox.close(1003, "invalid JSON")
                    return
                except EdgeError as err:
                    self._fail(err)
                    if err.close_code is not None:
                        return
        except ConnectionClosed:
            pass

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
            self.send(
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
            if self.draining:
                raise InvalidEvent(f"{SHUTDOWN_MESSAGE}: no new turns")
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
            # The session may have ended, or the drain begun, while it was decoded.
            if self.ended:
                return True
            if self.draining:
                raise InvalidEvent(f"{SHUTDOWN_MESSAGE}: no new turns")
            self.turns += 1
            self.turn = asyncio.create_task(self._turn(chat, self.turns))
        elif kind == "session.close":
            if self.turn is not None:
                self.turn.cancel()
            reason = event.get("reason") if isinstance(event.get("reason"), str) else "user_stop"
            self._end(reason, 1000)
            return True
        else:
            raise UnknownEvent(f"unknown event type {kind[:64]!r}")
        return False

    async def _turn(self, chat: ChatInput, number: int) -> None:
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
            self.send(protocol.queued_json(q))

        async def leased() -> None:
            if waited:  # the turn had to wait: tell the client it is over
                self.send(protocol.queue_done_json())

        async def prefilled(_: int) -> None:
            return None

        async def delta(text: str, pcm: bytes) -> None:
            if not chat.streaming:
                return
            if text:
                self.send({**base, "kind": "text", "text": text, "metrics": {}})
            if pcm:
                self.send(
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
            self._fail(err)
            return
        self.usage = _add(self.usage, result.usage)
        if not chat.streaming:
            self.send({**base, "kind": "text", "text": result.text, "metrics": {}})
            audio = b"".join(result.audio)
            if audio:
                self.send(
                    {
                        **base,
                        "kind": "audio",
                        "audio": encode_pcm(audio),
                        "metrics": {},
                        "usage": protocol.usage_json(self.usage),
                    }
                )
        self.send(
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


def _finish_timeout_s(app: EdgeApp) -> float:
    from edge.ws import finish_timeout_s

    return finish_timeout_s(app.config)


class LegacyChatConnection:
    """/ws/chat: one request message, prefill_done, chunk..., done, then the server closes;
    any error is `error{error}` and a close."""

    def __init__(self, app: EdgeApp, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.session_id = f"chat_{new_session_id().removeprefix('rt_')}"
        self.ended = False
        """The last message and the close are queued."""
        self.requested = False
        """The request arrived: a turn is being served."""
        self.work: asyncio.Task | None = None
        # /ws/chat's error carries a plain string, the current protocol an object.
        self.outbox = Outbox.sized_by(app.config, ws, self._overflowed, legacy_error_event)
        self.finished = asyncio.Event()
        """Set once the connection is over and its last frames went out (drain waits)."""

    def send(self, event: dict[str, Any]) -> None:
        """Queue one message for the client (never waits on the client's socket)."""
        self.outbox.send(event)

    def _overflowed(self) -> None:
        self.ended = True
        if self.work is not None:
            self.work.cancel()

    def _finish(self, event: dict[str, Any], code: int, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.send(event)
        self.outbox.close(code, reason)

    def _error(self, text: str, code: int = 1000) -> None:
        self._finish({"type": "error", "error": text}, code, "error")

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: a turn in progress gets up to timeout_s to finish (`done` goes out); a
        connection still waiting for its request, or a turn that does not finish, gets
        `error{error}` and close 1001."""
        await _settle(self.work, timeout_s if self.requested else 0.0)
        self._error(SHUTDOWN_MESSAGE, SHUTDOWN_CLOSE)

    async def run(self) -> None:
        """Serve the one request; a client that leaves mid-turn cancels the turn (its
        worker slot returns at once)."""
        self.app.chats.add(self)
        self.work = asyncio.create_task(self._serve())
        gone = asyncio.create_task(self.ws.wait_closed())
        try:
            await asyncio.wait({self.work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.app.chats.discard(self)
            for task in (self.work, gone):
                task.cancel()
            await asyncio.gather(self.work, gone, return_exceptions=True)
            await self.outbox.finish(_finish_timeout_s(self.app))
            self.finished.set()

    async def _serve(self) -> None:
        try:
            message = await asyncio.wait_for(self.ws.recv(), self.app.config.open_timeout_s * 6)
            if isinstance(message, bytes):
                raise InvalidPayload("the request must be a JSON text message")
            try:
                body = protocol.parse_object(message)
            except protocol.InvalidJson:
                raise InvalidPayload("the request is not valid JSON") from None
            self.requested = True
            chat = await asyncio.to_thread(parse_chat, body)

            async def queued(q: ev.Queued) -> None:
                event = protocol.queued_json(q)
                event["type"] = event["type"].removeprefix("session.")
                self.send(event)

            async def leased() -> None:
                self.send({"type": "queue_done"})

            async def prefilled(tokens: int) -> None:
                self.send({"type": "prefill_done", "input_tokens": tokens})

            async def delta(text: str, pcm: bytes) -> None:
                if chat.streaming:
                    self.send(
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
            self._finish(
                {
                    "type": "done",
                    "text": result.text,
                    "generated_tokens": result.generated_tokens,
                    "input_tokens": result.input_tokens,
                    "audio_data": encode_pcm(b"".join(audio)) if any(audio) else None,
                    "recording_session_id": None,
                    "metrics": _metrics(result),
                },
                1000,
                "done",
            )
        except EdgeError as err:
            self._error(err.message)
        except TimeoutError:
            self._error("no request received")
        except ConnectionClosed:
            pass


__all__ = ["ChatConnection", "LegacyChatConnection", "wav_base64"]
