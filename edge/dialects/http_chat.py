"""POST /api/chat: the chat request body -> the whole answer as one JSON response (text, a
base64 WAV of the speech, token counts, queue wait). Errors: 400 for a bad request, 503
when no worker can take the turn (queue full, no service) or the edge drains, 500 for
anything else; each body is {"success": false, "error": <code>, "message": <text>}."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from omnifabric.edge import fields
from omnifabric.edge.chat import (
    SHUTDOWN_MESSAGE,
    ChatTurn,
    Shutdown,
    TurnDone,
    TurnQueued,
    TurnStarted,
    wav_base64,
)
from omnifabric.edge.dialects.base import ChatDialect
from omnifabric.edge.dialects.realtime import usage_json
from omnifabric.edge.errors import (
    AppDisabled,
    EdgeError,
    InvalidPayload,
    QueueFull,
    ServiceUnavailable,
    TooManySessions,
)


@dataclass(frozen=True)
class HttpResponse:
    status: HTTPStatus
    body: dict[str, Any]


def failure(status: HTTPStatus, code: str, message: str) -> HttpResponse:
    return HttpResponse(status, {"success": False, "error": code, "message": message})


def use_post() -> HttpResponse:
    """The answer to a chat route asked with another method than POST (GET included)."""
    return failure(HTTPStatus.METHOD_NOT_ALLOWED, "method", "use POST")


class HttpChat(ChatDialect):
    """POST /api/chat."""

    name = "http_chat"
    one_request = True
    id_prefix = "chat_"

    def __init__(self) -> None:
        self.session_id = ""
        self._speech = True
        self._estimated_wait_s: float | None = None

    def decode(self, message: Any) -> list[Any]:
        try:
            body = fields.parse_object(bytes(message).decode("utf-8"))
        except (fields.InvalidJson, UnicodeDecodeError):
            raise InvalidPayload("the body is not JSON") from None
        return [ChatTurn(body)]

    def encode(self, event: Any) -> list[Any]:
        if isinstance(event, TurnStarted):
            self._speech = event.speech
        elif isinstance(event, TurnQueued) and self._estimated_wait_s is None:
            self._estimated_wait_s = event.queued.estimated_wait_s
        elif isinstance(event, TurnDone):
            result = event.result
            audio = wav_base64(result.audio) if self._speech and any(result.audio) else None
            wait = self._estimated_wait_s
            body = {
                "success": True,
                "text": result.text,
                "audio_data": audio,
                "audio_sample_rate": 24000 if audio else None,
                "input_tokens": result.input_tokens,
                "generated_tokens": result.generated_tokens,
                "tokens_generated": result.generated_tokens,
                "reason": result.reason,
                "usage": usage_json(result.usage),
                "duration_ms": round(result.timings_ms.get("wall_clock_ms", 0.0)),
                "queue_wait_ms": round(result.timings_ms.get("queue_ms", 0.0)),
                "estimated_queue_wait_s": round(wait, 1) if wait is not None else 0.0,
                "ignored": list(result.ignored),
            }
            return [HttpResponse(HTTPStatus.OK, body)]
        elif isinstance(event, Shutdown):
            return [failure(HTTPStatus.SERVICE_UNAVAILABLE, "server_shutdown", SHUTDOWN_MESSAGE)]
        return []

    def error(self, err: EdgeError) -> HttpResponse:
        if isinstance(err, (QueueFull, ServiceUnavailable)):
            status = HTTPStatus.SERVICE_UNAVAILABLE
        elif isinstance(err, AppDisabled):
            status = HTTPStatus.FORBIDDEN
        elif isinstance(err, TooManySessions):
            status = HTTPStatus.TOO_MANY_REQUESTS  # as the edge's own count answers
        elif err.kind == "client_error":
            status = HTTPStatus.BAD_REQUEST
        else:
            status = HTTPStatus.INTERNAL_SERVER_ERROR
        return failure(status, err.code, err.message)
