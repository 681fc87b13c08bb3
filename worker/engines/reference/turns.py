"""Turn-taking and reply shaping rules of the reference engine (no models here).

The user's turn: silero-vad flags every 32 ms window; an utterance starts at the first speech
window (with a short pre-roll so the recognizer hears the onset) and ends

- at once when a unit ends with at least ``quick_silence_s`` of silence after enough speech
  and what was said so far reads as a finished sentence (``looks_finished``), or
- after ``end_silence_s`` of silence whatever was said (a pause inside an unfinished
  question is allowed up to that long), or
- when it reaches ``max_utterance_s``.

The reply: at most ``max_sentences`` sentences, no repeated run of words, never cut inside a
word (``reply_cut``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

RATE = 16000


@dataclass(frozen=True)
class TurnRules:
    """Turn-taking by rule (seconds), and reply shaping."""

    min_speech_s: float = 0.3
    """Speech needed before a pause can end the user's turn."""
    end_silence_s: float = 0.9
    """Silence after speech that ends the user's turn whatever was said."""
    quick_silence_s: float = 0.2
    """Silence at a unit's end that ends the turn when the words read as finished (0.2 s
    answers 0.11 s sooner on average than 0.3 s, with no question split on 144 spoken
    questions)."""
    barge_in_s: float = 0.2
    """Speech within one unit, while the model speaks, that interrupts it."""
    piece_chars: int = 16
    """Characters spoken per piece (~1 s of speech)."""
    first_piece_chars: int = 12
    """Characters of the first piece, spoken by the unit that ends the user's turn: fewer
    start the reply sooner, but the next unit's audio must come before it has played
    (measured by `omnifabric eval`, 48 replies: 16 -> first audio p50 1.60 s, no gaps;
    12 -> 1.53 s, no gaps; 10 -> 1.50 s, 12 replies with gaps of 0.19 s on average)."""
    max_tokens_per_unit: int = 16
    """LLM tokens generated at most per speaking unit."""
    max_reply_tokens: int = 80
    """A reply is cut after this many tokens (at its last finished sentence when it has one)."""
    max_sentences: int = 2
    """Sentences spoken at most per reply."""
    pre_roll_s: float = 0.25
    """Audio kept before the first speech window, so the recognizer hears the onset."""
    tail_s: float = 0.3
    """Silence after the last speech window given to the recognizer."""
    warm_ahead: bool = True
    """At the end of a unit inside an utterance, transcribe it so far and prefill its words
    but the last, so the unit that ends the turn prefills only the rest (skipped while
    another session's unit is being computed)."""
    max_utterance_s: float = 25.0
    """Longer user turns are transcribed once they reach this (Whisper takes 30 s)."""

    def tuned(self, min_speech_ms: int | None, end_silence_ms: int | None) -> TurnRules:
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

    def __init__(self, rules: TurnRules, window: int) -> None:
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
                        self.ended = self.audio()
                    self.reset()  # the turn, or a click or breath that was not one
            if self.started and self.samples >= rules.max_utterance_s * RATE:
                self.ended = self.audio()
                self.reset()

    def audio(self) -> np.ndarray:
        """The current utterance up to tail_s after its last speech."""
        whole = np.concatenate(self.utterance) if self.utterance else np.zeros(0, np.float32)
        return whole[: self.speech_end + int(self.rules.tail_s * RATE)]

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


# Words that leave a sentence open: a pause after them is a pause, not the end of a turn.
_OPEN_ENDINGS = frozenset(
    "a an the of to in on at for from with by about and or but so if is are was were am "
    "be do does did can could will would should what which who whom whose where when why "
    "how my your his her their our its this that these those than as like um uh er".split()
)
_WORD = re.compile(r"[a-z']+")


def looks_finished(text: str) -> bool:
    """Whether a transcript reads as a finished utterance: it ends in sentence punctuation
    and its last word does not leave the sentence open ("What is the capital of...")."""
    text = text.strip()
    if not text or text[-1] not in ".?!" or text.endswith(".."):
        return False
    words = _WORD.findall(text.lower())
    return bool(words) and words[-1] not in _OPEN_ENDINGS


# A sentence ends at . ! ? (closing quotes or brackets may follow) before whitespace; the
# period of an initial ("U.S. ") is not an end.
_SENTENCE_END = re.compile(r"(?<!\b[A-Z])[.!?]+[\"')\]]*(?=\s)")


def sentence_ends(text: str) -> list[int]:
    """Positions just after each finished sentence of ``text`` (an end needs the whitespace
    that follows it, so a final "." is counted once the next token shows it is final)."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def repeated_from(text: str, min_words: int = 3) -> int | None:
    """Where a loop starts: when the last n >= min_words words repeat the n words before
    them, the position of the repeated copy; else None."""
    words = list(re.finditer(r"\S+", text))
    norm = [re.sub(r"\W", "", w.group().lower()) for w in words]
    for n in range(min_words, len(words) // 2 + 1):
        if norm[-n:] == norm[-2 * n : -n]:
            return words[-n].start()
    return None


def reply_cut(text: str, finished: bool, rules: TurnRules) -> int | None:
    """Where the reply should end, or None to go on: after ``max_sentences`` sentences, or
    before a repeated run of words. ``finished``: the model ended the reply itself."""
    ends = sentence_ends(text + (" " if finished else ""))
    if len(ends) >= rules.max_sentences:
        return ends[rules.max_sentences - 1]
    loop = repeated_from(text)
    if loop is not None:
        before = [e for e in ends if e <= loop]
        return before[-1] if before else loop
    return None


def cut_at_limit(text: str) -> int:
    """Where a reply cut by the token limit ends: after its last finished sentence, else
    after its last whole word."""
    ends = sentence_ends(text + " ")
    if ends:
        return ends[-1]
    space = text.rstrip().rfind(" ")
    return space if space > 0 else len(text)
