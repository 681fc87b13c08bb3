"""The legacy chat endpoint /ws/chat: one request message, then `prefill_done`, `chunk`...
(when streaming), `done`, and the server closes. Any error is `error{error:"<text>"}` and a
close; a drain answers `error{error}` and close 1001 to a connection still waiting for its
request or whose turn does not finish in time."""

from __future__ import annotations

from typing import Any

from omnifabric.edge import fields, pcm
from omnifabric.edge.chat import (
    SHUTDOWN_MESSAGE,
    ChatTurn,
    Shutdown,
    TurnDelta,
    TurnDone,
    TurnLeased,
    TurnPrefilled,
    TurnQueued,
    TurnStarted,
    metrics_json,
)
from omnifabric.edge.dialects.base import ChatDialect
from omnifabric.edge.dialects.realtime import queued_json
from omnifabric.edge.errors import EdgeError, InvalidPayload


class LegacyChat(ChatDialect):
    """/ws/chat."""

    name = "legacy_chat"
    one_request = True
    id_prefix = "chat_"

    def __init__(self) -> None:
        self.session_id = ""
        self._streaming = True

    def decode(self, message: Any) -> list[Any]:
        if isinstance(message, bytes):
            raise InvalidPayload("the request must be a JSON text message")
        try:
            body = fields.parse_object(message)
        except fields.InvalidJson:
            raise InvalidPayload("the request is not valid JSON") from None
        return [ChatTurn(body)]

    def encode(self, event: Any) -> list[Any]:
        if isinstance(event, TurnStarted):
            self._streaming = event.streaming
            return []
        if isinstance(event, TurnQueued):
            queued = queued_json(event.queued)
            queued["type"] = queued["type"].removeprefix("session.")
            return [queued]
        if isinstance(event, TurnLeased):
            return [{"type": "queue_done"}]
        if isinstance(event, TurnPrefilled):
            return [{"type": "prefill_done", "input_tokens": event.input_tokens}]
        if isinstance(event, TurnDelta):
            if not self._streaming:
                return []
            audio = pcm.encode_pcm(event.pcm) if event.pcm else None
            return [{"type": "chunk", "text_delta": event.text, "audio_data": audio}]
        if isinstance(event, TurnDone):
            result = event.result
            # Streamed audio already went out in chunks; done carries the last one.
            pieces = result.audio if not self._streaming else result.audio[-1:]
            return [
                {
                    "type": "done",
                    "text": result.text,
                    "generated_tokens": result.generated_tokens,
                    "input_tokens": result.input_tokens,
                    "audio_data": pcm.encode_pcm(b"".join(pieces)) if any(pieces) else None,
                    "recording_session_id": None,
                    "metrics": metrics_json(result),
                }
            ]
        if isinstance(event, Shutdown):
            return [{"type": "error", "error": SHUTDOWN_MESSAGE}]
        return []

    def error(self, err: EdgeError) -> dict[str, Any]:
        text = err.message if err.close_code is None else f"{err.code}: {err.message}"
        return {"type": "error", "error": text}
