"""A response's life on the wire: created; with its first text or audio its message item
(added to the conversation, where the client may truncate it while it is spoken) and
content part, then the deltas; each function call the model makes as an item of its own
(added, its arguments, done); the closing events, done last. The same for a duplex reply
the engine chose to make and for a response on request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifabric.common.tools import ToolCall
from omnifabric.edge import codec
from omnifabric.edge import events as ev
from omnifabric.edge.dialects.openai.audio import SpeechOut, format_json, speech_ms
from omnifabric.edge.dialects.openai.conversation import FUNCTION_CALL, Conversation, Item
from omnifabric.edge.dialects.openai.settings import tokens_json
from omnifabric.edge.dialects.openai.wire import Wire, minus, usage_json


@dataclass
class Response:
    """The response being generated."""

    id: str
    item: Item
    """Its message item (text or speech), announced with the first delta."""
    audio: bool
    output_format: str
    voice: str
    max_tokens: int | None
    conversation_id: str | None
    usage_at_start: ev.Usage = field(default_factory=ev.Usage)
    heard_speech: bool = False
    """The user spoke over it (duplex)."""
    metadata: dict[str, str] | None = None
    """The client's, echoed (LiveKit matches its requests by it)."""
    speech: SpeechOut | None = None
    """Its audio in the output format, as one stream (made with the message item)."""
    outputs: list[Item] = field(default_factory=list)
    """Its output items as announced: the message item and the function calls."""
    previous: dict[str, str | None] = field(default_factory=dict)
    """Each output item's id -> the item before it in the conversation."""

    @property
    def speaking(self) -> bool:
        """Its message item is announced (and not yet done)."""
        return self.item in self.outputs and self.item.status == "in_progress"

    def content_index(self) -> dict[str, Any]:
        ids = {"response_id": self.id, "item_id": self.item.id}
        return {**ids, "output_index": self.outputs.index(self.item), "content_index": 0}

    def json(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "output": [o.json() for o in self.outputs] if status != "in_progress" else [],
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
        """The current response starts: response.created."""
        response = self.current
        if response is None:
            return []
        return [self.wire.event("response.created", response=response.json("in_progress"))]

    def _announce(self, response: Response, item: Item) -> list[Any]:
        """An output item joins the response and the conversation (in progress)."""
        index = len(response.outputs)
        response.outputs.append(item)
        response.previous[item.id] = self.conversation.append(item)
        if item.type == FUNCTION_CALL:
            empty = {**item.json(), "arguments": ""}
        else:
            empty = {**item.json(), "content": []}
        event = self.wire.event
        return [
            event(
                "response.output_item.added",
                response_id=response.id,
                output_index=index,
                item=empty,
            ),
            # The item joins the conversation (LiveKit keeps its copy by these; Pipecat
            # opens the response's frames on it).
            event(
                "conversation.item.added", previous_item_id=response.previous[item.id], item=empty
            ),
        ]

    def _open_message(self, response: Response) -> list[Any]:
        """The message item and its content part, announced with the first delta."""
        if response.audio:
            part: dict[str, Any] = {"type": "audio", "transcript": ""}
            response.item.parts = [{"type": "output_audio", "transcript": ""}]
        else:
            part = {"type": "text", "text": ""}
            response.item.parts = [{"type": "output_text", "text": ""}]
        response.item.status = "in_progress"
        response.speech = SpeechOut(response.output_format) if response.audio else None
        messages = self._announce(response, response.item)
        messages.append(
            self.wire.event("response.content_part.added", **response.content_index(), part=part)
        )
        return messages

    def deltas(self, text: str, audio: bytes) -> list[Any]:
        response = self.current
        if response is None or not (text or audio):
            return []
        messages: list[Any] = []
        if response.item not in response.outputs:
            messages += self._open_message(response)
        elif not response.speaking:
            return []  # the message is done (a call followed it): no more text in it
        part = response.item.parts[0]
        ids = response.content_index()
        if not response.audio:
            if text:
                part["text"] += text
                messages.append(self.wire.event("response.output_text.delta", **ids, delta=text))
            return messages
        if audio and response.speech is not None:
            data = codec.b64encode(response.speech.encode(audio))
            response.item.audio_ms += speech_ms(audio)
            messages.append(self.wire.event("response.output_audio.delta", **ids, delta=data))
        if text:
            part["transcript"] += text
            messages.append(
                self.wire.event("response.output_audio_transcript.delta", **ids, delta=text)
            )
        return messages

    def call(self, call: ToolCall) -> list[Any]:
        """The model calls a function: its item, its arguments, done."""
        response = self.current
        if response is None:
            return []
        messages = self._message_done(response) if response.speaking else []
        item = Item(self.wire.id("item"), "assistant", [], status="in_progress")
        item.type, item.call = FUNCTION_CALL, call
        messages += self._announce(response, item)
        index = response.outputs.index(item)
        ids = {"response_id": response.id, "item_id": item.id, "output_index": index}
        event = self.wire.event
        item.status = "completed"
        messages += [
            event(
                "response.function_call_arguments.delta",
                **ids,
                call_id=call.call_id,
                delta=call.arguments,
            ),
            event(
                "response.function_call_arguments.done",
                **ids,
                call_id=call.call_id,
                name=call.name,
                arguments=call.arguments,
            ),
            event(
                "response.output_item.done",
                response_id=response.id,
                output_index=index,
                item=item.json(),
            ),
            event(
                "conversation.item.done",
                previous_item_id=response.previous[item.id],
                item=item.json(),
            ),
        ]
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
        done_status = "completed" if status == "completed" else "incomplete"
        messages: list[Any] = []
        if response.speaking:
            messages += self._message_done(response, done_status)
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
        messages.append(self.wire.event("response.done", response=done))
        return messages

    def _message_done(self, response: Response, status: str = "completed") -> list[Any]:
        """The message's closing events (it is in the conversation since it was added)."""
        event, item = self.wire.event, response.item
        item.status = status
        ids = response.content_index()
        part = item.parts[0]
        if response.audio:
            transcript = part["transcript"]
            tail = response.speech.flush() if response.speech is not None else b""
            messages = []
            if tail:  # the resampler's last few ms
                delta = codec.b64encode(tail)
                messages.append(event("response.output_audio.delta", **ids, delta=delta))
            messages += [
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
        done = item.json()
        index = ids["output_index"]
        messages.append(
            event(
                "response.output_item.done", response_id=response.id, output_index=index, item=done
            )
        )
        previous = response.previous[item.id]
        messages.append(event("conversation.item.done", previous_item_id=previous, item=done))
        return messages
