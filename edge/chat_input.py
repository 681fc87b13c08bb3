"""A validated chat request as plain data: the messages and their parts, the generation,
speech and image options, and the functions the reply may call. edge.chat validates
requests into it (parse_chat), the OpenAI dialect builds it directly, the worker client
turns it into the worker's ChatRequest; it imports nothing of the edge, so commands
(edge.events) can carry it."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnifabric.common.tools import ToolCall, ToolChoice, ToolSpec


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    data: bytes
    """An image file (JPEG, PNG, ...), verified readable."""


@dataclass(frozen=True)
class AudioPart:
    pcm: bytes
    """float32 little-endian mono PCM at 16 kHz."""


Part = TextPart | ImagePart | AudioPart


@dataclass(frozen=True)
class ChatMessage:
    role: str
    """system, user, assistant, or tool (a function's output in a text part)."""
    parts: tuple[Part, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's function calls."""
    tool_call_id: str = ""
    """A tool message: the call it answers."""


@dataclass(frozen=True)
class Generation:
    """Sampling options; None: the worker's default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    length_penalty: float | None = None


@dataclass(frozen=True)
class TtsOptions:
    enabled: bool = True
    """False: text only."""
    mode: str = "default"
    ref_audio: bytes = b""
    """Voice reference: float32 16 kHz PCM (empty: the engine's voice)."""
    language: str | None = None


@dataclass(frozen=True)
class ImageOptions:
    """None: the worker's default."""

    max_slice_nums: int | None = None
    use_image_id: bool | None = None


@dataclass(frozen=True)
class ChatInput:
    """A validated chat request, ready for the worker."""

    messages: tuple[ChatMessage, ...]
    streaming: bool
    generation: Generation = field(default_factory=Generation)
    tts: TtsOptions = field(default_factory=TtsOptions)
    image: ImageOptions = field(default_factory=ImageOptions)
    omni_mode: bool = False
    enable_thinking: bool = False
    tools: tuple[ToolSpec, ...] = ()
    """Functions the reply may call (common.tools)."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    notes: tuple[str, ...] = ()
    """Accepted fields that have no effect at the edge or on any engine, and why."""

    @property
    def speech(self) -> bool:
        """The reply is spoken (tts.enabled)."""
        return self.tts.enabled
