"""The Realtime API's turn-based chat on /v1/realtime?mode=chat: session.init (payload may
be empty), then one turn per input.append; history is the client's (each append carries
all messages). Replies stream as response.output.delta (text, audio) and end with
response.done; the session's usage is cumulative. On a drain: session.closed
{reason:"server_shutdown"} and close 1001."""

from __future__ import annotations

from typing import Any

from omnifabric.edge import events as ev
from omnifabric.edge import fields, pcm
from omnifabric.edge.chat import (
    ChatClose,
    ChatOpen,
    ChatTurn,
    Shutdown,
    TurnDelta,
    TurnDone,
    TurnLeased,
    TurnQueued,
    TurnStarted,
    add_usage,
    metrics_json,
)
from omnifabric.edge.dialects.base import ChatDialect
from omnifabric.edge.dialects.realtime import error_json, queue_done_json, queued_json, usage_json
from omnifabric.edge.errors import (
    ALREADY_INITIALIZED,
    EdgeError,
    InvalidEvent,
    InvalidPayload,
    MissingField,
    NotReady,
    UnknownEvent,
)


class RealtimeChat(ChatDialect):
    """/v1/realtime?mode=chat."""

    name = "realtime_chat"

    def __init__(self) -> None:
        self.session_id = ""
        self.created = False
        self.usage = ev.Usage()
        self.turns = 0
        self._streaming = True

    def opening(self) -> list[Any]:
        # No slot is held between turns, so nothing to wait for: queue_done at once.
        return [queue_done_json()]

    def decode(self, message: Any) -> list[Any]:
        if isinstance(message, bytes):
            raise InvalidPayload("binary frames are not part of the protocol")
        event = fields.parse_frame(message)
        kind = event["type"]
        if kind == "session.init":
            fields.obj(event, "payload")
            if self.created:
                raise InvalidEvent(ALREADY_INITIALIZED)
            self.created = True
            return [ChatOpen()]
        if kind == "input.append":
            if not self.created:
                raise NotReady("send session.init first")
            body = event.get("input")
            if body is None:
                raise MissingField("'input' is required")
            if not isinstance(body, dict):
                raise InvalidPayload("'input' must be an object")
            return [ChatTurn(body)]
        if kind == "session.close":
            reason = event.get("reason")
            return [ChatClose(reason if isinstance(reason, str) else "user_stop")]
        raise UnknownEvent(f"unknown event type {kind[:64]!r}")

    def _base(self) -> dict[str, Any]:
        return {
            "type": "response.output.delta",
            "session_id": self.session_id,
            "response_id": f"resp_{self.session_id}_{self.turns}",
            "input_id": f"input_{self.turns}",
        }

    def _deltas(self, text: str, audio: bytes) -> list[dict[str, Any]]:
        sent = []
        if text:
            sent.append({**self._base(), "kind": "text", "text": text, "metrics": {}})
        if audio:
            sent.append(
                {
                    **self._base(),
                    "kind": "audio",
                    "audio": pcm.encode_pcm(audio),
                    "metrics": {},
                    "usage": usage_json(self.usage),
                }
            )
        return sent

    def _closed(self, reason: str) -> dict[str, Any]:
        return {
            "type": "session.closed",
            "session_id": self.session_id,
            "reason": reason,
            "usage": usage_json(self.usage),
        }

    def encode(self, event: Any) -> list[Any]:
        if isinstance(event, ChatOpen):
            return [
                {
                    "type": "session.created",
                    "session_id": self.session_id,
                    "mode": "turn_based",
                    "metrics": {},
                }
            ]
        if isinstance(event, TurnStarted):
            self.turns += 1
            self._streaming = event.streaming
            return []
        if isinstance(event, TurnQueued):
            return [queued_json(event.queued)]
        if isinstance(event, TurnLeased):
            return [queue_done_json()] if event.waited else []
        if isinstance(event, TurnDelta):
            return self._deltas(event.text, event.pcm) if self._streaming else []
        if isinstance(event, TurnDone):
            result = event.result
            self.usage = add_usage(self.usage, result.usage)
            sent = [] if self._streaming else self._deltas(result.text, b"".join(result.audio))
            if not self._streaming and not result.text:
                sent.insert(0, {**self._base(), "kind": "text", "text": "", "metrics": {}})
            sent.append(
                {
                    "type": "response.done",
                    "session_id": self.session_id,
                    "response_id": f"resp_{self.session_id}_{self.turns}",
                    "text": result.text,
                    "reason": result.reason,
                    "usage": usage_json(self.usage),
                    "metrics": metrics_json(result),
                }
            )
            return sent
        if isinstance(event, ChatClose):
            return [self._closed(event.reason)]
        if isinstance(event, Shutdown):
            return [self._closed(ev.SERVER_SHUTDOWN)]
        return []

    def error(self, err: EdgeError) -> dict[str, Any]:
        return error_json(err)
