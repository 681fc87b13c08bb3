"""Turn-taking and reply shaping rules of the reference engine (no models here).

The user's turn (followed by omnifabric.worker.engines.vad.TurnTracker): silero-vad flags
every 32 ms window; an utterance starts at the first speech window (with a short pre-roll so
the recognizer hears the onset) and ends

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
from dataclasses import dataclass

from omnifabric.worker.config import TURN_WORK
from omnifabric.worker.engines.vad import UtteranceRules


@dataclass(frozen=True)
class TurnRules(UtteranceRules):
    """The user's turn by rule (UtteranceRules, with the reference engine's defaults), and
    reply shaping."""

    barge_in_s: float = 0.2
    """Speech within one unit, while the model speaks, that interrupts it."""
    piece_chars: int = 16
    """Characters spoken per piece (~1 s of speech)."""
    first_piece_chars: int = 12
    """Characters of the first piece, spoken by the unit that ends the user's turn, or sent
    at once by its finalize where the client takes results between units (a finalize whose
    piece waits for the next unit makes a whole ``piece_chars`` one:
    ``ReferenceSession._first_chars``): fewer
    start the reply sooner, but the next unit's audio must come before it has played
    (measured by `omnifabric eval`, 48 replies: 16 -> first audio p50 1.60 s, no gaps;
    12 -> 1.53 s, no gaps; 10 -> 1.50 s, 12 replies with gaps of 0.19 s on average)."""
    tokens_per_request: int = 1
    """Reply tokens the model chooses in one llama.cpp request while it speaks (after the
    first piece, whose tokens are chosen one by one so it goes out as soon as it is made;
    at most ``llm_gguf.PENALTY_REACH + 1``; chosen beyond the reply's end, dropped with
    it): more than one lets a session speaking beside another share llama.cpp's batches
    instead of taking turns. One, since on the 2-core host that gained nothing: decoding
    is bound by the cores, and two conversations of 24 tokens each decoding at once did
    0.86 times one's work asking 1 token a request, 0.88 asking 4 (docs/performance.md,
    "Two callers on two cores")."""
    max_tokens_per_unit: int = 16
    """LLM tokens generated at most per speaking unit."""
    max_reply_tokens: int = 80
    """A reply is cut after this many tokens (at its last finished sentence when it has one)."""
    max_sentences: int = 2
    """Sentences spoken at most per reply."""
    warm_ahead: bool = True
    """After a unit inside an utterance has answered (its finalize), transcribe the
    utterance so far and prefill its words (the last too), so the end of the turn prefills
    only the rest and transcribes nothing when only silence followed (skipped while another
    session's unit is being computed)."""
    guess_ahead: bool = True
    """A finalize inside an utterance whose words so far read as a finished turn, though
    its unit ended in too little silence to end it (``quick_silence_s``), begins the reply
    to them (its first piece made, the dialogue then taken back): when the next unit adds
    only silence, the turn ends with the same words and that piece goes out at once, a
    whole unit sooner than a turn ended by the next unit would speak."""
    guess_in_time: bool = True
    """A finalize at a unit that ended in speech (a long shot: whole-second units end inside
    a question's words) guesses only where the guess ends before the next unit is due, by
    the slow end of the measured reply starts (``ReferenceSession._guess_in_time``); False:
    whatever it costs (exact timelines in tests, whatever the host's speed)."""
    turn_work: str = "auto"
    """Where the end of the user's turn is worked out (transcribing what is not yet, the
    turn's prefill, the reply's first piece): "inline", in the unit that ends the turn; or
    in that unit's finalize, after its listening result has gone out, and the next unit
    speaks ("finalize"); "auto": inline when the engine's measured cost of it fits in
    ``inline_share`` of the unit, else in finalize; always in finalize where the client
    takes results between units and no function may be called (the finalize sends the
    reply's start as soon as it is made: ``ReferenceSession._early_start``). A turn's end
    cost 1.25-1.5 s here when it transcribed inline: its unit was late and so was the next;
    in finalize (which also has the speech transcribed by the finalize before) 0.6-0.8 s,
    and every unit keeps time."""
    inline_share: float = 0.9
    """The share of a unit that the end of a turn may take inline ("auto"). Inline, the
    reply's first audio leaves ``c`` after the unit arrived (c: the measured reply start);
    in finalize it leaves with the next unit, a whole unit after. So inline is sooner
    whenever the work fits the unit, with a margin for the unit's own VAD and the result's
    send (measured by `omnifabric eval`'s spoken questions on a 2-core host, with guesses
    on: share 0.5, every turn's work in finalize there, first audio p50/p90 1.69/2.01 s;
    every turn's work inline 1.51/1.82 s). The finalize after an inline start makes the
    next second of speech; the first piece plays while it does."""

    def __post_init__(self) -> None:
        if self.turn_work not in TURN_WORK:
            raise ValueError(f"turn_work {self.turn_work!r}: choose one of {', '.join(TURN_WORK)}")


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
