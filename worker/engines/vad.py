"""Voice activity with silero-vad (TorchScript model shipped in the `silero-vad` package), and
the user's utterances it delimits: what every engine that finds the end of the user's turn by
voice activity shares (the reference engine's turns, minicpmo's half-duplex calls).

The TorchScript model keeps recurrent state between windows, so every session gets its
own instance (loading one costs ~35 ms and ~2 MB).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Self

import numpy as np
import torch

RATE = 16000
#: silero-vad at 16 kHz takes windows of exactly 512 samples (32 ms).
WINDOW = 512
WINDOW_S = WINDOW / RATE


def model_path() -> Path:
    """The package's silero_vad.jit, located without importing the package (its import
    changes torch's thread count)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed: pip install silero-vad==6.2.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.jit"
    if not path.exists():
        raise RuntimeError(f"silero-vad model file missing: {path}")
    return path


class VoiceActivity:
    """Per-session speech detector: speech probability for each 32 ms window."""

    def __init__(self, path: Path | None = None, threshold: float = 0.5) -> None:
        self.threshold = threshold
        with warnings.catch_warnings():
            # The package ships TorchScript; torch 2.13 warns that jit.load is deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            # Always CPU, also when the engine runs on CUDA: 32 ms windows one at a time would
            # spend more on transfers than on the ~2 MB model.
            self._model = torch.jit.load(str(path or model_path()), map_location="cpu")
        self._model.eval()
        self._carry = np.zeros(0, np.float32)

    def windows(self, pcm: np.ndarray) -> np.ndarray:
        """Speech flags (bool) for each whole 512-sample window of `pcm`; a remainder is
        carried into the next call so windows stay aligned across units."""
        audio = np.concatenate([self._carry, pcm.astype(np.float32, copy=False)])
        n = audio.size // WINDOW
        self._carry = audio[n * WINDOW :].copy()
        flags = np.zeros(n, dtype=bool)
        with torch.inference_mode():
            for i in range(n):
                chunk = torch.from_numpy(audio[i * WINDOW : (i + 1) * WINDOW].copy())
                flags[i] = float(self._model(chunk, 16000)) >= self.threshold
        return flags

    def reset(self) -> None:
        """Forget the recurrent state (a new utterance context)."""
        self._model.reset_states()
        self._carry = np.zeros(0, np.float32)


@dataclass(frozen=True)
class UtteranceRules:
    """Where an utterance starts and ends, in seconds (the defaults are the reference
    engine's; see omnifabric.worker.engines.reference.turns)."""

    min_speech_s: float = 0.3
    """Speech needed before a pause can end the user's turn."""
    end_silence_s: float = 0.9
    """Silence after speech that ends the user's turn whatever was said."""
    quick_silence_s: float = 0.2
    """Silence at a unit's end that ends the turn when the words read as finished (0.2 s
    answers 0.11 s sooner on average than 0.3 s, with no question split on 144 spoken
    questions)."""
    pre_roll_s: float = 0.25
    """Audio kept before the first speech window, so the listener hears the onset."""
    tail_s: float = 0.3
    """Silence after the last speech window kept with the utterance."""
    max_utterance_s: float = 25.0
    """Longer user turns end once they reach this (Whisper takes 30 s)."""

    def tuned(self, min_speech_ms: int | None, end_silence_ms: int | None) -> Self:
        """These rules with a session's own speech minimum and end-of-turn silence (None
        keeps the default); the quick end never waits longer than the silence asked for."""
        rules = self
        if min_speech_ms is not None:
            rules = replace(rules, min_speech_s=min_speech_ms / 1000)
        if end_silence_ms is not None:
            end = end_silence_ms / 1000
            rules = replace(
                rules, end_silence_s=end, quick_silence_s=min(rules.quick_silence_s, end)
            )
        return rules


class TurnTracker:
    """Follows one user's utterances window by window (VAD flags in, finished audio out)."""

    def __init__(self, rules: UtteranceRules, window: int) -> None:
        self.rules = rules
        self.window = window
        self.window_s = window / RATE
        self.utterance: list[np.ndarray] = []
        self.samples = 0
        self.speech_end = 0
        """Samples of the utterance up to the end of its last speech window."""
        self.pre_roll = np.zeros(0, np.float32)
        self.speech_s = 0.0
        self.silence_s = 0.0
        self.ended: np.ndarray | None = None
        """A finished utterance waiting to be taken (audio up to tail_s after the speech)."""
        self.serial = 0
        """Counts the utterances started: with speech_end, it names the speech heard so far
        (a transcript of it holds while only silence follows): key()."""
        self.ended_key: tuple[int, int] | None = None
        """key() of the finished utterance waiting in ``ended``."""

    @property
    def started(self) -> bool:
        return bool(self.utterance)

    def feed(self, pcm: np.ndarray, flags: np.ndarray) -> None:
        """One unit's windows and their speech flags."""
        rules = self.rules
        for i, speech in enumerate(flags):
            window = pcm[i * self.window : (i + 1) * self.window]
            if not self.started:
                if speech:
                    self.serial += 1
                    self.utterance = [self.pre_roll, window]
                    self.samples = self.pre_roll.size + window.size
                    self.speech_end = self.samples
                    self.speech_s, self.silence_s = self.window_s, 0.0
                else:
                    keep = int(rules.pre_roll_s * RATE)
                    self.pre_roll = np.concatenate([self.pre_roll, window])[-keep:]
                continue
            self.utterance.append(window)
            self.samples += window.size
            if speech:
                self.speech_s += self.window_s
                self.silence_s = 0.0
                self.speech_end = self.samples
            else:
                self.silence_s += self.window_s
                if self.silence_s >= rules.end_silence_s:
                    if self.speech_s >= rules.min_speech_s:
                        self.ended, self.ended_key = self.audio(), self.key()
                    self.reset()  # the turn, or a click or breath that was not one
            if self.started and self.samples >= rules.max_utterance_s * RATE:
                self.ended, self.ended_key = self.audio(), self.key()
                self.reset()

    def audio(self) -> np.ndarray:
        """The current utterance up to tail_s after its last speech."""
        whole = np.concatenate(self.utterance) if self.utterance else np.zeros(0, np.float32)
        return whole[: self.speech_end + int(self.rules.tail_s * RATE)]

    def key(self) -> tuple[int, int]:
        """Names the current utterance's speech so far: the same key, the same speech (only
        silence may have been added since)."""
        return (self.serial, self.speech_end)

    def may_end(self) -> bool:
        """The utterance has enough speech and the unit ended in enough silence for the
        quick end (when the words read as finished)."""
        return (
            self.started
            and self.speech_s >= self.rules.min_speech_s
            and self.silence_s >= self.rules.quick_silence_s
        )

    def take_ended(self) -> np.ndarray | None:
        audio, self.ended = self.ended, None
        return audio

    def take_current(self) -> np.ndarray:
        audio = self.audio()
        self.reset()
        return audio

    def reset(self) -> None:
        self.utterance = []
        self.samples = self.speech_end = 0
        self.speech_s = self.silence_s = 0.0
        self.pre_roll = np.zeros(0, np.float32)
