"""The one narrow engine interface, shaped like MiniCPM-o 4.5's duplex API.

The same unit loop drives every engine (synthetic, reference, minicpmo). Engine calls are
blocking and run on the worker's engine threads, never on the event loop. The engines
import this module; the registry that maps names to them is worker.engines.registry.

Where the unit loop hands a unit to the engine is a UnitRunner: worker.runner.TimeSliced
serves each session's units one by one; an engine that serves one unit of several sessions
in one call offers a Stepper (Engine.stepper), which worker.batcher.StepBatcher drives.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# What a session asks of an engine and what an engine accepts: the types the edge and the
# scheduler share (common's); the worker refuses requests outside them (worker.service).
from omnifabric.common.session_types import DuplexSettings as DuplexSettings
from omnifabric.common.session_types import EngineLimits as EngineLimits
from omnifabric.common.tools import ToolCall as ToolCall
from omnifabric.common.tools import ToolChoice as ToolChoice
from omnifabric.common.tools import ToolSpec as ToolSpec
from omnifabric.worker.errors import EngineStuck, EngineUnavailable
from omnifabric.worker.headroom import CHAT_COST
from omnifabric.worker.units import UnitInput

#: Input audio rate (prefill) and output audio rate (generate), Hz.
INPUT_RATE = 16000
OUTPUT_RATE = 24000


@dataclass
class GenerateResult:
    """What the engine did with one unit (MiniCPM-o's duplex_generate keys)."""

    is_listen: bool
    text: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    """float32 mono at 24 kHz; empty when listening."""
    end_of_turn: bool = False
    kv_cache_length: int = 0
    costs_ms: dict[str, float] = field(default_factory=dict)
    """Stage costs: llm, tts_prep, tts, token2wav, all (engine-specific keys)."""
    n_tokens: int = 0
    n_tts_tokens: int = 0
    input_audio_tokens: int = 0
    """Input tokens this unit added to the context, by kind (for usage)."""
    input_vision_tokens: int = 0
    input_transcript: str = ""
    """What the engine heard the user say, on the unit where it took the user's turn
    (engines with a recognizer of their own; empty otherwise)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Functions the model calls with this unit (offer_tools); its turn ends with them and
    it waits for their outputs (tool_output)."""
    reply_start_ms: dict[str, float] = field(default_factory=dict)
    """On the unit that sends a reply's first piece, where the time from the end of the
    user's speech went (engines that know it; REPLY_START_PARTS)."""
    reply_start_how: str = ""
    """On that unit, how the reply started (REPLY_START_HOW)."""


#: The parts of a reply's start (GenerateResult.reply_start_ms, the worker's
#: omni_worker_reply_start_seconds): ``endpoint`` the silence after the user's last words
#: before the engine took the turn (stream time); ``asr``, ``llm`` (the turn's prefill and
#: the reply's first piece) and ``tts`` (its speech) the compute on the way to the first
#: audio, what was done ahead not counted.
REPLY_START_PARTS = ("endpoint", "asr", "llm", "tts")
#: How a reply started: in the unit that ended the user's turn (``inline``), in that unit's
#: finalize with the next unit speaking (``finalize``), or on a guess a finalize made
#: before the turn ended (``guess``).
REPLY_START_HOW = ("inline", "finalize", "guess")


@dataclass(frozen=True)
class ChatMessage:
    """One chat message: parts in order; str = text, np.ndarray = 16 kHz float32 audio,
    bytes = an image file. Role system, user, assistant, or tool: a function's output (its
    text part), answering the assistant's call `tool_call_id`."""

    role: str
    parts: tuple[str | np.ndarray | bytes, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's function calls."""
    tool_call_id: str = ""


@dataclass(frozen=True)
class ChatTurn:
    """One turn-based request: the whole client-managed history, last message the user's."""

    messages: tuple[ChatMessage, ...]
    max_new_tokens: int = 512
    speech: bool = False
    temperature: float | None = None
    top_p: float | None = None
    length_penalty: float | None = None
    max_slice_nums: int | None = None
    tts_mode: str = "default"
    language: str = ""
    voice: np.ndarray | None = None
    """TTS reference voice, 16 kHz float32."""
    use_image_id: bool | None = None
    omni_mode: bool = False
    enable_thinking: bool = False
    tools: tuple[ToolSpec, ...] = ()
    """Functions the reply may call (common.tools); none: it answers in words only."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


@dataclass(frozen=True)
class ChatChunk:
    """A piece of a chat reply. The first chunk of a turn has prefilled=True (no text yet);
    the last has done=True with the token counts and what the engine could not use."""

    text: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    prefilled: bool = False
    done: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    cut: bool = False
    """The reply reached max_new_tokens."""
    ignored: tuple[str, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    """Function calls the reply makes (each checked against its ToolSpec's schema); the
    reply ends with them (the done chunk follows)."""


class EngineSession(abc.ABC):
    """One duplex session on an engine. Calls come from one thread at a time, in order:
    prepare, then (prefill, generate, finalize) per unit, then stop and close."""

    notes: tuple[str, ...] = ()
    """Set by prepare: what the engine could not do as the session asked (said once in
    session.created), for example a reference voice it cannot clone."""

    early_sink: Callable[[GenerateResult], None] | None = None
    """Set by the unit loop before prepare when the sender takes results between units
    (SessionSpec.early_results). An engine whose finalize begins a reply may hand the
    reply's first piece here, from the finalize's thread, as soon as it is made: it goes
    out at once as a result of its own instead of with the next unit's, which goes on
    from it. None: everything goes out with a unit's result."""

    speech_cuts: bool = False
    """Set by the unit loop before prepare (SessionSpec.speech_cuts): the sender cuts a
    unit short where speech stops in it, so a unit that ended in speech is followed within
    a few tenths of a second by the one with the words' end (where this engine takes units
    as they come: unit_samples() None)."""

    def unit_samples(self) -> tuple[int, int] | None:
        """(first, every later) unit length in 16 kHz samples the engine needs exactly, or
        None when it takes any length. The worker re-chunks client units to it."""
        return None

    def offer_tools(self, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> tuple[str, ...]:
        """Functions the session's model may call (after prepare, before the first unit);
        returns notes for session.created. By default the engine calls none and says so."""
        if not tools:
            return ()
        return ("tools: this engine does not call functions in duplex sessions",)

    def tool_output(self, call_id: str, output: str) -> None:
        """A function's output for a call the model made (GenerateResult.tool_calls), given
        before the next unit's prefill; the model goes on from it. By default ignored."""
        return None

    @abc.abstractmethod
    def prepare(
        self,
        system_prompt: str,
        ref_audio: np.ndarray | None,
        tts_ref_audio: np.ndarray | None,
        config: DuplexSettings,
    ) -> int:
        """Reset and prefill the system prompt; returns the prompt length in tokens."""

    @abc.abstractmethod
    def prefill(
        self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int
    ) -> dict[str, float]:
        """Feed one unit: float32 PCM at 16 kHz and JPEG frames. Returns costs in ms."""

    @abc.abstractmethod
    def generate(self, force_listen: bool) -> GenerateResult:
        """Decide to listen or speak for the unit just prefilled."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Close the unit (terminators, sliding window); must precede the next prefill."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop any generation in progress."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free every per-session resource (KV cache, TTS caches). Idempotent."""

    @property
    def replying(self) -> bool:
        """The session is inside a reply after its last unit's finalize. A reply that a
        listening unit's finalize started (its result had gone out already) makes that unit
        count as a speaking one for the real-time headroom (worker.headroom)."""
        return False


@dataclass(slots=True)
class UnitRun:
    """What running one unit gave the unit loop."""

    costs_ms: dict[str, float]
    """The engine's stage costs (prefill's; the result carries generate's)."""
    result: GenerateResult
    prefill_ms: float
    generate_ms: float
    started: float
    """When the prefill started (time.perf_counter())."""
    engine_s: float
    """Engine seconds charged to the unit (the real-time headroom): its prefill and
    generate; in a batched step, its share of the step."""


@dataclass(frozen=True, slots=True)
class StepRow:
    """One session's unit in a batched step."""

    session: EngineSession
    pcm: np.ndarray
    frames: list[bytes]
    max_slice_nums: int
    force_listen: bool


@dataclass(slots=True)
class StepOutcome:
    """What one step gave: per row, its prefill costs and result, or the exception that
    failed that row alone; and the step's times by phase (ms; "prefill" and "generate" at
    least, the engine's own phases beside them)."""

    rows: list[tuple[dict[str, float], GenerateResult] | Exception]
    phases_ms: dict[str, float]


class Stepper(abc.ABC):
    """An engine's batched entry: one call serves one unit of every session in it.

    Calls come one at a time (a step, or a batch of finalizes), on an engine thread. Each
    session keeps EngineSession's order: its unit's finalize comes before its next step."""

    @abc.abstractmethod
    def step(self, rows: Sequence[StepRow]) -> StepOutcome:
        """Prefill and generate one unit of every row, together."""

    def added_cost(self, session_cost: float) -> float:
        """What one more session adds to the step's engine time, given what one costs (its
        share of a step): by default all of it, as if time-sliced (the safe side)."""
        return session_cost

    def finalize(self, sessions: Sequence[EngineSession]) -> list[Exception | None]:
        """The deferred finalize of every session's last unit (by default one after another);
        per session, None or the exception that failed it."""
        failed: list[Exception | None] = []
        for session in sessions:
            try:
                session.finalize()
                failed.append(None)
            except Exception as exc:  # noqa: BLE001 - the session's own failure
                failed.append(exc)
        return failed


class RunnerSession(Protocol):
    """What a UnitRunner sees of a duplex session (worker.session.DuplexSession)."""

    @property
    def session_id(self) -> str: ...

    @property
    def engine_session(self) -> EngineSession | None:
        """The session on the engine (None once freed)."""

    def stuck(self, what: str, call: Future[Any], timeout_s: float) -> EngineStuck:
        """An engine call for the session (`what`) overran the unit timeout and goes on in
        its thread (`call`): the session frees its engine session only once it returns.
        Returns the error the runner raises to the unit loop."""


class UnitRunner(abc.ABC):
    """Where a session's unit loop hands a unit to the engine (on the event loop).

    The unit loop keeps the order: a session's next run starts once its previous
    finalize is done. A runner bounds its engine calls by the unit timeout: one that
    overruns raises the error `session.stuck` gives (EngineStuck); any other failure
    raises as it is."""

    @abc.abstractmethod
    def run(
        self, session: RunnerSession, unit: UnitInput, force_listen: bool, max_slices: int
    ) -> Awaitable[UnitRun]:
        """Prefill `unit` (frames at `max_slices` slices) and generate for `session`."""

    @abc.abstractmethod
    def finalize(self, session: RunnerSession, seq: int) -> Awaitable[float]:
        """Finalize `session`'s last unit (`seq`, deferred behind its result); gives the
        engine seconds it took (a wait for a free engine thread left out)."""


@dataclass(frozen=True)
class KvFigures:
    """An engine's KV cache kept in slots allocated at start (one per session served at
    once), as the worker reports it (registration, /status)."""

    slots: int
    slot_tokens: int
    """Tokens one slot holds."""
    slot_bytes: int
    """Bytes one slot takes (every layer's keys and values)."""
    more_slots: int
    """Slots more the device's free memory would hold now (CUDA; 0 elsewhere)."""


class Engine(abc.ABC):
    """A loaded model that opens duplex sessions."""

    name: str = "engine"
    default_slots: int = 1
    """Sessions held at once unless the config says otherwise."""
    slots_from_warmup: bool = False
    """Unless the config says otherwise, hold as many sessions as keep real time by the
    warm-up's measure (worker.runtime), not default_slots."""
    concurrency: int = 1
    """Threads that may call the engine at once (GPU engines: 1)."""
    parallel_units: int | None = None
    """Units the engine computes at once at full speed, when it measured that at warm-up
    (threads that share a few cores each slow the other down): the real-time headroom's
    engine threads. None: `concurrency`."""
    modes: frozenset[str] = frozenset({"audio"})
    """Modes served: "audio", "video"."""
    limits: EngineLimits = EngineLimits()
    """What the engine accepts (slices per frame, unit lengths); an engine with other
    bounds sets its own."""

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights; blocking, called once before warmup."""

    def cost_estimate(self, mode: str, warmup_s: float) -> float:
        """Engine seconds one session of `mode` costs per second of its input, before the
        worker measured any (worker.headroom): by default `warmup_s`, what the warm-up's one
        second of audio took; a chat turn holds one engine thread."""
        return CHAT_COST if mode == "chat" else warmup_s

    def added_cost(self, session_cost: float) -> float:
        """What one more session adds to the engine's time, given what one costs: all of it
        on an engine that serves sessions one after another (time-sliced); a batched engine
        adds a fraction."""
        return session_cost

    @abc.abstractmethod
    def open_session(self, session_id: str, mode: str) -> EngineSession:
        """A new session in `mode` ("audio" or "video")."""

    def slowest_call_s(self) -> float | None:
        """Seconds the dearest engine call of a unit (its prefill and generate, or its
        finalize) takes on this host by the engine's own measures so far; None (the
        default) where it measures none. The worker takes a call as stuck only past a
        multiple of this, where that is longer than its configured unit timeout
        (worker.config.STUCK_MULTIPLE)."""
        return None

    def stepper(self) -> Stepper | None:
        """The batched entry, asked once when the worker starts: None (the default) when the
        engine serves sessions one by one (worker.runner.TimeSliced)."""
        return None

    def kv_figures(self) -> KvFigures | None:
        """The engine's KV slots, where it allocates them at start (None: it does not)."""
        return None

    def chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """Turn-based chat (engines whose `modes` include "chat"): a prefilled chunk, reply
        chunks, then a done chunk. Blocking; runs on an engine thread."""
        raise EngineUnavailable(f"engine {self.name!r} does not serve chat")

    def warmup(self) -> GenerateResult:
        """Run one real unit through a full session (open, prepare, prefill, generate,
        finalize, stop, close) so the first client does not pay for lazy initialization."""
        session = self.open_session("warmup", "audio")
        try:
            session.prepare("", None, None, DuplexSettings())
            t = np.arange(INPUT_RATE, dtype=np.float32) / INPUT_RATE
            session.prefill((0.1 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32), [], 1)
            result = session.generate(False)
            session.finalize()
            session.stop()
            return result
        finally:
            session.close()
