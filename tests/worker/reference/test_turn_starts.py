"""tools/turn_starts on the real reference engine: a question's reply start is found and
timed the way `omnifabric eval` times it."""

from __future__ import annotations

import pytest

from omnifabric.tools.eval_reference import ITEMS
from omnifabric.tools.turn_starts import drive
from omnifabric.worker.engine import REPLY_START_HOW

#: The latest first audio these tests accept, s: the first test's reasons.
SLOW_HOST_S = 6.0


def test_a_questions_reply_start_is_found_and_timed(inline_engine):
    start = drive(inline_engine, ITEMS[0], "piper", 0)  # the capital of France, Piper's voice
    assert start.how in REPLY_START_HOW and start.unit > 0
    assert "endpoint" in start.parts_ms
    # The first audio leaves after the question's end, within the unit that ends the turn
    # and the one after it, and its compute: a few seconds at most (on a slow 2-core host
    # whose neighbours took its cores, 3.8-4.2 s were seen; docs/performance.md, "A slower
    # 2-core host").
    assert start.first_audio_s is not None and 0 < start.first_audio_s < SLOW_HOST_S
    assert start.gap_s >= 0.0


@pytest.mark.ci_long  # two questions through the real models: ~7 s (tests/conftest.py)
def test_the_reply_timed_is_the_last_turns(inline_engine):
    two_turns = next(item for item in ITEMS if len(item.turns) == 2)  # My name is Anna. / ...
    start = drive(inline_engine, two_turns, "piper", 11)
    assert start.first_audio_s is not None and 0 < start.first_audio_s < SLOW_HOST_S


def test_paced_units_are_the_edges_and_the_reply_is_timed_from_them(inline_engine):
    # --paced: the audio through the edge's own paced cadence (whole seconds, a shorter
    # unit where the words stop), the session told its units are cut so (speech_cuts).
    import numpy as np

    from omnifabric.tools.eval_reference import LEAD_INS_S, VOICES, compose
    from omnifabric.tools.turn_starts import paced_units

    voice, rate = VOICES["piper"][0]
    units, _, end_s = compose(ITEMS[0], "piper", voice, rate, LEAD_INS_S[0], 0)
    stream = np.concatenate(units)
    timed = paced_units(stream)
    assert sum(u.size for u, _ in timed) <= stream.size  # nothing made up, nothing padded
    # The words' end goes a few tenths after them (here with a whole second that happened
    # to end then), and a short unit within the second after them.
    after = [(u.size, t - end_s) for u, t in timed if t > end_s]
    assert after[0][1] < 0.35
    assert any(size < 16000 and t < 1.0 for size, t in after)
    start = drive(inline_engine, ITEMS[0], "piper", 0, paced=True)
    assert start.how in REPLY_START_HOW and start.sent_s is not None
    assert start.first_audio_s is not None and start.sent_s < start.first_audio_s < SLOW_HOST_S
