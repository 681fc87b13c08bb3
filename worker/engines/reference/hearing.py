"""Two recognizers, one transcript: Whisper base and Moonshine base-en hear every utterance
and, where they disagree, each scores the other's transcript; the one both find likelier wins.

Why two: the recognizers fail on different words. On 240 espeak-ng renders of 40 short
questions (6 voices and rates, low noise), the question's key words survived in 140 of
Whisper base's transcripts and in 140 of Moonshine's, but in 175 of at least one of them
("What do these make?" / "What do bees make?", "the capital and friends" / "the capital of
France"). Picking by the summed log-probability of both models kept the key words in 164
(68% against 58%); on a natural Piper voice 38 of 40 against Whisper's 35. A third
recognizer (Whisper tiny.en) added nothing (165), nor did a language model's opinion
(SmolLM2-135M: 167 at best, for ~85 ms).

Cost: the two run at once (Moonshine on a thread of its own; torch releases the GIL). Where
they disagree, each transcript goes once through the other model's decoder, reusing the
cross-attention keys and values of that model's own decoding; a transcript's own model
scored it while decoding it. One core each: 180 ms p50 a question against Whisper's 155 ms.

Whisper stays the silence gate (its peak gate and no-speech rule): Moonshine has no
no-speech estimate, so its transcript of what Whisper calls silence or noise is dropped. The
confidence returned (for the engine's "say it again" repair) is the mean of the two models'
per-token log-probabilities of the chosen transcript.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from difflib import SequenceMatcher
from itertools import product
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnifabric.worker.engines.reference.asr import is_silent

if TYPE_CHECKING:
    from omnifabric.worker.engines.reference.asr import Hypothesis, Transcriber
    from omnifabric.worker.engines.reference.moonshine import Moonshine

_WORD = re.compile(r"[a-z0-9']+")


MAX_SPLITS = 3
"""Blends are made where the two transcripts differ in 2 to this many places (2^n - 2 of
them); more differences mean the two heard different things, not a word or two apart."""


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def blends(first: str, second: str) -> list[str]:
    """Transcripts that take, where ``first`` and ``second`` differ (words compared without
    case or punctuation), one side's words in some places and the other's elsewhere: every
    such mix but the two themselves, when they differ in 2 to ``MAX_SPLITS`` places; else
    none. Each recognizer often mishears a different word of the same question ("How many
    lands does ..." / "How many legs done ..."); the mix of their right words is a
    transcript neither decoded."""
    a, b = first.split(), second.split()
    parts = _differences(a, b)
    places = [i for i, (tag, *_) in enumerate(parts) if tag != "equal"]
    if not 2 <= len(places) <= MAX_SPLITS:
        return []
    out = []
    for picks in product((False, True), repeat=len(places)):
        if all(picks) or not any(picks):
            continue
        take = dict(zip(places, picks, strict=True))
        words: list[str] = []
        for i, (_, i1, i2, j1, j2) in enumerate(parts):
            words.extend(b[j1:j2] if take.get(i) else a[i1:i2])
        out.append(" ".join(words))
    return out


def _differences(a: list[str], b: list[str]) -> list[tuple[str, int, int, int, int]]:
    """``SequenceMatcher``'s opcodes for two word lists (compared by ``_key``), a
    replacement of as many words by as many split word by word (each is a choice)."""
    ops = SequenceMatcher(None, [_key(t) for t in a], [_key(t) for t in b], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in ops.get_opcodes():
        if tag == "replace" and i2 - i1 == j2 - j1:
            out.extend(("replace", i1 + k, i1 + k + 1, j1 + k, j1 + k + 1) for k in range(i2 - i1))
        else:
            out.append((tag, i1, i2, j1, j2))
    return out


def _key(token: str) -> str:
    return "".join(_WORD.findall(token.lower()))


class Ears:
    """Whisper and Moonshine together, with Transcriber's ``hear``/``transcribe`` interface.

    The two recognizers run at once (Moonshine on a thread of its own: torch releases the
    GIL), so an utterance costs about the slower of the two plus the scoring, not their sum.
    Thread-safe as far as the models are: each call keeps its own encodings; the weights are
    only read.
    """

    def __init__(
        self,
        whisper: Transcriber,
        moonshine: Moonshine,
        threads: int = 2,
        *,
        blend: bool = True,
    ) -> None:
        self.whisper = whisper
        self.moonshine = moonshine
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moonshine")
        self.blend = blend
        """Whether transcripts mixed of the two (``blends``) are scored too."""
        self.picked = {"agree": 0, "whisper": 0, "moonshine": 0, "blend": 0}
        """How often the two agreed, or which one's transcript was taken (for logs/tests)."""
        self.last_timings: dict[str, float] = {}

    def _moonshine(self, audio: np.ndarray) -> tuple[torch.Tensor, Hypothesis, float]:
        t0 = time.perf_counter()
        enc = self.moonshine.encode(audio)
        found = self.moonshine.hypothesis(enc)
        return enc, found, (time.perf_counter() - t0) * 1000.0

    def hear(self, audio: np.ndarray, context: str | None = None) -> tuple[str, float]:
        """The transcript of float32 mono 16 kHz ``audio`` and its confidence (mean token
        log-probability over both models); ("", -inf) for silence. ``context``: words the
        speaker may use, as Whisper's prompt (``Transcriber.prompt_for``); Moonshine takes
        none."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if is_silent(audio):
            return "", float("-inf")
        t0 = time.perf_counter()
        moon = self._pool.submit(self._moonshine, audio)
        w_enc = self.whisper.encode(audio)
        w = None if w_enc is None else self.whisper.hypothesis(w_enc, context)
        whisper_ms = (time.perf_counter() - t0) * 1000.0
        m_enc, m, moonshine_ms = moon.result()
        t1 = time.perf_counter()
        timings = {"whisper": whisper_ms, "moonshine": moonshine_ms, "both": (t1 - t0) * 1000.0}
        if w_enc is None or w is None or not w.text:
            return "", float("-inf") if w is None else w.mean  # Whisper: nothing was said
        if not _words(m.text) or _words(m.text) == _words(w.text):
            self.picked["agree"] += 1
            self.last_timings = {**timings, "scoring": 0.0}
            return w.text, (w.mean + m.mean) / 2
        text, confidence, source = self.choose(w, m, w_enc, m_enc, context)
        self.last_timings = {**timings, "scoring": (time.perf_counter() - t1) * 1000.0}
        self.picked[source] += 1
        return text, confidence

    def choose(
        self,
        w: Hypothesis,
        m: Hypothesis,
        w_enc: torch.Tensor,
        m_enc: torch.Tensor,
        context: str | None = None,
    ) -> tuple[str, float, str]:
        """Of two transcripts that differ, and their ``blends``, the one with the highest
        summed log-probability over both models; with its confidence (the mean of the two
        models' per-token means) and where it came from ("whisper", "moonshine", "blend").

        Each transcript is forced through the other model's decoder (reusing the
        cross-attention keys and values of that model's decoding: ``w``'s and ``m``'s
        ``cross``); its own model gave its log-probability while decoding it. A blend goes
        through both, in the same batched passes."""
        mixed = blends(w.text, m.text) if self.blend else []
        w_by_m, *mixed_by_m = self.moonshine.score_many(m_enc, [w.text, *mixed], m.cross)
        m_by_w, *mixed_by_w = self.whisper.score_many(w_enc, [m.text, *mixed], w.cross, context)
        scored = [
            (w.text, w.total + w_by_m[0], (w.mean + w_by_m[0] / w_by_m[1]) / 2, "whisper"),
            (m.text, m.total + m_by_w[0], (m.mean + m_by_w[0] / m_by_w[1]) / 2, "moonshine"),
        ]
        for text, (by_w, w_n), (by_m, m_n) in zip(mixed, mixed_by_w, mixed_by_m, strict=True):
            scored.append((text, by_w + by_m, (by_w / w_n + by_m / m_n) / 2, "blend"))
        text, _, confidence, source = max(scored, key=lambda c: c[1])
        return text, confidence, source

    def transcribe(self, audio: np.ndarray, context: str | None = None) -> str:
        """``hear`` without the confidence."""
        return self.hear(audio, context)[0]
