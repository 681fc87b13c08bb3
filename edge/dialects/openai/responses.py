"""A response's life on the wire: created, its item added to the conversation (where the
client may truncate it while it is spoken) and its content part, text and audio deltas,
and the closing events (done last). The same for a duplex reply the engine chose to make
and for a response on request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifabric.edge import codec
from omnifabric.edge import events as ev
from omnifabric.edge.dialects.openai.audio import encode_audio, format_json, speech_ms
from omnifabric.edge.dialects.openai.conversation import Conversation, Item
from omnifabric.edge.dialects.openai.settings import tokens_json
from omnifabric.edge.dialects.openai.wire import Wire, minus, usage_json


@dataclass
class Response:
    """The response being generated."""

    id: str
    item: Item
    audio: bool
    output_format: str
    voice: str
    max_tokens: int | None
    conversation_id: str | None
    usage_at_start: ev.Usage = field(default_factory=ev.Usage)
    heard_speech: bool = False
    """The user spoke over it (duplex)."""
    previous_item_id: str | None = None
    """The item before its own in the conversation."""
    metadata: dict[str, Any] | None = None
    """The client's, echoed (LiveKit matches its requests by it)."""

    def content_index(self) -> dict[str, Any]:
        ids = {"response_id": self.id, "item_id": self.item.id}
        return {**ids, "output_index": 0, "content_index": 0}

    def json(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "output": [self.item.json()] if status != "in_progress" else [],
            "output_modalities": ["audio" if self.audio else "text"],
            "audio": {"output": {"format": format_json(self.output_format), "voice": self.voice}},
            "max_output_tokens": tokens_json(self.max_tokens),
            "conversation_id": self.conversation_id,
            "metadata": self.metadata,
            **extra,
        }


class Responses:
    """The response in progress (at most one) and the session's usage it is measured by."""

    def __init__(self, wire: Wire, conversation: Conversation) -> None:
        self.wire = wire
        self.conversation = conversation
        self.current: Response | None = None
        self.usage = ev.Usage()
        """The session's usage so far (cumulative, from the engine's outputs)."""
        self.usage_at_end = ev.Usage()
        """The usage when the last reply ended: where the next duplex one's starts."""

    def begin(self) -> list[Any]:
        """The current response starts: its opening events."""
        response = self.current
        if response is None:
            return []
        event = self.wire.event
        if response.audio:
            part: dict[str, Any] = {"type": "audio", "transcript": ""}
            response.item.parts = [{"type": "output_audio", "transcript": ""}]
        else:
            part = {"type": "text", "text": ""}
            response.item.parts = [{"type": "output_text", "text": ""}]
        empty = {**response.item.json(), "content": []}
        response.previous_item_id = self.conversation.append(response.item)
        return [
            event("response.created", response=response.json("in_progress")),
            event(
                "response.output_item.added", response_id=response.id, output_index=0, item=empty
            ),
            # The assistant's item joins the conversation (LiveKit keeps its copy by these;
            # Pipecat opens the response's frames on it).
            event(
                "conversation.item.added", previous_item_id=response.previous_item_id, item=empty
            ),
            event("response.content_part.added", **response.content_index(), part=part),
        ]

    def deltas(self, text: str, audio: bytes) -> list[Any]:
        response = self.current
        if response is None:
            return []
        part = response.item.parts[0]
        ids = response.content_index()
        messages: list[Any] = []
        if not response.audio:
            if text:
                part["text"] += text
                messages.append(self.wire.event("response.output_text.delta", **ids, delta=text))
            return messages
        if audio:
            data = codec.b64encode(encode_audio(audio, response.output_format))
            response.item.audio_ms += speech_ms(audio)
            messages.append(self.wire.event("response.output_audio.delta", **ids, delta=data))
        if text:
            part["transcript"] += text
            messages.append(
                self.wire.event("response.output_audio_transcript.delta", **ids, delta=text)
            )
        return messages

    def finish(
        self,
        status: str,
        reason: str | None,
        usage: ev.Usage | None = None,
        error: dict[str, Any] | None = None,
    ) -> list[Any]:
        """The response's closing events (response.done last); [] without one."""
        response, self.current = self.current, None
        if response is None:
            return []
        item = response.item
        item.status = "completed" if status == "completed" else "incomplete"
        messages = self._item_done(response) if item.parts else []
        if usage is None:
            usage = minus(self.usage, response.usage_at_start)
        self.usage_at_end = self.usage
        details: dict[str, Any] = {"type": status}
        if reason:
            details["reason"] = reason
        if error:
            details["error"] = error
        done = response.json(
            status,
            status_details=details if status != "completed" else None,
            usage=usage_json(usage),
        )
        done["output"] = [item.json()] if item.parts else []
        messages.append(self.wire.event("response.done", response=done))
        return messages

    def _item_done(self, response: Response) -> list[Any]:
        """The content's closing events (the item is in the conversation since begin)."""
        event, item = self.wire.event, response.item
        ids = response.content_index()
        part = item.parts[0]
        if response.audio:
            transcript = part["transcript"]
            messages = [
                event("response.output_audio.done", **ids),
                event("response.output_audio_transcript.done", **ids, transcript=transcript),
                event(
                    "response.content_part.done",
                    **ids,
                    part={"type": "audio", "transcript": transcript},
                ),
            ]
        else:
            text = part["text"]
            messages = [
                event("response.output_text.done", **ids, text=text),
                event("response.content_part.done", **ids, part={"type": "text", "text": text}),
            ]
        previous = response.previous_item_id
        done = item.json()
        messages.append(
            event("response.output_item.done", response_id=response.id, output_index=0, item=done)
        )
        messages.append(event("conversation.item.done", previous_item_id=previous, item=done))
        return messages
