"""The session values edge, worker and scheduler share, each written once: a session's
duplex settings, its token usage and what an engine accepts (common.proto's DuplexConfig,
Usage and EngineLimits as plain data). Why a session ended is common.close_reasons'.

The services import them from here (and name them in their own modules too:
edge.events.DuplexSettings and Usage, worker.engine.DuplexSettings and EngineLimits,
worker.session_types.Usage, scheduler.registry.EngineLimits are these classes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class DuplexSettings:
    """Per-session duplex settings (common.proto DuplexConfig); None = engine default.

    The edge validates them from a client's config (edge.fields.duplex_settings) and sends
    what was set (`given`); the worker decodes them from SessionStart."""

    length_penalty: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    listen_prob_scale: float | None = None
    force_listen_count: int | None = None
    max_new_speak_tokens_per_chunk: int | None = None
    max_kv_tokens: int | None = None
    tts_enabled: bool | None = None
    max_tokens: int | None = None
    vad_threshold: float | None = None
    min_speech_ms: int | None = None
    end_of_turn_silence_ms: int | None = None
    half_duplex: bool | None = None
    max_slice_nums: int = 1
    """Video mode: image slices per frame (within the engine's EngineLimits). Not a
    DuplexConfig field: it travels as SessionStart.max_slice_nums (the edge's from
    InitCommand.max_slice_nums), so `given` leaves it out."""
    seed: int | None = None
    """Seed of the session's sampling (engines that draw per session: the same seed gives
    the same tokens whatever the batch-mates); None: random."""
    context_window: str | None = None
    """How the context slides once full (ContextWindow.mode: off, basic, context); the
    five window settings are the session's own until the worker resolves them against its
    operator's (ContextWindow.for_session): engines get them resolved, never None."""
    window_high_tokens: int | None = None
    window_low_tokens: int | None = None
    window_units: int | None = None
    window_previous_tokens: int | None = None

    def window(self) -> ContextWindow:
        """The session's context window as the worker resolved it (off when unset)."""
        default = ContextWindow()
        return ContextWindow(
            mode=self.context_window or "off",
            high_tokens=self.window_high_tokens or default.high_tokens,
            low_tokens=self.window_low_tokens or default.low_tokens,
            units=self.window_units or default.units,
            previous_tokens=(
                default.previous_tokens
                if self.window_previous_tokens is None
                else self.window_previous_tokens
            ),
        )

    def given(self) -> dict[str, Any]:
        """The DuplexConfig fields set (not None), by name: what a SessionStart's config
        carries (max_slice_nums travels apart)."""
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "max_slice_nums"}

    def vad_note(self) -> tuple[str, ...]:
        """The note of an engine that decides the user's turn without voice activity, when
        the session set voice-activity turn-taking (empty when it set none)."""
        names = [
            k
            for k in ("vad_threshold", "min_speech_ms", "end_of_turn_silence_ms")
            if getattr(self, k) is not None
        ]
        if not names:
            return ()
        return (
            f"{', '.join(names)}: not used; this engine decides the end of the user's turn "
            "itself, not by voice activity",
        )


#: Context windows: what a session does once its context is full.
WINDOW_MODES = ("off", "basic", "context")
#: Tokens a window keeps free under the context cap: a unit (and its reply) fits past the
#: high watermark before the window slides.
WINDOW_MARGIN_TOKENS = 192


@dataclass(frozen=True)
class ContextWindow:
    """How a session's context slides instead of filling up (the public MiniCPM-o code's
    DuplexWindowConfig, in our names; its defaults).

    - off: the session ends with context_full at its cap.
    - basic: once the context passes `high_tokens`, the oldest units are dropped until it
      is at most `low_tokens`.
    - context: once the session holds more than `units` units, the oldest are dropped and
      what the model said in them is carried forward as text (at most `previous_tokens`).

    The system prompt and the reference voice are always kept."""

    mode: str = "off"
    high_tokens: int = 8000
    low_tokens: int = 6000
    units: int = 24
    previous_tokens: int = 500

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def refusal(self, cap: int) -> str:
        """Why this window cannot run under a context cap of `cap` tokens; "" when it can."""
        if self.mode not in WINDOW_MODES:
            return f"context_window: {self.mode!r}; use {', '.join(WINDOW_MODES)}"
        if not self.on:
            return ""
        room = cap - WINDOW_MARGIN_TOKENS
        if self.mode == "basic" and not 0 < self.low_tokens < self.high_tokens <= room:
            return (
                f"window_low_tokens {self.low_tokens} and window_high_tokens "
                f"{self.high_tokens}: need 0 < low < high <= {room} (the context cap "
                f"{cap} less {WINDOW_MARGIN_TOKENS})"
            )
        if self.mode == "context" and (self.units < 1 or self.previous_tokens < 0):
            return "window_units must be >= 1 and window_previous_tokens >= 0"
        return ""

    def within(self, cap: int) -> ContextWindow:
        """The operator's window fitted under a context cap: watermarks above it are
        lowered (high to the cap less the margin, low to three quarters of high)."""
        room = cap - WINDOW_MARGIN_TOKENS
        if self.high_tokens <= room:
            return self
        high = max(room, 2)
        return replace(self, high_tokens=high, low_tokens=min(self.low_tokens, high * 3 // 4))

    def for_session(self, settings: DuplexSettings, cap: int) -> DuplexSettings:
        """The session's settings with its window resolved: what it set over this (the
        operator's) window, checked under the context cap. ValueError naming the setting
        when the result cannot run."""
        high = settings.window_high_tokens or self.high_tokens
        low = settings.window_low_tokens or self.low_tokens
        if settings.window_low_tokens is None and low >= high:
            low = high * 3 // 4  # a session that lowered only its high watermark
        window = ContextWindow(
            mode=settings.context_window or self.mode,
            high_tokens=high,
            low_tokens=low,
            units=settings.window_units or self.units,
            previous_tokens=(
                self.previous_tokens
                if settings.window_previous_tokens is None
                else settings.window_previous_tokens
            ),
        )
        refusal = window.refusal(cap)
        if refusal:
            raise ValueError(refusal)
        return replace(
            settings,
            context_window=window.mode,
            window_high_tokens=window.high_tokens,
            window_low_tokens=window.low_tokens,
            window_units=window.units,
            window_previous_tokens=window.previous_tokens,
        )


#: The parts of usage that add up to a total: part -> its total (each adds to total_tokens
#: too). The image, video and cached input counts break input down further: in no total.
_TOTAL_OF_PART = {
    "input_text_tokens": "input_tokens",
    "input_audio_tokens": "input_tokens",
    "input_vision_tokens": "input_tokens",
    "output_text_tokens": "output_tokens",
    "output_audio_tokens": "output_tokens",
}


@dataclass(init=False)
class Usage:
    """Token usage of a session (or a chat turn) so far, in the SDK's shape (common.proto
    Usage: its fields, by its names, and nothing else in the instance's __dict__).

    The totals are fields: the ones given (a Usage message carries all three), else the sums
    of their parts (input: text + audio + vision; output: text + audio; total: both). Setting
    a part afterwards moves its totals by as much, so a usage the worker counts up part by
    part keeps its totals the sums of its parts."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_text_tokens: int
    input_audio_tokens: int
    input_vision_tokens: int
    input_image_tokens: int
    input_video_tokens: int
    input_cached_tokens: int
    output_text_tokens: int
    output_audio_tokens: int

    def __init__(
        self,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        total_tokens: int | None = None,
        input_text_tokens: int = 0,
        input_audio_tokens: int = 0,
        input_vision_tokens: int = 0,
        input_image_tokens: int = 0,
        input_video_tokens: int = 0,
        input_cached_tokens: int = 0,
        output_text_tokens: int = 0,
        output_audio_tokens: int = 0,
    ) -> None:
        if input_tokens is None:
            input_tokens = input_text_tokens + input_audio_tokens + input_vision_tokens
        if output_tokens is None:
            output_tokens = output_text_tokens + output_audio_tokens
        if total_tokens is None:
            total_tokens = input_tokens + output_tokens
        self.__dict__.update(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            total_tokens=total_tokens,
            input_text_tokens=input_text_tokens,
            input_audio_tokens=input_audio_tokens,
            input_vision_tokens=input_vision_tokens,
            input_image_tokens=input_image_tokens,
            input_video_tokens=input_video_tokens,
            input_cached_tokens=input_cached_tokens,
            output_text_tokens=output_text_tokens,
            output_audio_tokens=output_audio_tokens,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        total = _TOTAL_OF_PART.get(name)
        if total is not None and name in self.__dict__:
            delta = value - self.__dict__[name]
            self.__dict__[total] += delta
            self.__dict__["total_tokens"] += delta
        super().__setattr__(name, value)


@dataclass(frozen=True)
class EngineLimits:
    """What an engine accepts: the one place these numbers are written (common.proto
    EngineLimits). The worker checks requests against them, advertises them in its
    registration and in SessionStarted; the scheduler keeps them as a worker's hello
    declares them and hands them to edges with each lease and in status; edges refuse a
    session or unit outside them before the worker is asked."""

    min_slice_nums: int = 1
    max_slice_nums: int = 2
    """Video mode: image slices per frame, inclusive (session value and unit overrides)."""
    min_unit_samples: int = 4000
    max_unit_samples: int = 64000
    """Unit lengths served, 16 kHz samples, inclusive (1/4 s to 4 s; engines with a fixed
    unit length re-chunk what arrives)."""

    def slices_refusal(
        self, value: int, what: str = "max_slice_nums", taker: str = "this worker"
    ) -> str:
        """Why `value` (0: unset) is outside the slice range, naming it (and `taker`, who
        refuses: the worker, or the server as the edge tells its clients); empty within.
        The one slice rule: the worker and the edge both check with it."""
        if value and not self.min_slice_nums <= value <= self.max_slice_nums:
            return f"{what}: {value}; {taker} takes {self.min_slice_nums} to {self.max_slice_nums}"
        return ""
