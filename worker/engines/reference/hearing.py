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
A hearing that has the host to itself (``spread``) runs Whisper's encoder on every core
first, then Whisper's decoding and Moonshine a core each; the two scorings run at once too.

Context: ``hear(audio, context)`` gives Whisper the session's words (names a system prompt
or a function's parameters hold) as its prompt, for its decoding and its scoring; Moonshine
has no prompt. On ``python -m omnifabric.tools.eval_hearing`` (docs/engines.md, "Hearing")
a list of the restaurants' and cities' names kept every key word in 140 of 150 Piper
utterances against 132 without, and in 216 of 300 espeak-ng ones against 207; the
functions' descriptions as context did no better than none (130, 204). A session that
names nothing is heard with a plain line instead (``engine.HEARING_PRIMER``: 215 espeak-ng
utterances against 207 with no prompt, 133 Piper against 132). Tried and dropped:
scoring blends of the two transcripts too (one side's words where they differ in two or
three places, the other's elsewhere: 134 and 207 without context, 140 and 213 with the
names), and beam search on Whisper where the two disagree (~150-180 ms more on a quiet core).

Whisper stays the silence gate (its peak gate and no-speech rule): Moonshine has no
no-speech estimate, so its transcript of what Whisper calls silence or noise is dropped. The
confidence returned (for the engine's "say it again" repair) is the mean of the two models'
per-token log-probabilities of the chosen transcript.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnifabric.worker.engines.reference.asr import (
    SAMPLE_RATE,
    is_silent,
    spread_threads,
    torch_threads,
)
from omnifabric.worker.engines.vad import UtteranceRules

if TYPE_CHECKING:
    from omnifabric.worker.engines.reference.asr import Hypothesis, Transcriber
    from omnifabric.worker.engines.reference.moonshine import Moonshine

_WORD = re.compile(r"[a-z0-9']+")
#: Below this fraction of a clip's peak a sample counts as quiet (``with_margins``).
QUIET = 0.02


def with_margins(audio: np.ndarray, rules: UtteranceRules | None = None) -> np.ndarray:
    """A whole clip with at least the quiet margins a duplex utterance has (the pre-roll
    before its speech, the tail after: ``UtteranceRules``), silence added where it has
    less. A client's input_audio item may be cut right at its speech; both recognizers
    were trained on speech with some quiet around it, and Moonshine misreads a word that
    begins the clip (the spoken function-calling evaluation's "Madrid", "the Ivy" heard
    right only with margins)."""
    rules = rules or UtteranceRules()
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if is_silent(audio):
        return audio
    loud = np.flatnonzero(np.abs(audio) > QUIET * float(np.abs(audio).max()))
    lead = max(0, int(rules.pre_roll_s * SAMPLE_RATE) - int(loud[0]))
    tail = max(0, int(rules.tail_s * SAMPLE_RATE) - (audio.size - 1 - int(loud[-1])))
    if not lead and not tail:
        return audio
    return np.concatenate([np.zeros(lead, np.float32), audio, np.zeros(tail, np.float32)])


def hear_item(
    ears: Ears | Transcriber, audio: np.ndarray, context: str | None, closely: bool
) -> tuple[str, float]:
    """How the engine hears a request that came whole (an input_audio item, not streamed
    units): with its margins (``with_margins``), the session's names as ``context``, and,
    when ``closely`` (the turn may call functions), at the best decoding the models allow
    (``hear_closely``). tools/eval_tools reports what its misses were heard as through
    this same function."""
    audio = with_margins(audio)
    return (ears.hear_closely if closely else ears.hear)(audio, context)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Ears:
    """Whisper and Moonshine together, with Transcriber's ``hear``/``transcribe`` interface.

    The two recognizers run at once (Moonshine on a thread of its own: torch releases the
    GIL), so an utterance costs about the slower of the two plus the scoring, not their sum.
    Thread-safe as far as the models are: each call keeps its own encodings; the weights are
    only read.
    """

    def __init__(self, whisper: Transcriber, moonshine: Moonshine, threads: int = 2) -> None:
        self.whisper = whisper
        self.moonshine = moonshine
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moonshine")
        self.picked = {"agree": 0, "whisper": 0, "moonshine": 0}
        """How often the two agreed, or which one's transcript was taken (for logs/tests)."""
        self.last_timings: dict[str, float] = {}

    def _whisper(
        self, audio: np.ndarray, context: str | None, draft: str = ""
    ) -> tuple[torch.Tensor | None, Hypothesis | None]:
        """Whisper's encoding of ``audio`` and its greedy hypothesis (None, None where its
        gate finds no speech)."""
        enc = self.whisper.encode(audio)
        return enc, None if enc is None else self.whisper.hypothesis(enc, context, draft)

    def _moonshine(
        self, audio: np.ndarray, draft: str = ""
    ) -> tuple[torch.Tensor, Hypothesis, float]:
        t0 = time.perf_counter()
        enc = self.moonshine.encode(audio)
        found = self.moonshine.hypothesis(enc, draft)
        return enc, found, (time.perf_counter() - t0) * 1000.0

    def hear(
        self, audio: np.ndarray, context: str | None = None, draft: str = "", spread: bool = False
    ) -> tuple[str, float]:
        """The transcript of float32 mono 16 kHz ``audio`` and its confidence (mean token
        log-probability over both models); ("", -inf) for silence. ``context``: words the
        speaker may use, for Whisper's prompt (``Transcriber.prompt_for``), in its decoding
        and its scoring; Moonshine takes none. ``draft``: what the same speech was heard as
        before it went on; each model checks it against its own greedy reading and keeps
        what agrees, so the transcript is the same in fewer decoding passes.

        ``spread``: the caller has the host to itself (no other unit is being computed).
        Whisper's encoder, the longest single piece (~150 ms of a ~270 ms hearing on one
        core), then runs first on every core (``asr.spread_threads``: ~85 ms on two), and
        Whisper's decoding and Moonshine follow at once, a core each. The same transcript
        to the bit where the encoder's states do not depend on its threads (fp32; bfloat16
        on AVX512-BF16 without AMX: ``asr.SPREAD_THREADS``); on the eval's 24 questions as a
        turn's end hears them, ~50 ms sooner on a 2-core host."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if is_silent(audio):
            return "", float("-inf")
        t0 = time.perf_counter()
        if spread:
            with torch_threads(spread_threads()):
                w_enc = self.whisper.encode(audio)
            if w_enc is None:  # Whisper's gate: nothing was said, Moonshine need not run
                return "", float("-inf")
            moon = self._pool.submit(self._moonshine, audio, draft)
            w: Hypothesis | None = self.whisper.hypothesis(w_enc, context, draft)
        else:
            moon = self._pool.submit(self._moonshine, audio, draft)
            w_enc, w = self._whisper(audio, context, draft)
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
        # Each transcript is forced through the other model's decoder (reusing the
        # cross-attention keys and values of its decoding), the two at once; its own model
        # gave its log-probability while decoding it. The summed log-probabilities decide.
        by_m = self._pool.submit(self.moonshine.score, m_enc, w.text, m.cross)
        m_by_w, w_n = self.whisper.score(w_enc, m.text, w.cross, context)
        w_by_m, m_n = by_m.result()
        whisper_total = w.total + w_by_m
        moonshine_total = m.total + m_by_w
        self.last_timings = {**timings, "scoring": (time.perf_counter() - t1) * 1000.0}
        if whisper_total >= moonshine_total:
            self.picked["whisper"] += 1
            return w.text, (w.mean + w_by_m / m_n) / 2
        self.picked["moonshine"] += 1
        return m.text, (m.mean + m_by_w / w_n) / 2

    def _moonshine_closely(
        self, audio: np.ndarray
    ) -> tuple[torch.Tensor, Hypothesis, list[str], float]:
        t0 = time.perf_counter()
        enc = self.moonshine.encode(audio)
        found = self.moonshine.hypothesis(enc)
        others = self.moonshine.candidates(enc)
        return enc, found, others, (time.perf_counter() - t0) * 1000.0

    def hear_closely(self, audio: np.ndarray, context: str | None = None) -> tuple[str, float]:
        """``hear`` at the best decoding the two models allow, for a whole clip whose words
        matter more than its time (a request that arrives as one input_audio item): each
        model's greedy transcript and its beam search's (``asr.BEAMS``) are all scored by
        both models, and the likeliest by their summed log-probabilities is taken (the rule
        ``hear`` applies to two). Costs ~2-3x ``hear``; the duplex turn's hearing does not
        use it."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if is_silent(audio):
            return "", float("-inf")
        t0 = time.perf_counter()
        moon = self._pool.submit(self._moonshine_closely, audio)
        w_enc, w = self._whisper(audio, context)
        if w_enc is None or w is None or not w.text:
            moon.result()
            return "", float("-inf") if w is None else w.mean  # Whisper: nothing was said
        heard = [w.text, *self.whisper.candidates(w_enc, context)]
        whisper_ms = (time.perf_counter() - t0) * 1000.0
        m_enc, m, others, moonshine_ms = moon.result()
        unique: dict[tuple[str, ...], str] = {}
        for text in [*heard, m.text, *others]:
            if _words(text):
                unique.setdefault(tuple(_words(text)), text)
        texts = list(unique.values())
        t1 = time.perf_counter()
        by_w = self.whisper.score_many(w_enc, texts, w.cross, context)
        by_m = self.moonshine.score_many(m_enc, texts, m.cross)
        best = max(range(len(texts)), key=lambda i: by_w[i][0] + by_m[i][0])
        self.last_timings = {
            "whisper": whisper_ms,
            "moonshine": moonshine_ms,
            "both": (t1 - t0) * 1000.0,
            "scoring": (time.perf_counter() - t1) * 1000.0,
        }
        (w_total, w_n), (m_total, m_n) = by_w[best], by_m[best]
        return texts[best], (w_total / w_n + m_total / m_n) / 2

    def transcribe(self, audio: np.ndarray, context: str | None = None) -> str:
        """``hear`` without the confidence."""
        return self.hear(audio, context)[0]
