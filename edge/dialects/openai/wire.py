"""The OpenAI Realtime API's wire shapes the dialect's parts share: ids, server events,
errors (with the client's event id and the parameter at fault), settings accepted and not
used (logged once; the client reads the effective settings in session.updated), and usage."""

from __future__ import annotations

import itertools
import logging
import secrets
from typing import Any

from omnifabric.edge import events as ev
from omnifabric.edge.errors import EdgeError, InvalidPayload

log = logging.getLogger("omnifabric.edge.openai")


class BadParam(InvalidPayload):
    """A client error about one parameter, named in the error event's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Wire:
    """One connection's event ids and the client event being answered."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(4)
        self.client_event_id: str | None = None
        """The `event_id` of the client event being decoded (errors name it)."""
        self._said: set[str] = set()

    def id(self, prefix: str) -> str:
        return f"{prefix}_{self._tag}{next(self._ids):06d}"

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": self.id("event"), **body}

    def error(self, err: EdgeError) -> dict[str, Any]:
        kind = "invalid_request_error" if err.kind == "client_error" else "server_error"
        body = {
            "type": kind,
            "code": err.code,
            "message": err.message,
            "param": getattr(err, "param", None),
            "event_id": self.client_event_id,
        }
        return self.event("error", error=body)

    def ignored(self, param: str, why: str) -> None:
        """`param` is accepted and not used: logged once a connection. No event says it:
        the API has none (an `error` ends the session in frameworks, an event outside the
        schema is reported as an error by typed clients); session.updated shows the
        settings in effect instead."""
        if param in self._said:
            return
        self._said.add(param)
        log.info("OpenAI Realtime session: %s: %s", param, why)


def minus(a: ev.Usage, b: ev.Usage) -> ev.Usage:
    return ev.Usage(**{k: getattr(a, k) - getattr(b, k) for k in a.__dataclass_fields__})


def usage_json(usage: ev.Usage) -> dict[str, Any]:
    """A response's usage in OpenAI's shape."""
    return {
        "total_tokens": usage.total_tokens,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "input_token_details": {
            "text_tokens": usage.input_text_tokens,
            "audio_tokens": usage.input_audio_tokens,
            "image_tokens": usage.input_image_tokens + usage.input_vision_tokens,
            "cached_tokens": usage.input_cached_tokens,
        },
        "output_token_details": {
            "text_tokens": usage.output_text_tokens,
            "audio_tokens": usage.output_audio_tokens,
        },
    }
