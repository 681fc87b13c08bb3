"""The three public code layouts of MiniCPM-o 4.5 and one duplex handle over each.

Which layout a checkpoint directory holds is read from its code (an AST scan, nothing is
imported): the unified class (`modeling_minicpmo_unified.MiniCPMO.init_unified`, the OpenBMB
demo repositories), the HF checkpoint's `MiniCPMO.as_duplex()`, or a `MiniCPMODuplex` that
builds its own model (the demo repositories' `modeling_minicpmo.py`). Each `Handle` is one
duplex state (its own LLM decoder and KV cache) over the one shared model.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.common.session_types import ContextWindow
from omnifabric.worker.errors import EngineUnavailable

#: How the reference server wraps the system prompt around the LLM reference audio (the
#: layouts whose prepare takes the prefix and suffix as given).
PREFIX_TEMPLATE = "<|im_start|>system\n{text}\n<|audio_start|>"
SUFFIX = "<|audio_end|><|im_end|>"

UNIFIED = "unified"
AS_DUPLEX = "as_duplex"
DUPLEX = "duplex"
#: Preference when a directory offers several (the unified class has the richest API:
#: deferred finalize, force_listen_override, length_penalty).
ORDER = (UNIFIED, AS_DUPLEX, DUPLEX)
#: What each layout is, for logs and errors.
DESCRIPTION = {
    UNIFIED: "modeling_minicpmo_unified.MiniCPMO (init_unified, DuplexCapability)",
    AS_DUPLEX: "modeling_minicpmo.MiniCPMO.as_duplex() (the HF checkpoint's code)",
    DUPLEX: "modeling_minicpmo.MiniCPMODuplex (builds the model itself)",
}


#: The public code's DuplexWindowConfig fields for each of our ContextWindow's.
WINDOW_FIELDS = {
    "sliding_window_mode": "mode",
    "basic_window_high_tokens": "high_tokens",
    "basic_window_low_tokens": "low_tokens",
    "context_max_units": "units",
    "context_previous_max_tokens": "previous_tokens",
}


def window_config_class(decoder: Any) -> Any:
    """The public code's DuplexWindowConfig class for `decoder` (a StreamDecoder of the
    code), or None when the decoder has no sliding window this engine can drive: no
    set_window_config / set_window_enabled, or a config without the five fields."""
    setters = ("set_window_config", "set_window_enabled")
    if decoder is None or not all(callable(getattr(decoder, n, None)) for n in setters):
        return None
    module = sys.modules.get(type(decoder).__module__)
    cls = getattr(module, "DuplexWindowConfig", None)
    if cls is None and getattr(decoder, "_window_config", None) is not None:
        cls = type(decoder._window_config)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return cls if set(WINDOW_FIELDS) <= names else None


def _classes(path: Path) -> dict[str, set[str]]:
    """Class name -> method names defined in `path` (empty when the file is missing)."""
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name: {
            item.name
            for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def detect(root: Path) -> list[str]:
    """The layouts the directory's code offers, in order of preference."""
    stock = _classes(root / "modeling_minicpmo.py")
    unified = _classes(root / "modeling_minicpmo_unified.py")
    found = []
    if "init_unified" in unified.get("MiniCPMO", set()) and "DuplexCapability" in unified:
        found.append(UNIFIED)
    if "as_duplex" in stock.get("MiniCPMO", set()) and "MiniCPMODuplex" in stock:
        found.append(AS_DUPLEX)
    duplex_api = {"__init__", "prepare", "streaming_prefill", "streaming_generate"}
    if duplex_api <= stock.get("MiniCPMODuplex", set()):  # it builds its own model
        found.append(DUPLEX)
    return found


def choose(root: Path, wanted: str = "auto") -> str:
    """The layout to drive: `wanted`, or the preferred one found. Raises EngineUnavailable
    naming what the directory lacks."""
    found = detect(root)
    if wanted != "auto":
        if wanted not in ORDER:
            raise EngineUnavailable(f"unknown MiniCPM-o API {wanted!r} (choose {', '.join(ORDER)})")
        if wanted not in found:
            raise EngineUnavailable(f"{root} does not offer {DESCRIPTION[wanted]}")
        return wanted
    if not found:
        raise EngineUnavailable(
            f"{root} offers no MiniCPM-o 4.5 duplex API: need modeling_minicpmo.py with "
            "MiniCPMO.as_duplex or MiniCPMODuplex(prepare, streaming_prefill, "
            "streaming_generate), or modeling_minicpmo_unified.py with MiniCPMO.init_unified"
        )
    return found[0]


@contextlib.contextmanager
def suppressed(cls: type, name: str, result: Any = None) -> Iterator[None]:
    """Replace method `name` of `cls` by one returning `result` for the duration (the
    vocoder builders when the vocoder is off, or already built)."""
    original = cls.__dict__.get(name)
    setattr(cls, name, lambda self, *args, **kwargs: result)
    try:
        yield
    finally:
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


class Handle:
    """One duplex state over the shared model: prepare, prefill, generate, finalize."""

    layout = ""

    def __init__(self, duplex: Any) -> None:
        self.duplex = duplex

    @property
    def model(self) -> Any:
        return self.duplex.model

    @property
    def tokenizer(self) -> Any:
        return self.duplex.tokenizer

    def prepare(self, system_prompt: str, ref_audio: np.ndarray | None, voice: str | None) -> None:
        """Reset and prefill the system prompt (plain text), the LLM reference audio and
        the TTS voice (a WAV path)."""
        self.duplex.prepare(
            prefix_system_prompt=PREFIX_TEMPLATE.format(text=system_prompt),
            suffix_system_prompt=SUFFIX,
            ref_audio=ref_audio,
            prompt_wav_path=voice,
        )

    def prefill(self, pcm: np.ndarray, images: list[Any], max_slice_nums: int) -> dict[str, Any]:
        return self.duplex.streaming_prefill(
            audio_waveform=pcm, frame_list=images or None, max_slice_nums=max_slice_nums
        )

    def generate(self, args: dict[str, Any], force_listen: bool) -> dict[str, Any]:
        raise NotImplementedError

    def finalize(self) -> None:
        """Close the unit; the layouts without deferred finalize did it in generate."""

    @property
    def speaking(self) -> bool:
        """The model is inside a turn (a listen now must close it)."""
        return not bool(getattr(self.duplex, "current_turn_ended", True))

    def end_turn(self) -> None:
        """Close the model's turn in the context (`<|turn_eos|>`) and reset the vocoder's
        turn state: what a listen forced mid-speech means."""
        d = self.duplex
        d.total_ids.append(d.turn_eos_token_id)
        d.decoder.feed(d.decoder.embed_token(d.turn_eos_token_id))
        d.current_turn_ended = True
        if getattr(d, "token2wav_initialized", False):
            d._reset_token2wav_for_new_turn()

    def kv_length(self) -> int:
        """Tokens in the decoder's KV cache now (after a slide of its window: what is left;
        the code's positions are compacted with it, so this is also the next position)."""
        return int(self.duplex.decoder.get_cache_length())

    def set_window(self, window: ContextWindow) -> bool:
        """Drive the decoder's own sliding window as `window` says, as the code's duplex
        constructor does from its sliding_window_mode and watermark arguments: a
        DuplexWindowConfig of the five values, enabled unless the mode is off. Must come
        before prepare (the context mode registers the prompt's prefix there). False when
        this layout's decoder has no window (then it stays off)."""
        decoder = getattr(self.duplex, "decoder", None)
        cls = window_config_class(decoder)
        if decoder is None or cls is None:
            return not window.on
        config = cls(**{name: getattr(window, ours) for name, ours in WINDOW_FIELDS.items()})
        decoder.set_window_config(config)
        decoder.set_window_enabled(window.on)
        return True

    @property
    def window_mode(self) -> str:
        """The decoder's sliding window mode ("off" when it has none or it is disabled)."""
        decoder = getattr(self.duplex, "decoder", None)
        config = getattr(decoder, "_window_config", None)
        if config is None or not getattr(decoder, "_window_enabled", True):
            return "off"
        return str(getattr(config, "sliding_window_mode", "off"))

    def reset(self) -> None:
        """Drop everything this handle holds of a session: streaming state, decoder KV
        cache and sliding window, vocoder turn caches, break/stop flags."""
        d = self.duplex
        d._reset_streaming_state()
        d.decoder.reset()
        self.set_window(ContextWindow())  # off: the next session sets its own
        for name in ("clear_break_event", "clear_session_stop"):
            getattr(d, name)()
        for name in ("_prefix_system_prompt", "_suffix_system_prompt", "_ref_audio"):
            if hasattr(d, name):
                setattr(d, name, None)


class UnifiedHandle(Handle):
    """The demo's DuplexCapability: deferred finalize, force_listen_override."""

    layout = UNIFIED

    def generate(self, args: dict[str, Any], force_listen: bool) -> dict[str, Any]:
        return self.duplex.streaming_generate(**args, force_listen_override=force_listen)

    def finalize(self) -> None:
        if getattr(self.duplex, "_pending_finalize", None) is not None:
            self.duplex.finalize_unit()

    def end_turn(self) -> None:
        """force_listen_override closes the turn itself (it feeds `<|turn_eos|>`)."""


class DuplexHandle(Handle):
    """MiniCPMODuplex (both the HF as_duplex object and the demo's own class): finalize
    runs inside generate; it takes no length_penalty and no per-call force_listen, so a
    forced listen goes through its startup counter for exactly one call."""

    layout = DUPLEX
    #: streaming_generate arguments this class does not take.
    UNSUPPORTED = ("length_penalty",)

    def generate(self, args: dict[str, Any], force_listen: bool) -> dict[str, Any]:
        d = self.duplex
        call = {k: v for k, v in args.items() if k not in self.UNSUPPORTED}
        if not force_listen:
            d.force_listen_count = 0
            return d.streaming_generate(**call)
        d.force_listen_count = int(getattr(d, "_streaming_generate_count", 0)) + 1
        try:
            return d.streaming_generate(**call)
        finally:
            d.force_listen_count = 0


class AsDuplexHandle(DuplexHandle):
    """The HF checkpoint's as_duplex object: its prepare wraps the prompt itself."""

    layout = AS_DUPLEX

    def prepare(self, system_prompt: str, ref_audio: np.ndarray | None, voice: str | None) -> None:
        self.duplex.prepare(
            prefix_system_prompt=system_prompt, ref_audio=ref_audio, prompt_wav_path=voice
        )


def clone_duplex(first: Any) -> Any:
    """Another duplex state over the same model as `first` (a MiniCPMODuplex or a
    DuplexCapability): shares model, processor and tokenizer; gets its own decoder (LLM KV
    cache), events and streaming state."""
    other = copy.copy(first)
    decoder = first.decoder
    other.decoder = type(decoder)(
        llm=first.model.llm,
        tokenizer=first.tokenizer,
        forbidden_token_ids=list(first.forbidden_token_ids),
    )
    window = getattr(decoder, "_window_config", None)
    if window is not None:
        other.decoder.set_window_config(copy.copy(window))
        other.decoder.set_window_enabled(bool(getattr(decoder, "_window_enabled", False)))
    other.break_event = threading.Event()
    other.session_stop_event = threading.Event()
    other.forbidden_token_ids = list(first.forbidden_token_ids)
    other._reset_streaming_state()
    return other
