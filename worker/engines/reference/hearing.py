"""Two recognizers, one transcript: Whisper base and Moonshine base-en hear every utterance
and, where they disagree, each scores the other's transcript; the one both find likelier wins.

Why two: the recognizers fail on different words. On 240 espeak-ng renders of 40 short
questions (6 voices and rates, low noise), the question's key words survived in 140 of
Whisper base's transcripts and in 140 of Moonshine's, but in 175 of at least one of them
("What do these make?" / "What do bees make?", "the capital and friends" / "the capital of
France"). Picking by the summed log-probability of both models (each transcript forced through
both decoders) kept the key words in 164 (68% against 58%); on a natural Piper voice 38 of 40
against Whisper's 35. Measured with the scratch tools described in the project notes; the
engine's own figures come from `omnifabric eval`.

Whisper stays the silence gate (its no-speech rule and peak gate): Moonshine has no no-speech
estimate, and on silence or noise it is not asked. The confidence returned (for the engine's
"say it again" repair) is the mean of the two models' per-token log-probabilities of the
chosen transcript.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from omnifabric.worker.engines.reference.asr import Transcriber
    from omnifabric.worker.engines.reference.moonshine import Moonshine

_WORD = re.compile(r"[a-z0-9']+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Ears:
    """Whisper and Moonshine together, with Transcriber's ``hear``/``transcribe`` interface.

    Thread-safe as far as the models are: each call keeps its own encodings; the models'
    weights are only read.
    """

    def __init__(self, whisper: Transcriber, moonshine: Moonshine) -> None:
        self.whisper = whisper
        self.moonshine = moonshine
        self.picked = {"agree": 0, "whisper": 0, "moonshine": 0}
        """How often the two agreed, or which one's transcript was taken (for logs/tests)."""
        self.last_timings: dict[str, float] = {}

    def hear(self, audio: np.ndarray) -> tuple[str, float]:
        """The transcript of float32 mono 16 kHz ``audio`` and its confidence (mean token
        log-probability over both models); ("", -inf) for silence."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        t0 = time.perf_counter()
        w_enc = self.whisper.encode(audio)
        if w_enc is None:
            return "", float("-inf")
        w_text, w_mean = self.whisper.decode(w_enc)
        t1 = time.perf_counter()
        if not w_text:
            return "", w_mean  # Whisper's no-speech rule: nothing was said
        m_enc = self.moonshine.encode(audio)
        m_text, m_mean = self.moonshine.decode(m_enc)
        t2 = time.perf_counter()
        if not _words(m_text) or _words(m_text) == _words(w_text):
            self.picked["agree"] += 1
            self.last_timings = _timings(t0, t1, t2)
            return w_text, (w_mean + m_mean) / 2
        # Each transcript forced through both decoders: summed log-probabilities decide.
        scores = {}
        for text in (w_text, m_text):
            w_total, w_n = self.whisper.score(w_enc, text)
            m_total, m_n = self.moonshine.score(m_enc, text)
            scores[text] = (w_total + m_total, (w_total / w_n + m_total / m_n) / 2)
        best = max((w_text, m_text), key=lambda text: scores[text][0])
        self.picked["whisper" if best == w_text else "moonshine"] += 1
        self.last_timings = _timings(t0, t1, t2)
        return best, scores[best][1]

    def transcribe(self, audio: np.ndarray) -> str:
        """``hear`` without the confidence."""
        return self.hear(audio)[0]


def _timings(t0: float, t1: float, t2: float) -> dict[str, float]:
    done = time.perf_counter()
    return {
        "whisper": (t1 - t0) * 1000.0,
        "moonshine": (t2 - t1) * 1000.0,
        "scoring": (done - t2) * 1000.0,
    }
