"""Transport-neutral session events and commands: what flows between a client
adapter (WebSocket JSON or gRPC) and the edge's session core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from omnifabric.common import close_reasons

# A session's validated duplex config (None = the engine's default) and its cumulative token
# usage in the SDK's shape: the types the worker shares (common's).
from omnifabric.common.session_types import DuplexSettings as DuplexSettings
from omnifabric.common.session_types import Usage as Usage
from omnifabric.common.tools import ToolCall, ToolChoice, ToolSpec
from omnifabric.edge.chat_input import ChatInput


class Dialect(enum.Enum):
    """The two public JSON dialects; chosen by the client's first init event."""

    FIRST = "session.update"  # audio-duplex-protocol.txt
    CURRENT = "session.init"  # realtime-overview.txt


MODES = ("audio", "video")

# Close reasons, as the worker proto enumerates them (names without the prefix), and the
# edge's own pause_timeout (a client reason); each one's sentence: common.close_reasons.
USER_STOP = close_reasons.USER_STOP
TIMEOUT = close_reasons.TIMEOUT
CONTEXT_FULL = close_reasons.CONTEXT_FULL
SERVER_SHUTDOWN = close_reasons.SERVER_SHUTDOWN
ERROR = close_reasons.ERROR
CLIENT_CLOSED = close_reasons.CLIENT_CLOSED
#: Another connection resumed the session (resumable sessions).
SUPERSEDED = close_reasons.SUPERSEDED


@dataclass(frozen=True)
class InitCommand:
    """session.init / session.update."""

    dialect: Dialect
    system_prompt: str = ""
    config: DuplexSettings = field(default_factory=DuplexSettings)
    ref_audio: bytes = b""
    tts_ref_audio: bytes = b""
    max_slice_nums: int = 1
    ref_audio_id: str = ""
    """A registered voice (/api/assets/ref_audio) instead of ref_audio: the edge fills
    ref_audio from it before the session starts."""
    tools: tuple[ToolSpec, ...] = ()
    """Functions the model may call (common.tools), and how."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    tts_ref_audio_id: str = ""
    early_results: bool | None = None
    """The client asked to take output between units (gRPC SessionInit.early_results);
    None: its dialect's Traits.early_results decides."""
    speech_cuts: bool | None = None
    """The client cuts units short where speech stops (gRPC SessionInit.speech_cuts); None:
    the edge's own cadence says whether it does (Cadence.speech_cuts)."""


@dataclass(frozen=True)
class AppendCommand:
    """One unit of input: decoded float32 PCM bytes and JPEG frames."""

    pcm: bytes
    frames: tuple[bytes, ...] = ()
    force_listen: bool = False
    max_slice_nums: int = 0


@dataclass(frozen=True)
class AudioCommand:
    """Client audio of any length for the session's cadence (edge.cadence), which cuts,
    paces and pads it into units: float32 samples at `rate`."""

    samples: np.ndarray = field(compare=False)
    rate: int = 16000


@dataclass(frozen=True)
class ToolOutputCommand:
    """A function's output for a call the session's model made (Output.tool_calls)."""

    call_id: str
    output: str


@dataclass(frozen=True)
class EndTurnCommand:
    """End the model's turn now: the cadence's next unit carries force_listen."""


@dataclass(frozen=True)
class ClearAudioCommand:
    """Drop the audio the cadence holds (the dialect ignores it)."""


@dataclass(frozen=True)
class CloseCommand:
    """session.close; `reason` is the client's own (echoed in the current dialect)."""

    reason: str | None = None


@dataclass(frozen=True)
class PauseCommand:
    """Hold the session open without input for at most `timeout_s` (legacy `pause`)."""

    timeout_s: float
    idle: bool = False
    """An inactivity timer, not a pause the client asked for (half-duplex: restarted by
    every chunk): no Paused event, no log line."""


@dataclass(frozen=True)
class ResumeCommand:
    """End a pause (legacy `resume`); harmless when not paused."""


@dataclass(frozen=True)
class SendCommand:
    """Messages a dialect answers a client event with itself (no session involved: an
    acknowledgement, a conversation item), sent in order with the session's own."""

    messages: tuple[object, ...]


@dataclass(frozen=True)
class TurnCommand:
    """Run one chat turn beside the duplex session, on a slot of its own while it is
    generated; its turn events go back to the dialect. The turn is either a validated
    edge.chat.ChatInput (`chat`) or a chat request body that parse_chat validates."""

    body: dict[str, object] | None = None
    chat: ChatInput | None = None


@dataclass(frozen=True)
class CancelTurnCommand:
    """Stop the chat turn in progress (its worker slot comes back); harmless without one."""


Command = (
    InitCommand
    | AppendCommand
    | AudioCommand
    | EndTurnCommand
    | ClearAudioCommand
    | ToolOutputCommand
    | CloseCommand
    | PauseCommand
    | ResumeCommand
    | SendCommand
    | TurnCommand
    | CancelTurnCommand
)

#: The client reason of a session a pause outlasted (legacy `timeout{pause_timeout}`).
PAUSE_TIMEOUT = close_reasons.PAUSE_TIMEOUT


@dataclass(frozen=True)
class Queued:
    position: int
    queue_length: int
    estimated_wait_s: float
    ticket_id: str
    first: bool


@dataclass(frozen=True)
class QueueDone:
    queue_wait_s: float


@dataclass(frozen=True)
class Created:
    session_id: str
    prompt_length: int
    notes: tuple[str, ...] = ()
    resume_token: str = ""
    """A resumable session's token (given to the client once, never logged)."""
    resume_window_s: float = 0.0
    recording_id: str | None = None
    """The session's recording (edge.recording), None when nothing records it: the driver
    fills it in before the dialect renders the start."""
    unit_samples: tuple[int, int] | None = None
    """(fewest, most) 16 kHz samples per unit the leased worker takes (SessionCore.unit_bounds),
    None where it states none."""
    units_as_sent: bool = False
    """The worker's engine takes units as they come, not re-chunked to its own
    (SessionStarted.units_as_sent): a client may cut a unit short where speech stops."""


@dataclass(frozen=True)
class Output:
    """What the model did with one unit."""

    seq: int
    is_listen: bool
    text: str
    pcm: bytes
    end_of_turn: bool
    kv_cache_length: int
    timings_ms: dict[str, float]
    usage: Usage
    dropped_seqs: tuple[int, ...] = ()
    n_tokens: int = 0
    n_tts_tokens: int = 0
    input_transcript: str = ""
    audio_dropped: bool = False
    """A replayed output whose speech the worker no longer keeps."""
    pruned: bool = False
    """A replayed output the worker keeps as its shape alone: it may be counted (event
    numbers), never sent again."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Functions the model calls with this unit (answered by ToolOutputCommands)."""
    early: bool = False
    """Made by the finalize of unit `seq` after its result (a reply's first piece, sent as
    soon as it was made): it answers no unit (SessionStart.early_results)."""


@dataclass(frozen=True)
class Closed:
    """The session is over. `reason` is one of the close reason names above."""

    reason: str
    usage: Usage
    message: str = ""
    """Why, for people: the reason's sentence (common.close_reasons.close_message)."""
    client_reason: str | None = None
    error_code: str = ""
    """Public error code to report before closing (inference_error), or empty."""


@dataclass(frozen=True)
class Paused:
    """A pause began (or restarted) with this timeout."""

    timeout_s: float


@dataclass(frozen=True)
class Resumed:
    """The pause, if any, is over."""


@dataclass(frozen=True)
class Reattached:
    """A resumed session's new stream: what its start said, then every output it made
    (buffered units left out), for the dialect to replay what the client missed."""

    session_id: str
    prompt_length: int
    notes: tuple[str, ...]
    client_state: bytes
    outputs: tuple[Output, ...]
    resume_token: str
    resume_window_s: float
    last_input_seq: int = 0
    """The last unit the session received: the client resends what came after it."""


@dataclass(frozen=True)
class Expiring:
    """The session's duration limit ends it in `seconds_left` (said once, a minute ahead)."""

    seconds_left: int


SessionEvent = (
    Queued | QueueDone | Created | Output | Closed | Paused | Resumed | Reattached | Expiring
)
