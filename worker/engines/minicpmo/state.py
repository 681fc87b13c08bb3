"""Per-session state that the model code keeps on the shared model, swapped per session.

Each duplex handle has its own LLM decoder and KV cache, but pieces of per-stream state live
on the one model object: the audio encoder's streaming cache (`model.audio_past_key_values`,
with `audio_chunk_idx`), the streaming mel processor (`model.processor._streaming_mel_processor`,
replaced by every prepare) and the vocoder's stream caches (`model.tts.audio_tokenizer`).
The model's own turn-based streaming path (`streaming_prefill` / `streaming_generate`, used by
chat turns and half-duplex calls) keeps its whole conversation there too: the LLM's KV cache,
the turn flags, the session id, the round bookkeeping, the voice's vocoder cache and the
tokens of the answer being streamed. The global torch RNG is shared too. A session's values
are put on the model before each of its calls and taken back when another session's call
comes, under the engine's lock; nothing is copied, only references move.
"""

from __future__ import annotations

from typing import Any

#: A value that is no attribute at all (the code tests for the attribute with hasattr).
ABSENT = object()
#: A new session starts from the value the model had before any session ran.
AT_LOAD = object()
#: No value to put: the attribute is left as it is.
KEEP = object()
#: (path from the model, attribute, value of a fresh session; a type builds a new one).
FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("", "audio_past_key_values", None),
    ("", "audio_chunk_idx", 0),
    ("processor", "_streaming_mel_processor", None),
    ("tts.audio_tokenizer", "stream_cache", None),
    ("tts.audio_tokenizer", "hift_cache_dict", None),
    ("tts.audio_tokenizer", "_stream_prompt", None),
    ("tts.audio_tokenizer", "cache", None),
    # The audio feature extractor's log-mel normalization: the streaming mel processor sets
    # it before each of its mels (a fixed floor under 5 s of buffered audio, a dynamic range
    # from then on), and the offline path (the reference audio in prepare, chat audio) uses
    # whatever mode is set. Unswapped, one session's streaming changed the mel of another's
    # reference audio (by up to 0.59 on the tiny checkpoint).
    ("processor.audio_processor", "dynamic_log_norm", AT_LOAD),
    ("processor.audio_processor", "dynamic_range_db", AT_LOAD),
    ("processor.audio_processor", "log_floor_db", AT_LOAD),
    # The streaming chat path (reset_session's fields, and the answer being streamed).
    ("", "llm_past_key_values", None),
    ("", "session_id", None),
    ("", "new_user_msg", True),
    ("", "llm_generated", False),
    ("", "llm_generate_completed", False),
    ("", "tts_last_turn_tokens", None),
    ("", "token2wav_cache", None),
    ("", "streaming_text_preserve", 0),
    ("", "streaming_position_offset", 0),
    ("", "_next_round_id", 0),
    ("", "_pending_round_id", None),
    ("", "_omni_chunk_history", list),
    ("", "_round_history", list),
    ("", "_streaming_generated_token_ids", ABSENT),
    ("", "_last_streaming_text", ABSENT),
)
RNG = "rng"


def _initial(value: Any) -> Any:
    """A fresh session's value (a new list where the field holds one)."""
    return value() if isinstance(value, type) else value


def _put(owner: Any, name: str, value: Any) -> None:
    if value is KEEP:
        return
    if value is ABSENT:
        if hasattr(owner, name):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _owner(model: Any, path: str) -> Any:
    owner = model
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


class SharedState:
    """Moves per-session values on and off the shared model. Not thread-safe: the engine
    calls it under its lock."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._at_load: dict[str, Any] = {}
        """The model's own values of the AT_LOAD fields, read when first asked for (a new
        session's, before any session ran: the engine's warm-up opens the first)."""

    def _first(self, path: str, name: str, value: Any) -> Any:
        """A new session's value of a field."""
        if value is not AT_LOAD:
            return _initial(value)
        key = f"{path}:{name}"
        if key not in self._at_load:
            owner = _owner(self.model, path) if self.model is not None else None
            if owner is None:
                return KEEP
            self._at_load[key] = getattr(owner, name, ABSENT)
        return self._at_load[key]

    def fresh(self) -> dict[str, Any]:
        """The values a new session starts from (the RNG as it is now)."""
        values = {f"{path}:{name}": self._first(path, name, value) for path, name, value in FIELDS}
        values[RNG] = self._rng()
        return values

    def load(self, values: dict[str, Any]) -> None:
        """Put a session's values on the model."""
        for path, name, _ in FIELDS:
            owner = _owner(self.model, path)
            if owner is not None:
                _put(owner, name, values.get(f"{path}:{name}"))
        rng = values.get(RNG)
        if rng is not None:
            self._set_rng(rng)

    def save(self) -> dict[str, Any]:
        """The session values now on the model."""
        values: dict[str, Any] = {}
        for path, name, default in FIELDS:
            owner = _owner(self.model, path)
            values[f"{path}:{name}"] = (
                getattr(owner, name, ABSENT)
                if owner is not None
                else self._first(path, name, default)
            )
        values[RNG] = self._rng()
        return values

    def clear(self) -> None:
        """Drop whatever a session left on the model (its caches become garbage)."""
        for path, name, value in FIELDS:
            owner = _owner(self.model, path)
            if owner is not None and hasattr(owner, name):
                _put(owner, name, self._first(path, name, value))

    @staticmethod
    def _rng() -> tuple[Any, Any]:
        import torch

        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    @staticmethod
    def _set_rng(state: tuple[Any, Any]) -> None:
        import torch

        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(cuda)
