"""The reference engine on the committed speech fixtures: exact timelines, real models."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from scipy.signal import resample_poly

from omnifabric.common.resample import resample
from omnifabric.worker.engine import (
    INPUT_RATE,
    OUTPUT_RATE,
    REPLY_START_PARTS,
    DuplexSettings,
    ToolChoice,
    ToolSpec,
)
from omnifabric.worker.engines.reference.engine import (
    HEARING_PRIMER,
    UNIT_TOKENS,
    ReferenceEngine,
    hearing_names,
)
from tests.worker.reference.drive import Step, drive, drive_audio, load_fixture, timeline


@pytest.fixture(scope="module")
def engine(inline_engine):
    # The unit that ends the turn does its work itself, whatever it costs on this machine
    # (exact timelines); test_turn_work_* cover the other places. Loaded once for the
    # package (tests/worker/reference/conftest.py), warmed up here. The reply cost the
    # warm-up measured is forgotten: with it, a finalize tops its first piece up to a
    # second where that fits before the next unit is due, which depends on the host's
    # speed (a topped-up piece is a speaking unit less); the tests that want a top-up set
    # a cost of their own.
    inline_engine.warmup()
    inline_engine.reply_cost = None
    return inline_engine


@pytest.fixture(scope="module")
def driven(engine) -> Callable[[str], list[Step]]:
    """drive(engine, name) with the default settings, run once per fixture for the module:
    the tests that only read such a run share it (~3-5 s each on a 2-core host). The engine
    gives the same output for the same input (test_same_input_same_output compares this
    first run with a fresh one)."""
    runs: dict[str, list[Step]] = {}

    def run(name: str) -> list[Step]:
        if name not in runs:
            runs[name] = drive(engine, name)
        return runs[name]

    return run


def spoken(steps) -> np.ndarray:
    return np.concatenate([s.result.audio for s in steps if s.result.audio.size] or [np.zeros(0)])


def test_question_timeline_and_answer(engine, driven):
    steps = driven("question")
    # The question ends in unit 5 (lead-in 3 s); unit 6 ends in silence, the words read as a
    # finished question, so that same unit transcribes, prefills and starts speaking.
    assert timeline(steps) == "L L L L L S S S* L L L L L L L"
    heard = [s.result.input_transcript for s in steps]
    assert "capital" in heard[5].lower() and not any(heard[:5] + heard[6:])
    text = "".join(s.result.text for s in steps)
    assert text.startswith("The capital of France is Paris")
    chunks = [s.result.audio.size for s in steps if not s.result.is_listen]
    # The first chunk is one piece (<= ~1 s, so the turn's unit stays short); the middle
    # ones are topped up to exactly 1 s.
    assert 0 < chunks[0] <= 24000 * 1.5
    assert chunks[1:-1] and all(n == 24000 for n in chunks[1:-1])
    # A recognizer hears the answer in the reply audio.
    reply = resample_poly(spoken(steps), 2, 3).astype(np.float32)
    assert "paris" in engine.asr.transcribe(reply).lower()
    # Context grows by 13 tokens per unit plus the real text tokens.
    kv = [s.result.kv_cache_length for s in steps]
    assert kv == sorted(kv) and kv[1] - kv[0] == UNIT_TOKENS
    assert kv[-1] > kv[0] + UNIT_TOKENS * (len(steps) - 1)


def test_same_input_same_output(engine, driven):
    a, b = driven("question"), drive(engine, "question")
    assert [s.result.text for s in a] == [s.result.text for s in b]
    assert all(np.array_equal(x.result.audio, y.result.audio) for x, y in zip(a, b, strict=True))
    assert [s.result.kv_cache_length for s in a] == [s.result.kv_cache_length for s in b]


@pytest.mark.ci_long  # a second question on the real models: ~7 s (tests/conftest.py)
def test_two_questions_keep_the_conversation(driven):
    steps = driven("two_questions")
    assert timeline(steps) == ("L L L L L S S S* L L L L L L L S S* L L L L L L L L")
    turns = "".join(s.result.text for s in steps)
    assert "Paris" in turns and "blue" in turns


@pytest.mark.ci_long  # one more drive of the real models' timeline: ~8 s (tests/conftest.py)
def test_barge_in_closes_the_turn_at_once(engine):
    steps = drive(engine, "barge_in")
    # The question's unit 5 ends in >= 0.2 s of silence, so the reply starts there; the
    # second voice starts in unit 7: that unit closes the reply (listen + end_of_turn), and
    # what it said is answered in turn.
    assert timeline(steps)[: len("L L L L S S L*")] == "L L L L S S L*"
    assert "stop" in steps[9].result.input_transcript.lower()


def test_finalize_makes_the_next_second_of_speech(engine):
    with rules(engine, guess_ahead=False):  # the reply begins in the turn's own unit
        steps = drive(engine, "question")
    speaking = [s for s in steps if not s.result.is_listen]
    # The turn's unit generates a short first piece itself ...
    assert "llm" in speaking[0].result.costs_ms
    assert 0 < speaking[0].result.audio.size <= 24000
    # ... and every later unit finds its second of speech made by the finalize before it.
    assert len(speaking) >= 3
    assert all("llm" not in s.result.costs_ms for s in speaking[1:-1])
    assert all(s.result.text for s in speaking[1:-1])


def test_words_heard_so_far_are_prefilled_ahead(engine):
    with rules(engine, guess_ahead=False):
        steps = drive(engine, "question")
    # A unit inside the question prefilled its first words, in its finalize (after its
    # result); the reply is what it would be without that (test_question_timeline_and_answer).
    assert not any("llm_warm" in s.result.costs_ms for s in steps)
    warmed = [s.seq for s in steps if "llm_warm" in s.finalized]
    turn = next(s.seq for s in steps if s.result.input_transcript)
    assert warmed and all(seq < turn for seq in warmed)
    assert "".join(s.result.text for s in steps).startswith("The capital of France is Paris")


def test_prefill_ahead_only_in_spare_time(engine):
    with engine.running():
        assert not engine.busy()  # this unit alone
        with engine.running():  # another session's unit at the same time
            assert engine.busy()
            steps = drive(engine, "question")
        assert not engine.busy()
    assert not any("llm_warm" in s.finalized for s in steps)
    assert "".join(s.result.text for s in steps).startswith("The capital of France is Paris")


@contextlib.contextmanager
def rules(engine, **changes):
    """The engine's sessions opened inside follow its TurnRules with ``changes``."""
    before = engine.rules
    engine.rules = replace(before, **changes)
    try:
        yield
    finally:
        engine.rules = before


def turn_work(engine, where: str):
    """The engine's sessions opened inside work out a turn's end ``where`` (no guessing:
    a guess would begin this fixture's reply before the turn's end, test_guess_*)."""
    return rules(engine, turn_work=where, guess_ahead=False)


@pytest.mark.ci_long  # one more drive of the real models' timeline: ~6 s (tests/conftest.py)
def test_turn_work_in_finalize_keeps_every_unit_short(engine):
    # (No top-up of the finalize's first piece: no reply cost known, see ``engine``.)
    with turn_work(engine, "finalize"):
        steps = drive(engine, "question")
        barged = drive(engine, "question", force_listen_at=frozenset({7}))
    # The turn ends with unit 6 as inline, but its finalize hears it, prefills it and makes
    # the first piece: unit 6 listens and unit 7 speaks (and says what was heard).
    assert timeline(steps) == "L L L L L L S S S* L L L L L L"
    heard = [s.result.input_transcript for s in steps]
    assert "capital" in heard[6].lower() and not any(heard[:6] + heard[7:])
    assert "".join(s.result.text for s in steps).startswith("The capital of France is Paris")
    assert "llm_prefill" in steps[5].finalized and "llm" in steps[5].finalized
    # No unit's own work recognizes speech or prefills: finalize does it after the result.
    for step in steps:
        assert not {"asr", "llm_prefill", "llm_warm"} & set(step.result.costs_ms), step
    # The turn's speech was heard in an earlier unit's finalize: the end hears nothing more.
    assert "asr" not in steps[5].finalized
    # force_listen on the unit that would speak: the reply closes, what was heard is said.
    assert timeline(barged)[: len("L L L L L L L*")] == "L L L L L L L*"
    assert "capital" in barged[6].result.input_transcript.lower()


@pytest.mark.ci_long  # two more drives of the question: ~10-20 s (tests/conftest.py)
def test_a_reply_begun_in_a_finalize_sends_a_whole_first_piece(engine):
    # The unit that ends the turn sends a short first piece as soon as it is made; a
    # finalize's piece waits for the next unit anyway, so it is a whole one and plays
    # longer (the top-up, which could lengthen it too, is off: no reply cost known).
    with turn_work(engine, "finalize"):
        ahead = drive(engine, "question")
    with turn_work(engine, "inline"):
        inline = drive(engine, "question")
    first_ahead = next(s.result for s in ahead if not s.result.is_listen)
    first_inline = next(s.result for s in inline if not s.result.is_listen)
    assert (first_ahead.reply_start_how, first_inline.reply_start_how) == ("finalize", "inline")
    assert len(first_inline.text) <= engine.rules.first_piece_chars < len(first_ahead.text)
    assert len(first_ahead.text) <= engine.rules.piece_chars
    assert first_ahead.audio.size > first_inline.audio.size
    reply = "".join(s.result.text for s in ahead)
    assert reply == "".join(s.result.text for s in inline)
    assert reply.startswith(first_ahead.text) and reply.startswith(first_inline.text)


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~7 s (tests/conftest.py)
def test_a_reply_begun_in_a_finalize_goes_out_at_once_where_the_sender_takes_it(engine):
    # A sender that takes results between units (EngineSession.early_sink): the turn's
    # work is left to the finalize of the unit that ends it, whatever it costs, and the
    # reply's first piece goes out from there as soon as it is made, short as a piece sent
    # at once is; the next second of speech is made after it, for the next unit to send.
    with turn_work(engine, "auto"):
        early = drive(engine, "question", early=True)
    with turn_work(engine, "finalize"):
        plain = drive(engine, "question")
    first = next(s for s in early if not s.result.is_listen)
    assert first.early and first.seq == 6 and first.result.reply_start_how == "finalize"
    assert "capital" in first.result.input_transcript.lower()
    assert 0 < len(first.result.text) <= engine.rules.first_piece_chars
    assert first.result.audio.size > 0 and first.result.input_audio_tokens == 0
    assert [s.early for s in early].count(True) == 1
    assert timeline(early).startswith("L L L L L L +S S")
    # No unit's own work heard the turn or began the reply: its finalize did.
    for step in early:
        assert not {"asr", "llm_prefill"} & set(step.result.costs_ms) or step.early, step
    after = early[early.index(first) + 1]
    assert after.seq == 7 and after.result.audio.size == OUTPUT_RATE
    assert not after.result.input_transcript and not after.result.reply_start_how
    # The same reply, word for word, as the one the next unit sends without early results.
    reply = "".join(s.result.text for s in early)
    assert reply == "".join(s.result.text for s in plain)
    assert reply.startswith("The capital of France is Paris")


@pytest.mark.ci_long  # one more drive of the real models' timeline: ~8 s (tests/conftest.py)
def test_speech_after_a_short_piece_goes_out_at_once_where_the_sender_takes_it(engine):
    # A guess's first piece is short (under a second of speech): where the sender takes
    # results between units, the finalize after it sends the next speech as soon as it is
    # made instead of leaving the listener without speech until the next unit's result.
    # (The top-up that could lengthen the guess's piece to a second is off: no reply cost.)
    with rules(engine, guess_ahead=True):
        early = drive(engine, "question", early=True)
        plain = drive(engine, "question")
    first = next(s for s in early if not s.result.is_listen)
    assert first.seq == 6 and not first.early and first.result.reply_start_how == "guess"
    assert first.result.audio.size < OUTPUT_RATE
    then = early[early.index(first) + 1]
    assert then.early and then.seq == 6 and then.result.audio.size > 0
    assert not then.result.reply_start_how and not then.result.input_transcript
    assert "".join(s.result.text for s in early) == "".join(s.result.text for s in plain)


def test_the_turns_work_goes_to_the_finalize_only_where_the_sender_takes_early_results(
    engine,
):
    # With functions offered too: the calls a finalize writes go out from it
    # (tests/worker/reference/test_duplex_tools.py drives one).
    with turn_work(engine, "auto"):
        session = engine.open_session("test-early-tools", "audio")
        session.prepare("", None, None, DuplexSettings())
    try:
        assert not session._early_start()  # no early_sink: the sender takes none
        session.early_sink = lambda result: None
        assert session._early_start()
        spec = ToolSpec("get_time", "The time now.", {"type": "object", "properties": {}})
        session.offer_tools((spec,), ToolChoice())
        assert session._early_start()
        session.rules = replace(session.rules, turn_work="inline")
        assert not session._early_start()  # a session's own rule is kept
    finally:
        session.close()


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~7 s (tests/conftest.py)
def test_turn_work_auto_follows_the_measured_cost(engine):
    measured = engine.hearing_cost, engine.drafted_hearing_cost, engine.reply_start_s
    assert engine.hearing_cost and engine.reply_start_s  # from warm-up
    try:
        with turn_work(engine, "auto"):
            engine.hearing_cost, engine.drafted_hearing_cost = 0.0, None
            engine.reply_start_s = 0.0  # fits in any unit
            cheap = drive(engine, "question")
            learned = engine.reply_start_s  # the reply's start, measured into the average
            engine.hearing_cost, engine.drafted_hearing_cost = 0.0, None
            engine.reply_start_s = 10.0  # fits in none
            dear = drive(engine, "question")
    finally:
        engine.hearing_cost, engine.drafted_hearing_cost, engine.reply_start_s = measured
    assert timeline(cheap) == "L L L L L S S S* L L L L L L L"
    assert timeline(dear) == "L L L L L L S S S* L L L L L L"
    assert learned is not None and learned > 0.0


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~7 s (tests/conftest.py)
def test_a_turn_ended_by_its_next_unit_is_answered_on_a_guess(engine):
    # The question's words end too near unit 5's end for the quick end; unit 5's finalize
    # hears a finished question and begins the reply on it. Unit 6, all silence, ends the
    # turn with the same words and sends that reply's first piece, computing nothing.
    guessed = drive(engine, "question")
    with rules(engine, guess_ahead=False):
        plain = drive(engine, "question")
    first = next(s for s in guessed if not s.result.is_listen)
    assert first.seq == 6 and first.result.reply_start_how == "guess"
    assert "guess" in guessed[4].finalized
    assert not {"asr", "llm_prefill", "llm"} & set(first.result.costs_ms)
    assert "capital" in first.result.input_transcript.lower()
    # The reply is the one the turn gets without a guess (which unit 6 works out itself),
    # word for word and sample for sample.
    plain_first = next(s for s in plain if not s.result.is_listen)
    assert plain_first.seq == 6 and plain_first.result.reply_start_how == "inline"
    assert set(plain_first.result.reply_start_ms) == set(REPLY_START_PARTS)
    # (its words were heard by unit 5's finalize already: no recognition on the way)
    assert plain_first.result.reply_start_ms["asr"] == 0 < plain_first.result.reply_start_ms["llm"]
    assert "".join(s.result.text for s in guessed) == "".join(s.result.text for s in plain)
    assert np.array_equal(spoken(guessed), spoken(plain))


@pytest.mark.ci_long  # four more drives of the question: ~10 s (tests/conftest.py)
def test_a_guess_speaks_a_unit_sooner_where_the_turns_work_waits_for_finalize(engine):
    # Where the turn's work waits for finalize, the guess speaks a whole unit sooner.
    with rules(engine, turn_work="finalize"):
        soon = drive(engine, "question")
    with turn_work(engine, "finalize"):
        late = drive(engine, "question")
    assert timeline(soon) == "L L L L L S S S* L L L L L L L"
    assert timeline(late) == "L L L L L L S S S* L L L L L L"
    # Made in a finalize, the first piece is topped up to a second of speech (so it plays
    # until the next unit's second comes) when that fits before the next unit is due: here
    # made to fit (a second of speech costing nothing, the whole unit to do it in), then not.
    cost = engine.reply_cost
    try:
        engine.reply_cost = 0.0
        with rules(engine, inline_share=100.0):
            fits = drive(engine, "question")
        engine.reply_cost = 10.0
        alone = drive(engine, "question")
    finally:
        engine.reply_cost = cost
    assert next(s for s in fits if not s.result.is_listen).result.audio.size == OUTPUT_RATE
    assert 0 < next(s for s in alone if not s.result.is_listen).result.audio.size < OUTPUT_RATE
    assert "".join(s.result.text for s in fits) == "".join(s.result.text for s in alone)


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~11 s (tests/conftest.py)
def test_a_guess_passed_over_is_taken_up_when_the_turn_is_heard_as_guessed(engine):
    # The eval's "What is the largest planet in our solar system?" (Piper, its lead-in):
    # unit 3's finalize guesses the whole question, but unit 4 brings the last of its sound,
    # so unit 4 does not take the guess up; the turn's end hears the same words, and the
    # guessed reply (its first piece made) is the one said, with only the hearing on the
    # way to its first audio, word for word the reply made without guessing.
    from omnifabric.tools.eval_reference import ITEMS, LEAD_INS_S, VOICES, compose

    index = 10
    voice, rate = VOICES["piper"][index % len(VOICES["piper"])]
    units, _, _ = compose(ITEMS[index], "piper", voice, rate, LEAD_INS_S[index % 4], index)
    audio = np.concatenate([*units, np.zeros(6 * INPUT_RATE, np.float32)])
    with turn_work(engine, "auto"):
        plain = drive_audio(engine, audio, "planet", early=True)
    with rules(engine, turn_work="auto", guess_ahead=True):
        guessed = drive_audio(engine, audio, "planet", early=True)
    first = next(s for s in guessed if not s.result.is_listen)
    assert first.early and first.result.reply_start_how == "guess", timeline(guessed)
    assert set(first.result.reply_start_ms) == {"endpoint", "asr"}
    assert "planet" in first.result.input_transcript.lower()
    assert sum("guess" in s.finalized for s in guessed) >= 1
    plain_first = next(s for s in plain if not s.result.is_listen)
    assert plain_first.result.reply_start_how == "finalize"
    said = "".join(s.result.text for s in guessed)
    assert said == "".join(s.result.text for s in plain) and "Jupiter" in said


def _planet_audio() -> np.ndarray:
    """The eval's "What is the largest planet in our solar system?" (Piper, its lead-in),
    then silence."""
    from omnifabric.tools.eval_reference import ITEMS, LEAD_INS_S, VOICES, compose

    index = 10
    voice, rate = VOICES["piper"][index % len(VOICES["piper"])]
    units, _, _ = compose(ITEMS[index], "piper", voice, rate, LEAD_INS_S[index % 4], index)
    return np.concatenate([*units, np.zeros(6 * INPUT_RATE, np.float32)])


@pytest.mark.ci_long  # two more drives of the planet question: ~10 s (tests/conftest.py)
def test_a_guess_on_the_same_words_is_kept_not_made_again(engine):
    # The planet question in the units the edge's paced cadence makes of it (whole seconds,
    # then 0.5 s cut where the words stop, then 0.3 s): unit 3's finalize guesses the whole
    # question; unit 4 brings the last of its sound and is heard as the same words, so its
    # finalize keeps that guess for the longer speech (nothing made again), and unit 5 takes
    # it up: the reply made without guessing, word for word.
    from omnifabric.tools.turn_starts import paced_units

    audio = _planet_audio()
    units = [unit for unit, _ in paced_units(audio)]
    assert [round(u.size / INPUT_RATE, 1) for u in units[:5]] == [1.0, 1.0, 1.0, 0.5, 0.3]
    with rules(engine, turn_work="auto", guess_ahead=True):
        guessed = drive_audio(engine, audio, "kept", early=True, units=units)
    with turn_work(engine, "auto"):
        plain = drive_audio(engine, audio, "kept-plain", early=True, units=units)
    made = [(s.seq, s.finalized["guess"] > 0) for s in guessed if "guess" in s.finalized]
    assert made == [(2, True), (3, True), (4, False)]  # "What is the largest?", the question
    assert guessed[3].finalized["asr"] > 0  # unit 4's words were heard, not taken as said
    first = next(s for s in guessed if not s.result.is_listen)
    assert first.seq == 5 and first.result.reply_start_how == "guess"
    said = "".join(s.result.text for s in guessed)
    assert said == "".join(s.result.text for s in plain) and "Jupiter" in said


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~9 s (tests/conftest.py)
def test_where_units_are_cut_at_speech_ends_a_unit_ending_in_speech_guesses_nothing(engine):
    # The same units, the session told that its sender cuts them where speech stops
    # (SessionStart.speech_cuts): units 2 and 3 end in the middle of the words, so their
    # finalizes only prefill the words so far; the cut (unit 4, after the words) guesses,
    # and unit 5 takes that guess up: the same reply, with two guesses fewer to make.
    from omnifabric.tools.turn_starts import paced_units

    audio = _planet_audio()
    units = [unit for unit, _ in paced_units(audio)]
    with rules(engine, turn_work="auto", guess_ahead=True):
        told = drive_audio(engine, audio, "cuts", early=True, units=units, speech_cuts=True)
        untold = drive_audio(engine, audio, "no-cuts", early=True, units=units)
    assert [s.seq for s in untold if s.finalized.get("guess")] == [2, 3]
    assert [s.seq for s in told if "guess" in s.finalized] == [4]
    assert all("llm_warm" in told[i].finalized for i in (1, 2))
    first = next(s for s in told if not s.result.is_listen)
    assert first.seq == 5 and first.result.reply_start_how == "guess"
    assert "".join(s.result.text for s in told) == "".join(s.result.text for s in untold)


@pytest.mark.ci_long  # one more drive of the real models' timeline: ~5 s (tests/conftest.py)
def test_a_long_shot_guess_is_made_only_where_it_ends_before_the_next_unit(engine):
    # The planet question in the paced cadence's units, its sender not cutting them:
    # units 2 and 3 end in the middle of the words (long shots); where the measured reply
    # start cannot end before the next unit is due, their finalizes only prefill the words
    # so far. The cut after the words (unit 4 ends in silence) guesses whatever it costs,
    # and unit 5 takes that guess up.
    from omnifabric.tools.turn_starts import paced_units

    audio = _planet_audio()
    units = [unit for unit, _ in paced_units(audio)]
    learned = engine.reply_start_s
    try:
        engine.reply_start_s = 10.0
        with rules(engine, turn_work="auto", guess_ahead=True, guess_in_time=True):
            steps = drive_audio(engine, audio, "long-shots", early=True, units=units)
    finally:
        engine.reply_start_s = learned
    assert [s.seq for s in steps if "guess" in s.finalized] == [4]
    assert all("llm_warm" in steps[i].finalized for i in (1, 2))
    first = next(s for s in steps if not s.result.is_listen)
    assert first.seq == 5 and first.result.reply_start_how == "guess"
    assert "Jupiter" in "".join(s.result.text for s in steps)


@pytest.mark.ci_long  # one more drive of the real models' timeline: ~6 s (tests/conftest.py)
def test_a_guess_is_dropped_when_the_user_goes_on(engine):
    # The same question, then at once more words: unit 5's finalize guesses a reply to the
    # question, but unit 6 brings speech, so no reply starts on that guess: the turn ends
    # later and its reply answers everything that was said.
    question = load_fixture("question")[: 5 * INPUT_RATE]
    more = resample(engine.tts.synthesize("And what about Spain?"), OUTPUT_RATE, INPUT_RATE)
    audio = np.concatenate([question, more, np.zeros(4 * INPUT_RATE, np.float32)])
    steps = drive_audio(engine, audio, "went-on")
    assert "guess" in steps[4].finalized
    assert steps[5].result.is_listen  # the user is still talking
    first = next(s for s in steps if not s.result.is_listen)
    assert "spain" in first.result.input_transcript.lower()
    assert first.seq > 6


@pytest.mark.ci_long  # one more drive of the real models' timelines: ~7 s (tests/conftest.py)
def test_names_the_session_holds_go_to_the_recognizer(engine, monkeypatch):
    heard_with = []
    hear = engine.asr.hear

    def spy(audio, context=None, draft="", spread=False):
        heard_with.append(context)
        return hear(audio, context, draft, spread=spread)

    monkeypatch.setattr(engine.asr, "hear", spy)
    steps = drive(engine, "question", prompt="You are the host of Chez Marie. Paris is home.")
    assert heard_with and set(heard_with) == {"Chez Marie"}  # "Paris" begins a sentence
    assert "".join(s.result.text for s in steps).startswith("The capital of France is Paris")
    heard_with.clear()
    drive(engine, "question")  # no names: the plain primer
    assert heard_with and set(heard_with) == {HEARING_PRIMER}


def test_hearing_names_are_the_prompts_names_and_the_functions_enums():
    book = ToolSpec(
        "book",
        parameters={
            "type": "object",
            "properties": {"place": {"type": "string", "enum": ["Sakura", "The Ivy", 3]}},
        },
    )
    prompt = "You book tables at Nobu and Chez Marie.\nI can help. OK, the Ivy too"
    assert hearing_names(prompt, (book,)) == "Nobu, Chez Marie, Ivy, Sakura, The Ivy"
    assert hearing_names("You are a helpful assistant.") == ""


def test_hearing_names_include_those_the_functions_describe():
    book = ToolSpec(
        "book",
        "Book a table at one of our places in Rome.",
        {
            "type": "object",
            "properties": {
                "place": {"type": "string", "description": "The restaurant, e.g. Nobu or Sakura."},
                "people": {"type": "integer", "description": "How many people."},
            },
        },
    )
    assert hearing_names("", (book,)) == "Rome, Nobu, Sakura"


def test_force_listen_closes_the_turn(engine):
    steps = drive(engine, "question", force_listen_at=frozenset({7}))
    assert timeline(steps) == "L L L L L S L* L L L L L L L L"


def test_force_listen_count_holds_the_reply(engine):
    steps = drive(engine, "question", settings=DuplexSettings(force_listen_count=7))
    assert timeline(steps) == "L L L L L L L S S S* L L L L L"


def test_unsure_words_get_a_request_to_say_them_again(engine):
    from omnifabric.worker.engines.reference.engine import REPAIR_TEXT

    engine.repair_below = 1.0  # every transcript counts as unsure
    try:
        steps = drive(engine, "question")
    finally:
        del engine.repair_below
    assert "".join(s.result.text for s in steps) == REPAIR_TEXT


def test_an_unsure_turn_stays_in_the_context(engine):
    from omnifabric.worker.engines.reference.engine import REPAIR_TEXT
    from tests.worker.reference.drive import load_fixture, units_of

    session = engine.open_session("repair-context", "audio")
    engine.repair_below = 1.0  # every transcript counts as unsure
    try:
        session.prepare("", None, None, DuplexSettings())
        for unit in units_of(load_fixture("question")):
            session.prefill(unit, [], 1)
            session.generate(False)
            session.finalize()
        context = engine.llm.tokenizer.decode(session.conversation._ids)
    finally:
        del engine.repair_below
        session.close()
    # What was heard and the request to say it again, as the user got them.
    assert "capital" in context.lower() and REPAIR_TEXT in context


def test_a_reference_voice_is_answered_with_a_note(engine):
    session = engine.open_session("notes", "audio")
    try:
        session.prepare("", np.zeros(16000, np.float32), None, DuplexSettings())
        assert len(session.notes) == 1 and "cannot clone" in session.notes[0]
        session.prepare("", None, None, DuplexSettings())
        assert session.notes == ()
    finally:
        session.close()


def test_text_only_when_tts_disabled(engine):
    steps = drive(engine, "question", settings=DuplexSettings(tts_enabled=False))
    speaking = [s for s in steps if not s.result.is_listen]
    assert speaking and all(s.result.audio.size == 0 for s in speaking)
    assert "".join(s.result.text for s in speaking).startswith("The capital of France is Paris")


def test_unit_compute_recorded(driven):
    steps = driven("two_questions")
    ms = sorted(s.compute_ms for s in steps)
    # Recorded for the note; a loose bound only catches pathologies (one core, real time).
    print(f"\nreference per-unit compute ms: p50 {ms[len(ms) // 2]:.0f} max {ms[-1]:.0f}")
    assert ms[-1] < 5000


@pytest.mark.ci_long  # two sessions at once on the real models: ~9 s (tests/conftest.py)
def test_concurrent_sessions_match_serial(engine, driven):
    """Two sessions on two engine threads at once (shared models, own state) give the
    same output as one alone: no shared mutable state, no tokenizer races."""
    from concurrent.futures import ThreadPoolExecutor

    alone = driven("two_questions")
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: drive(engine, "two_questions"), range(2)))
    for steps in both:
        # What was heard is bit-identical. The reply's wording may not be: a unit that
        # shares the worker skips the prefill ahead (``_warm``), so llama.cpp prefills the
        # turn in one piece instead of two, and a near-tie can flip (measured: "The sky is
        # usually blue." against "The sky is blue." alone).
        assert [s.result.input_transcript for s in steps] == [
            s.result.input_transcript for s in alone
        ]
        text = "".join(s.result.text for s in steps)
        assert "Paris" in text and "blue" in text, text


@pytest.mark.ci_long  # chat turns on the real models: ~6 s (tests/conftest.py)
def test_chat_with_text_and_audio_parts(engine):
    from omnifabric.worker.engine import ChatMessage, ChatTurn
    from tests.worker.reference.drive import load_fixture

    # The question in the engine's own (natural) voice, after a second of the fixture's
    # lead-in noise.
    voice = resample_poly(engine.tts.synthesize("What is the capital of France?"), 2, 3)
    question = np.concatenate([load_fixture("question")[:16000], voice.astype(np.float32)])
    chunks = list(engine.chat(ChatTurn((ChatMessage("user", (question,)),), speech=True)))
    assert chunks[0].prefilled and chunks[0].input_tokens > 0
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    assert chunks[-1].output_tokens > 0 and not chunks[-1].cut
    assert all(c.audio.size > 0 for c in chunks if c.text.strip())
    # History is honoured; text only when speech is off; what cannot be used is reported.
    history = (
        ChatMessage("system", ("Answer in one short sentence.",)),
        ChatMessage("user", ("What is the capital of France?",)),
        ChatMessage("assistant", ("The capital of France is Paris.",)),
        ChatMessage("user", ("And of Germany?", b"\xff\xd8\xff-an-image")),
    )
    chunks = list(engine.chat(ChatTurn(history, temperature=0.7)))
    assert "Berlin" in "".join(c.text for c in chunks)
    assert all(c.audio.size == 0 for c in chunks)
    assert any("image" in note for note in chunks[-1].ignored)
    assert any("temperature" in note for note in chunks[-1].ignored)
    short = list(engine.chat(ChatTurn(history, max_new_tokens=3)))
    assert short[-1].cut and short[-1].output_tokens == 3
    with pytest.raises(ValueError):
        list(engine.chat(ChatTurn((ChatMessage("assistant", ("hi",)),))))


def test_a_spoken_chat_turn_without_instructions_is_asked_for_a_brief_plain_answer(
    engine, monkeypatch
):
    """Heard, not read: the default instructions of a spoken turn ask for a few plain
    sentences (a text turn keeps the plain default; a client's own instructions win), and
    markdown's marks in a reply are not spoken."""
    from omnifabric.worker.engine import ChatMessage, ChatTurn
    from omnifabric.worker.engines.reference.engine import unformatted

    prompts: list[str] = []
    opened = engine.llm.conversation

    def conversation(prompt):
        prompts.append(prompt)
        return opened(prompt)

    monkeypatch.setattr(engine.llm, "conversation", conversation)
    ask = (ChatMessage("user", ("Hi.",)),)
    for turn in (
        ChatTurn(ask, speech=True, max_new_tokens=2),
        ChatTurn(ask, max_new_tokens=2),
        ChatTurn((ChatMessage("system", ("Be terse.",)), *ask), speech=True, max_new_tokens=2),
    ):
        list(engine.chat(turn))
    assert prompts == [engine.spoken_prompt, engine.default_prompt, "Be terse."]
    spoken: list[str] = []
    monkeypatch.setattr(engine.tts, "synthesize", lambda text: spoken.append(text) or np.ones(4))
    chunk = engine._said("1. **Density**: ", True)
    assert chunk.text == "1. **Density**: " and spoken == ["1. Density:"]
    assert unformatted("## Rain\n- falls as `water`") == "Rain\nfalls as water"
    assert engine._said("**", True).audio.size == 0 and spoken == ["1. Density:"]


def test_chat_reports_every_unusable_field(engine):
    from omnifabric.worker.engine import ChatMessage, ChatTurn

    turn = ChatTurn(
        (
            ChatMessage("system", ("Be brief.", np.zeros(16000, np.float32))),
            ChatMessage("user", ("Hi",)),
        ),
        max_new_tokens=4,
        tts_mode="voice_cloning",
        language="fr",
        use_image_id=True,
        omni_mode=True,
        enable_thinking=True,
        top_p=0.8,
        length_penalty=1.1,
    )
    ignored = " ".join(list(engine.chat(turn))[-1].ignored)
    for word in (
        "tts mode",
        "language",
        "image config",
        "omni_mode",
        "enable_thinking",
        "system audio",
        "top_p",
        "length_penalty",
    ):
        assert word in ignored, word


def test_session_turn_taking_settings_reach_the_session(engine):
    # The question has ~2.5 s of speech: with 5 s required it is never a turn.
    steps = drive(engine, "question", settings=DuplexSettings(min_speech_ms=5000))
    assert all(s.result.is_listen and not s.result.end_of_turn for s in steps)
    session = engine.open_session("test-settings", "audio")
    try:
        settings = DuplexSettings(vad_threshold=0.8, end_of_turn_silence_ms=1200)
        session.prepare("", None, None, settings)
        assert session.vad.threshold == 0.8 and session.turn.rules.end_silence_s == 1.2
        assert session.notes == ()
    finally:
        session.close()


class _Work:
    """Stand-ins for the reply and the recognizers: `seconds` of sleep each, one at a time
    when `serial` (threads that slow each other down), else side by side."""

    def __init__(self, seconds: float, serial: bool) -> None:
        import threading

        self.seconds = seconds
        self.lock = threading.Lock() if serial else contextlib.nullcontext()

    def _do(self) -> None:
        import time

        with self.lock:
            time.sleep(self.seconds)

    def chat(self, turn):
        self._do()
        yield from ()

    def hear(self, audio):
        self._do()


@pytest.mark.parametrize(("serial", "counted"), [(True, 1), (False, 2)])
def test_the_engine_threads_counted_are_those_that_run_at_full_speed_together(serial, counted):
    """Warm-up runs two replies at once against one alone: threads that share the cores
    (here: take turns) count as one; threads that do not slow each other count whole."""
    e = ReferenceEngine(slots=2, threads=2)
    work = _Work(0.4, serial)
    e.chat = work.chat  # type: ignore[method-assign]
    e._asr = work  # type: ignore[assignment]
    assert e._measure_parallel(None, np.zeros(16000, np.float32), alone_s=0.8) == counted
