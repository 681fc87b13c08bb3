"""A duplex session's values: what it starts with and its limits, what each unit gives,
its usage, and how it ends. Plain data; the unit loop (worker.session) makes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Why a session ended and its token usage: the types the edge shares (common's).
from omnifabric.common.close_reasons import CloseReason as CloseReason
from omnifabric.common.session_types import Usage as Usage
from omnifabric.worker.engine import DuplexSettings, GenerateResult, ToolChoice, ToolSpec


@dataclass(frozen=True)
class SessionSpec:
    """What a session starts with (SessionStart, decoded)."""

    session_id: str
    lease_id: str
    mode: str
    system_prompt: str = ""
    ref_audio: np.ndarray | None = None
    tts_ref_audio: np.ndarray | None = None
    settings: DuplexSettings = field(default_factory=DuplexSettings)
    trace_context: Any = None
    """OpenTelemetry context of the caller (the edge's session span), or None."""
    resume_grace_s: float = 0.0
    """> 0: a stream that ends without close leaves the session detached this long."""
    client_state: bytes = b""
    """The sender's own state, handed back on resume (opaque here)."""
    tools: tuple[ToolSpec, ...] = ()
    """Functions the model may call (EngineSession.offer_tools)."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    early_results: bool = False
    """The sender takes results between units (SessionStart.early_results): what a
    finalize makes goes out as soon as it is made (UnitOutput.early)."""
    speech_cuts: bool = False
    """The sender cuts a unit short where speech stops (SessionStart.speech_cuts):
    EngineSession.speech_cuts."""


@dataclass(frozen=True)
class SessionLimits:
    """Limits of one session: duration from its start, the context cap in tokens, and the
    longest engine call of one unit (None: unbounded)."""

    duration_s: float
    max_context_tokens: int
    unit_timeout_s: float | None = None
    journal_results: int | None = None
    """Results the resume journal keeps whole (None: worker.journal.JOURNAL_RESULTS)."""


@dataclass
class UnitTimings:
    """Milliseconds spent on one unit (common.proto UnitTimings)."""

    prefill_ms: float = 0.0
    generate_ms: float = 0.0
    finalize_wait_ms: float = 0.0
    wall_clock_ms: float = 0.0
    queue_ms: float = 0.0
    engine_busy_ms: float = 0.0
    """Of queue_ms, the time the engine still computed this session's earlier unit."""
    engine_costs_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class UnitOutput:
    """The result of one served unit, as handed to the sender."""

    seq: int
    result: GenerateResult
    timings: UnitTimings
    usage: Usage
    """Cumulative snapshot after this unit."""
    dropped_seqs: list[int]
    buffered: bool = False
    """The unit's audio waits for the next model unit (re-chunking) or was heard with a
    later unit (a half-duplex join): no model step ran for it."""
    late: bool = False
    """Its result left later than one unit length after the unit arrived (headroom.is_late)."""
    audio_dropped: bool = False
    """Kept for a replay without its speech (beyond worker.journal.JOURNAL_AUDIO_RESULTS)."""
    pruned: bool = False
    """Replayed from its shape alone (beyond worker.journal.JOURNAL_RESULTS): its text and
    speech are stand-ins, its figures zero."""
    early: bool = False
    """Made by the finalize of unit `seq` after that unit's result went out (a reply's
    first piece begun there): it answers no unit (EngineSession.early_sink)."""


@dataclass
class SessionEnd:
    """The session is over and freed; always the last event."""

    reason: CloseReason
    message: str
    """The reason's sentence (common.close_reasons), with the detail of this end if any."""
    usage: Usage
    units_served: int
    units_dropped: int
    error_code: str = ""
    """Public error code: "inference_error" when the engine failed on a unit."""
    late_units: int = 0
    """Units whose result left later than one unit length after they arrived (is_late)."""


@dataclass(frozen=True)
class UnitTrace:
    """What a unit's spans are built from once its finalize is done."""

    received_at: float
    started: float
    output: UnitOutput
    length_s: float
    """Seconds of input the unit carried."""
    engine_s: float = 0.0
    """Engine seconds its prefill and generate were charged (UnitRun.engine_s)."""
