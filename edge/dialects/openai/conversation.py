"""The conversation the client builds: its items (what the user and the engine said, with
the audio and images the engine needs), their edits, and the chat input a response on
request answers (edge.chat's ChatInput, built here directly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifabric.edge.chat import (
    AudioPart,
    ChatInput,
    ChatMessage,
    Generation,
    ImagePart,
    Part,
    TextPart,
    TtsOptions,
    check_audio_seconds,
    check_messages,
    image_file,
)
from omnifabric.edge.dialects.openai.audio import ENGINE_IN_RATE, b64, heard
from omnifabric.edge.dialects.openai.wire import BadParam
from omnifabric.edge.errors import InvalidEvent

TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Item:
    """A conversation item: what the client and the engine said, kept for chat turns."""

    id: str
    role: str
    parts: list[dict[str, Any]]
    """OpenAI content parts as the client sees them (no audio bytes)."""
    audio: bytes = b""
    """A user item's audio as the engine hears it (float32 16 kHz)."""
    images: list[bytes] = field(default_factory=list)
    """A user item's image files, verified, in the order of their parts."""
    status: str = "completed"
    audio_ms: float = 0.0
    """An assistant item's speech, milliseconds (what truncation cuts in proportion)."""

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": self.parts,
        }

    def text(self) -> str:
        return "".join(p.get("text") or p.get("transcript") or "" for p in self.parts)

    def message(self) -> ChatMessage:
        """The item as a chat message (texts and images in order, the audio last)."""
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


class ItemParser:
    """Client item objects -> Items (`new_id` names those the client did not)."""

    def __init__(self, new_id: Any) -> None:
        self.new_id = new_id

    def parse(self, body: dict[str, Any], where: str, input_format: str) -> Item:
        if body.get("type", "message") != "message":
            raise BadParam(
                f"{where}.type", f"{where}.type: only message items are served (no tools)"
            )
        role = body.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadParam(f"{where}.role", f"{where}.role must be user, assistant or system")
        content = body.get("content")
        if not isinstance(content, list) or not content:
            raise BadParam(f"{where}.content", f"{where}.content must be a non-empty list")
        item = Item("", role, [])
        for i, part in enumerate(content):
            self._part(item, part, f"{where}.content[{i}]", input_format)
        item_id = body.get("id")
        if item_id is not None and not isinstance(item_id, str):
            raise BadParam(f"{where}.id", f"{where}.id must be a string")
        item.id = item_id or self.new_id("item")
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
            item.parts.append({"type": "input_audio", "transcript": part.get("transcript")})
        elif kind == "input_image" and role == "user":
            url = part.get("image_url")
            if not isinstance(url, str) or not url.startswith("data:image/"):
                raise BadParam(
                    f"{at}.image_url", f"{at}.image_url must be a data:image/...;base64 URL"
                )
            item.images.append(image_file(url.split(",", 1)[-1], f"{at}.image_url"))
            item.parts.append({"type": "input_image", "image_url": url})
        elif kind == "output_audio" and role == "assistant":
            item.parts.append({"type": "output_audio", "transcript": part.get("transcript") or ""})
        else:
            raise BadParam(f"{at}.type", f"{at}.type {kind!r} is not served for a {role}")


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
            raise BadParam("item.id", f"an item {item.id!r} already exists")
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
        raise BadParam(param, f"no item {str(item_id)[:64]!r} in the conversation")

    def get(self, item_id: Any, param: str = "item_id") -> Item:
        return self.items[self.index(item_id, param)]

    def delete(self, item_id: Any) -> Item:
        return self.items.pop(self.index(item_id, "item_id"))


@dataclass(frozen=True)
class TurnRequest:
    """What one response on request answers with."""

    instructions: str
    items: list[Item]
    speaks: bool
    ref_audio: bytes
    max_tokens: int | None


def chat_input(request: TurnRequest) -> ChatInput:
    """The chat turn that answers the conversation `request.items`."""
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage("system", (TextPart(request.instructions),)))
    messages += [item.message() for item in request.items]
    if not messages or messages[-1].role != "user":
        raise InvalidEvent("the conversation must end with a user item to answer")
    check_messages(tuple(messages))
    return ChatInput(
        messages=tuple(messages),
        streaming=True,
        generation=Generation(max_new_tokens=request.max_tokens),
        tts=TtsOptions(enabled=request.speaks, ref_audio=request.ref_audio),
    )
