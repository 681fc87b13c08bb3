"""Turn-taking and reply shaping rules of the reference engine (no models)."""

from __future__ import annotations

import numpy as np
import pytest

from omnifabric.worker.engines.reference.turns import (
    TurnRules,
    cut_at_limit,
    looks_finished,
    repeated_from,
    reply_cut,
    sentence_ends,
)
from omnifabric.worker.engines.vad import TurnTracker

WINDOW = 512
RULES = TurnRules()


def feed(tracker: TurnTracker, pattern: str) -> None:
    """'s' = a speech window, '.' = a silent one; each window's samples are its index."""
    flags = np.array([c == "s" for c in pattern], bool)
    pcm = np.repeat(np.arange(len(pattern), dtype=np.float32), WINDOW)
    tracker.feed(pcm, flags)


def windows(seconds: float) -> int:
    return int(round(seconds * 16000 / WINDOW))


def test_long_silence_ends_the_turn_whatever_was_said():
    t = TurnTracker(RULES, WINDOW)
    feed(t, "." * 5 + "s" * windows(1.0) + "." * (windows(RULES.end_silence_s) + 1))
    audio = t.take_ended()
    assert audio is not None and not t.started
    # pre-roll + speech + tail only: the long silence is not sent to the recognizer
    speech_and_more = (5 + windows(1.0)) * WINDOW + int(RULES.tail_s * 16000)
    assert audio.size == speech_and_more
    assert t.take_ended() is None


def test_a_pause_inside_the_question_keeps_the_turn():
    t = TurnTracker(RULES, WINDOW)
    feed(t, "s" * windows(0.6) + "." * windows(0.5) + "s" * windows(0.6))
    assert t.started and t.ended is None
    assert t.speech_s == pytest.approx(2 * windows(0.6) * WINDOW / 16000)


def test_quick_end_needs_enough_speech_and_silence():
    t = TurnTracker(RULES, WINDOW)
    feed(t, "s" * windows(0.2) + "." * windows(0.5))
    assert not t.may_end()  # too little speech
    t = TurnTracker(RULES, WINDOW)
    feed(t, "s" * windows(1.0) + "." * windows(0.1))
    assert not t.may_end()  # too little silence so far
    feed(t, "." * windows(0.3))
    assert t.may_end()
    audio = t.take_current()
    assert audio.size > 0 and not t.started


def test_clicks_are_not_turns():
    t = TurnTracker(RULES, WINDOW)
    feed(t, "ss" + "." * (windows(RULES.end_silence_s) + 2))
    assert t.take_ended() is None and not t.started


def test_a_very_long_utterance_is_cut_for_the_recognizer():
    rules = TurnRules(max_utterance_s=2.0)
    t = TurnTracker(rules, WINDOW)
    feed(t, "s" * windows(2.5))
    assert t.take_ended() is not None


@pytest.mark.parametrize(
    ("text", "finished"),
    [
        ("What is the capital of France?", True),
        ("My name is Anna.", True),
        ("What is the capital of", False),
        ("What is the capital of.", False),  # a function word: the sentence is open
        ("What is...", False),
        ("", False),
        ("Tell me a joke!", True),
    ],
)
def test_looks_finished(text, finished):
    assert looks_finished(text) is finished


def test_sentence_ends_need_the_following_space():
    text = "The capital of the U.S. is Washington. It has 3.5 million"
    assert sentence_ends(text) == [len("The capital of the U.S. is Washington.")]
    assert sentence_ends("Paris.") == []
    assert sentence_ends("Paris. ") == [6]


def test_reply_cut_after_two_sentences():
    text = "Paris is the capital. It is in France. It is"
    assert reply_cut(text, False, RULES) == len("Paris is the capital. It is in France.")
    assert reply_cut("Paris is the capital.", False, RULES) is None
    assert reply_cut("Paris is the capital. It is big.", True, RULES) == len(
        "Paris is the capital. It is big."
    )


def test_reply_cut_before_a_loop():
    text = "The opposite of hot is cold. The opposite of heart is the opposite of heart is"
    assert repeated_from(text) is not None
    assert reply_cut(text, False, TurnRules(max_sentences=5)) == len("The opposite of hot is cold.")
    loop_only = "the opposite of heart is the opposite of heart is"
    assert reply_cut(loop_only, False, RULES) == loop_only.index("the opposite", 1)


def test_cut_at_limit_never_inside_a_word():
    assert cut_at_limit("It is cold. And then the wea") == len("It is cold.")
    assert cut_at_limit("Spiders have eight le") == len("Spiders have eight")


def test_a_sessions_own_speech_minimum_and_end_silence():
    rules = RULES.tuned(min_speech_ms=128, end_silence_ms=1500)
    assert (rules.min_speech_s, rules.end_silence_s) == (0.128, 1.5)
    assert rules.quick_silence_s == RULES.quick_silence_s
    assert RULES.tuned(None, None) == RULES
    # Silence shorter than the quick end: the quick end waits no longer than asked.
    assert RULES.tuned(None, 150).quick_silence_s == 0.15
    # A 1.0 s pause ends the default turn but not one that asked for 1.5 s of silence.
    pattern = "s" * windows(1.0) + "." * (windows(1.0) + 1)
    default, patient = TurnTracker(RULES, WINDOW), TurnTracker(rules, WINDOW)
    feed(default, pattern)
    feed(patient, pattern)
    assert default.take_ended() is not None
    assert patient.take_ended() is None and patient.started
    # 0.2 s of speech is a turn for a 128 ms minimum, a click for the default 0.3 s.
    short = "s" * windows(0.2) + "." * (windows(1.5) + 1)
    default, eager = TurnTracker(RULES, WINDOW), TurnTracker(rules, WINDOW)
    feed(default, short)
    feed(eager, short)
    assert default.take_ended() is None and eager.take_ended() is not None
