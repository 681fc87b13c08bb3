"""Decoding with a draft (asr.read_draft): the transcript of the same speech heard before it
went on is checked in the first decoder pass and kept as far as greedy decoding agrees. It
saves passes and changes nothing else: the same text, token count and summed
log-probability as decoding without it, whatever the draft says. Real weights: Whisper base
and Moonshine base-en; speech from espeak-ng."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnifabric.worker.engines.reference import moonshine
from omnifabric.worker.engines.reference.asr import Transcriber, model_installed, read_draft

needs_models = pytest.mark.skipif(
    not moonshine.model_installed() or not model_installed("base"),
    reason="Moonshine (moonshine-cpp) or Whisper base weights not installed",
)

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the largest planet in our solar system?",
)


def test_a_draft_is_read_while_each_token_is_the_likeliest() -> None:
    rows = torch.full((4, 6), -9.0)
    rows[0, 2] = rows[1, 3] = rows[2, 1] = rows[3, 5] = -0.1
    # draft [2, 3, 4]: the first two are the likeliest, the third is not: row 2's pick ends it
    assert [t for t, _ in read_draft(rows, [2, 3, 4])] == [2, 3, 1]
    assert [t for t, _ in read_draft(rows, [2, 3, 1])] == [2, 3, 1, 5]  # all kept, one more
    assert [t for t, _ in read_draft(rows[:1], [])] == [2]  # no draft: one pass, one token
    assert read_draft(rows, [0, 3, 1])[0] == (2, pytest.approx(-0.1))  # wrong from the start


@pytest.fixture(scope="module")
def models() -> dict[str, object]:
    return {"whisper": Transcriber(model="base"), "moonshine": moonshine.Moonshine()}


def _utterance(text: str) -> np.ndarray:
    from omnifabric.tools.make_fixtures import espeak

    audio = espeak(text, "en-us", 165)
    quiet = np.zeros(4000, np.float32)
    noisy = np.concatenate([quiet, audio, quiet]) + np.random.default_rng(1).normal(
        0, 0.002, audio.size + 2 * quiet.size
    )
    return noisy.astype(np.float32)


def _decoder(model: object) -> torch.nn.Module:
    if isinstance(model, Transcriber):
        return model.decoder
    assert isinstance(model, moonshine.Moonshine)
    return model.model.model.decoder


def _heard(model: object, audio: np.ndarray, draft: str) -> tuple[object, int]:
    """The model's hypothesis of ``audio`` with ``draft``, and the decoder passes it took."""
    passes = []
    hook = _decoder(model).register_forward_pre_hook(lambda *_: passes.append(1))
    try:
        found = model.hypothesis(model.encode(audio), draft=draft)  # type: ignore[attr-defined]
    finally:
        hook.remove()
    return found, len(passes)


@needs_models
@pytest.mark.parametrize("name", ["whisper", "moonshine"])
@pytest.mark.parametrize("question", QUESTIONS)
def test_a_draft_changes_nothing_but_the_passes(models, name, question) -> None:
    model = models[name]
    audio = _utterance(question)
    plain, plain_passes = _heard(model, audio, "")
    earlier, _ = _heard(model, audio[: int(audio.size * 0.65)], "")
    assert earlier.text and earlier.text != plain.text  # the speech went on since
    drafts = {
        "earlier": earlier.text,
        "wrong": "Tell me a joke about cats, please.",
        "longer": plain.text + " And what about the moon and the stars tonight?",
        "whole": plain.text,
    }
    for kind, draft in drafts.items():
        found, passes = _heard(model, audio, draft)
        assert (found.text, found.count) == (plain.text, plain.count), kind
        assert found.total == pytest.approx(plain.total, abs=1e-3), kind
        if kind == "earlier":
            assert passes < plain_passes, (passes, plain_passes)
        if kind == "whole":
            assert passes == 1  # every token and the end read off the first pass
        if kind == "wrong":
            assert passes <= plain_passes  # the draft costs no pass of its own


class _Recorded:
    """A recognizer that says what it was asked to hear with."""

    def __init__(self) -> None:
        self.drafts: list[str] = []
        self.spread: list[bool] = []

    def hear(self, audio, context=None, draft="", spread=False):
        self.drafts.append(draft)
        self.spread.append(spread)
        return f"heard {len(self.drafts)}", -0.1


def test_the_turn_is_heard_with_what_its_utterance_was_heard_as_before() -> None:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()  # not loaded: its recognizer is the stand-in
    ears = _Recorded()
    engine._asr = ears  # type: ignore[assignment]
    session = engine.open_session("drafts", "audio")
    audio = np.full(16000, 0.2, np.float32)
    costs: dict[str, float] = {}
    assert session._transcribe(audio, (1, 8000), costs) == ("heard 1", -0.1)
    assert session._transcribe(audio, (1, 8000), costs) == ("heard 1", -0.1)  # only silence
    session._transcribe(audio, (1, 16000), costs)  # the same utterance went on
    session._transcribe(audio, (2, 4000), costs)  # a new one
    assert ears.drafts == ["", "heard 1", ""]
    # Alone, a hearing takes every core (Ears.hear's spread); beside another unit, its own.
    assert ears.spread == [True, True, True]
    with engine.running(), engine.running():  # this unit and another session's
        session._transcribe(audio, (3, 4000), costs)
    assert ears.spread[-1] is False
    session.close()


def test_hearing_is_learned_per_second_of_window_and_apart_with_a_draft() -> None:
    from omnifabric.worker.engines.reference.asr import window_seconds
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    assert (window_seconds(0.0), window_seconds(1.0), window_seconds(2.0)) == (0.0, 4.0, 5.0)
    engine = ReferenceEngine()  # not loaded: the estimate is arithmetic on what it learned
    engine.learn_hearing(0.4, 2.0)  # a first hearing: 0.08 s a second of its 5 s window
    engine.reply_start_s = 0.5
    assert engine.turn_estimate(2.0) == pytest.approx(0.9)
    assert engine.turn_estimate(2.0, drafted=True) == pytest.approx(0.9)  # none drafted yet
    engine.learn_hearing(0.25, 2.0, drafted=True)  # 0.05 a window second
    assert engine.drafted_hearing_cost == pytest.approx(0.05)
    assert engine.turn_estimate(2.0, drafted=True) == pytest.approx(0.75)
    assert engine.turn_estimate(2.0) == pytest.approx(0.9)  # the first hearing's is kept
    assert engine.turn_estimate(0.0, drafted=True) == pytest.approx(0.5)  # heard already


def test_the_unit_that_ends_the_turn_counts_on_the_draft_it_has() -> None:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine
    from omnifabric.worker.engines.reference.turns import TurnRules

    engine = ReferenceEngine(rules=TurnRules(turn_work="auto", inline_share=0.9))
    engine._asr = _Recorded()  # type: ignore[assignment]
    session = engine.open_session("estimate", "audio")
    audio = np.full(32000, 0.2, np.float32)  # 2 s: a 5 s window
    session._transcribe(audio[:16000], (1, 16000), {})  # heard before it went on
    engine.hearing_cost, engine.drafted_hearing_cost, engine.reply_start_s = 0.2, 0.05, 0.5
    session.unit_started = time.perf_counter()
    assert not session._fits_in_unit((audio, (2, 32000), False))  # 0.2 x 5 + 0.5 > 0.9
    assert session._fits_in_unit((audio, (1, 32000), False))  # 0.05 x 5 + 0.5 < 0.9
    session.close()


def test_a_long_shot_guess_is_made_where_the_reply_start_ends_before_the_next_unit() -> None:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()  # not loaded: the rule is arithmetic on what it learned
    session = engine.open_session("long-shot", "audio")
    session.unit_s = 1.0
    session.unit_started = time.perf_counter() - 0.3  # hearing the words took 0.3 s
    session.turn.silence_s = 0.0  # the unit ended in speech: a long shot
    assert session._guess_in_time()  # nothing measured yet: guessed as before
    engine.reply_start_s = 0.5
    assert session._guess_in_time()  # 0.3 + 0.5 <= 1.0
    engine.reply_start_s = 0.9
    assert not session._guess_in_time()  # 0.3 + 0.9 > 1.0: the next unit would wait
    session.turn.silence_s = 0.1  # too little silence to end the turn, but some
    assert session._guess_in_time()  # guessed whatever it costs
    session.turn.silence_s = 0.0
    session.rules = replace(session.rules, guess_in_time=False)
    assert session._guess_in_time()
    session.close()


def test_a_turns_end_is_estimated_from_the_slow_end_of_recent_measurements() -> None:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()
    for seconds in (0.5, 0.9, 0.5, 0.5, 0.5, 0.9, 0.5, 0.5, 0.5, 0.5):
        engine.learn_reply_start(seconds)
    assert engine.reply_start_s == pytest.approx(0.9)  # 2 of 10 slow: the mean would be 0.58
    for _ in range(engine.RECENT):
        engine.learn_reply_start(0.5)
    assert engine.reply_start_s == pytest.approx(0.5)  # the slow ones are no longer recent


def test_the_checks_and_the_arguments_are_estimated_by_the_same_slow_end() -> None:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()
    for seconds in (0.2, 0.6, 0.2, 0.2, 0.2, 0.6, 0.2, 0.2, 0.2, 0.2):
        engine.learn_checks(seconds)
        engine.learn_arguments(seconds / 2)
    assert engine.checks_s == pytest.approx(0.6)  # a moving average would say ~0.26
    assert engine.arguments_s == pytest.approx(0.3)
    for _ in range(engine.RECENT):
        engine.learn_checks(0.2)
    assert engine.checks_s == pytest.approx(0.2)
    assert engine.arguments_s == pytest.approx(0.3)  # each kind keeps its own measurements


def test_the_dearest_call_is_the_finalize_that_ends_the_longest_turn() -> None:
    """Engine.slowest_call_s, which the worker's unit timeout follows where it is longer:
    hearing a whole ``max_utterance_s`` (25 s: a 28 s window), the checks and the arguments once
    measured, the reply's start and its next second of speech."""
    from omnifabric.worker.engines.reference.asr import window_seconds
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()  # not loaded: the bound is arithmetic on what it learned
    assert engine.slowest_call_s() is None  # nothing measured: the configured timeout holds
    assert window_seconds(engine.rules.max_utterance_s) == 28.0
    engine.learn_hearing(0.4, 2.0)  # 0.08 s a second of window
    engine.learn_reply_start(0.6)
    assert engine.slowest_call_s() == pytest.approx(0.08 * 28 + 0.6)
    engine.reply_cost = 0.7  # a second of speech made ahead
    assert engine.slowest_call_s() == pytest.approx(0.08 * 28 + 0.6 + 0.7)
    engine.learn_checks(0.5)
    engine.learn_arguments(0.9)
    assert engine.slowest_call_s() == pytest.approx(0.08 * 28 + 0.5 + 0.6 + 0.9 + 0.7)
