"""The conversation the client builds: its items (what the user and the engine said, with
the audio and images the engine needs; the functions the model called and what they
returned), their edits, and the chat input a response on request answers (edge.chat's
ChatInput, built here directly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifabric.common.tools import ToolCall, ToolChoice, ToolSpec
from omnifabric.edge import fields
from omnifabric.edge.chat import check_audio_seconds, check_messages, image_file
from omnifabric.edge.chat_input import (
    AudioPart,
    ChatInput,
    ChatMessage,
    Generation,
    ImagePart,
    Part,
    TextPart,
    TtsOptions,
)
from omnifabric.edge.dialects.openai.audio import ENGINE_IN_RATE, b64, heard
from omnifabric.edge.dialects.openai.wire import BadParam
from omnifabric.edge.errors import InvalidEvent

TEXT_PARTS = ("input_text", "output_text", "text")
#: Item types: a message, a function call of the model, a function's output.
MESSAGE, FUNCTION_CALL, FUNCTION_OUTPUT = "message", "function_call", "function_call_output"


@dataclass
class Item:
    """A conversation item: what the client and the engine said, kept for chat turns."""

    id: str
    role: str
    """A message's role; "assistant" for a function call, "tool" for its output."""
    parts: list[dict[str, Any]]
    """OpenAI content parts as the client sees them (no audio bytes)."""
    audio: bytes = b""
    """A user item's audio as the engine hears it (float32 16 kHz)."""
    images: list[bytes] = field(default_factory=list)
    """A user item's image files, verified, in the order of their parts."""
    status: str = "completed"
    audio_ms: float = 0.0
    """An assistant item's speech, milliseconds (what truncation cuts in proportion)."""
    type: str = MESSAGE
    call: ToolCall | None = None
    """A function call item's call; the call a function output item answers."""
    output: str = ""
    """A function output item's output."""

    def json(self) -> dict[str, Any]:
        base = {"id": self.id, "object": "realtime.item", "type": self.type}
        if self.type == MESSAGE or self.call is None:
            return {**base, "role": self.role, "status": self.status, "content": self.parts}
        call = self.call
        if self.type == FUNCTION_CALL:
            return {
                **base,
                "status": self.status,
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
        return {**base, "status": self.status, "call_id": call.call_id, "output": self.output}

    def text(self) -> str:
        return "".join(p.get("text") or p.get("transcript") or "" for p in self.parts)

    def message(self) -> ChatMessage:
        """The item as a chat message (texts and images in order, the audio last; a call as
        an assistant message's call, an output as a tool message)."""
        if self.type == FUNCTION_CALL and self.call is not None:
            return ChatMessage("assistant", (), tool_calls=(self.call,))
        if self.type == FUNCTION_OUTPUT and self.call is not None:
            return ChatMessage("tool", (TextPart(self.output),), tool_call_id=self.call.call_id)
        if self.role != "user":
            return ChatMessage(self.role, (TextPart(self.text()),))
        parts: list[Part] = []
        images = iter(self.images)
        for part in self.parts:
            if part["type"] in ("input_text", "text"):
                parts.append(TextPart(part["text"]))
            elif part["type"] == "input_image":
                parts.append(ImagePart(next(images)))
        if self.audio:
            parts.append(AudioPart(self.audio))
        return ChatMessage("user", tuple(parts))

    def truncate(self, end_ms: int) -> None:
        """What the listener heard: the transcript cut where the audio was (in
        proportion)."""
        total_ms = self.audio_ms
        if total_ms and end_ms < total_ms:
            for part in self.parts:
                text = part.get("transcript") or ""
                part["transcript"] = text[: int(len(text) * end_ms / total_ms)]


def _string(body: dict[str, Any], key: str, where: str) -> str:
    value = body.get(key, "")
    if not isinstance(value, str):
        raise BadParam(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


class ItemParser:
    """Client item objects -> Items (`new_id` names those the client did not). A function
    call names a function of the tools offered; an output answers a call of the
    conversation."""

    def __init__(self, new_id: Any) -> None:
        self.new_id = new_id

    def parse(
        self,
        body: dict[str, Any],
        where: str,
        input_format: str,
        conversation: Conversation,
        tools: tuple[ToolSpec, ...] = (),
    ) -> Item:
        kind = body.get("type", MESSAGE)
        if kind == FUNCTION_CALL:
            item = self._function_call(body, where, tools)
        elif kind == FUNCTION_OUTPUT:
            item = self._function_output(body, where, conversation)
        elif kind == MESSAGE:
            item = self._message(body, where, input_format)
        else:
            kinds = f"{MESSAGE}, {FUNCTION_CALL} or {FUNCTION_OUTPUT}"
            raise BadParam(f"{where}.type", f"{where}.type must be {kinds}")
        item_id = body.get("id")
        if item_id is not None and not isinstance(item_id, str):
            raise BadParam(f"{where}.id", f"{where}.id must be a string")
        item.id = item_id or self.new_id("item")
        return item

    def _function_call(self, body: dict[str, Any], where: str, tools: tuple[ToolSpec, ...]) -> Item:
        name = body.get("name")
        if not any(t.name == name for t in tools):
            message = f"{where}.name: no function {fields.shown(name)} in the tools"
            raise BadParam(f"{where}.name", message)
        arguments = body.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise BadParam(f"{where}.arguments", f"{where}.arguments must be a JSON string")
        call = ToolCall(
            _string(body, "call_id", where) or self.new_id("call"), str(name), arguments
        )
        return Item("", "assistant", [], type=FUNCTION_CALL, call=call)

    def _function_output(
        self, body: dict[str, Any], where: str, conversation: Conversation
    ) -> Item:
        call_id = _string(body, "call_id", where)
        call = conversation.call(call_id)
        if call is None:
            message = (
                f"{where}.call_id: no function call {fields.shown(call_id)} in the conversation"
            )
            raise BadParam(f"{where}.call_id", message)
        output = body.get("output")
        if not isinstance(output, str):
            raise BadParam(f"{where}.output", f"{where}.output must be a string")
        return Item("", "tool", [], type=FUNCTION_OUTPUT, call=call, output=output)

    def _message(self, body: dict[str, Any], where: str, input_format: str) -> Item:
        role = body.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadParam(f"{where}.role", f"{where}.role must be user, assistant or system")
        content = body.get("content")
        if not isinstance(content, list) or not content:
            raise BadParam(f"{where}.content", f"{where}.content must be a non-empty list")
        item = Item("", role, [])
        for i, part in enumerate(content):
            self._part(item, part, f"{where}.content[{i}]", input_format)
        return item

    def _part(self, item: Item, part: Any, at: str, input_format: str) -> None:
        kind = part.get("type") if isinstance(part, dict) else None
        role = item.role
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise BadParam(f"{at}.text", f"{at}.text must be a string")
            item.parts.append({"type": kind, "text": text})
        elif kind == "input_audio" and role == "user":
            audio = heard(b64(part.get("audio"), f"{at}.audio"), input_format)
            item.audio += audio.astype("<f4").tobytes()
            check_audio_seconds(len(item.audio) / 4 / ENGINE_IN_RATE, f"{at}.audio")
            transcript = _transcript(part, at)
            item.parts.append({"type": "input_audio", "transcript": transcript})
        elif kind == "input_image" and role == "user":
            url = part.get("image_url")
            if not isinstance(url, str) or not url.startswith("data:image/"):
                raise BadParam(
                    f"{at}.image_url", f"{at}.image_url must be a data:image/...;base64 URL"
                )
            item.images.append(image_file(url.split(",", 1)[-1], f"{at}.image_url"))
            item.parts.append({"type": "input_image", "image_url": url})
        elif kind == "output_audio" and role == "assistant":
            item.parts.append({"type": "output_audio", "transcript": _transcript(part, at) or ""})
        else:
            message = f"{at}.type {fields.shown(kind)} is not served for a {role}"
            raise BadParam(f"{at}.type", message)


def _transcript(part: dict[str, Any], at: str) -> str | None:
    """An audio part's transcript (echoed on the item): a string or null."""
    transcript = part.get("transcript")
    if transcript is not None and not isinstance(transcript, str):
        raise BadParam(f"{at}.transcript", f"{at}.transcript must be a string")
    return transcript


class Conversation:
    """The items in order, addressed by id."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def append(self, item: Item) -> str | None:
        """Add `item` at the end; the id of the item before it."""
        previous = self.last_id
        self.items.append(item)
        return previous

    def insert(self, item: Item, previous: Any) -> str | None:
        """Add `item` after `previous` (None: at the end, "root": first); the id of the
        item before it."""
        if any(i.id == item.id for i in self.items):
            raise BadParam("item.id", f"an item {fields.shown(item.id)} already exists")
        if previous is None:
            at = len(self.items)
        elif previous == "root":
            at = 0
        else:
            at = self.index(previous, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def index(self, item_id: Any, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise BadParam(param, f"no item {fields.shown(item_id)} in the conversation")

    def get(self, item_id: Any, param: str = "item_id") -> Item:
        return self.items[self.index(item_id, param)]

    def delete(self, item_id: Any) -> Item:
        return self.items.pop(self.index(item_id, "item_id"))

    def call(self, call_id: str) -> ToolCall | None:
        """The function call `call_id` in the conversation, None when it holds none."""
        for item in self.items:
            if item.type == FUNCTION_CALL and item.call and item.call.call_id == call_id:
                return item.call
        return None


def messages_of(items: list[Item]) -> list[ChatMessage]:
    """The items as chat messages: a function call joins the assistant message before it
    (the calls of one reply make one message), its output is a tool message."""
    messages: list[ChatMessage] = []
    for item in items:
        message = item.message()
        last = messages[-1] if messages else None
        if item.type == FUNCTION_CALL and last is not None and last.role == "assistant":
            calls = (*last.tool_calls, *message.tool_calls)
            messages[-1] = ChatMessage("assistant", last.parts, tool_calls=calls)
        else:
            messages.append(message)
    return messages


@dataclass(frozen=True)
class TurnRequest:
    """What one response on request answers with."""

    instructions: str
    items: list[Item]
    speaks: bool
    ref_audio: bytes
    max_tokens: int | None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


def chat_input(request: TurnRequest) -> ChatInput:
    """The chat turn that answers the conversation `request.items`."""
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage("system", (TextPart(request.instructions),)))
    messages += messages_of(request.items)
    if not messages or messages[-1].role not in ("user", "tool"):
        raise InvalidEvent(
            "the conversation must end with a user item (or a function's output) to answer"
        )
    check_messages(tuple(messages))
    return ChatInput(
        messages=tuple(messages),
        streaming=True,
        generation=Generation(max_new_tokens=request.max_tokens),
        tts=TtsOptions(enabled=request.speaks, ref_audio=request.ref_audio),
        tools=request.tools,
        tool_choice=request.tool_choice,
    )
