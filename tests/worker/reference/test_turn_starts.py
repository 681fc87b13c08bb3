"""tools/turn_starts on the real reference engine: a question's reply start is found and
timed the way `omnifabric eval` times it."""

from __future__ import annotations

from omnifabric.tools.eval_reference import ITEMS
from omnifabric.tools.turn_starts import drive
from omnifabric.worker.engine import REPLY_START_HOW


def test_a_questions_reply_start_is_found_and_timed(inline_engine):
    start = drive(inline_engine, ITEMS[0], "piper", 0)  # the capital of France, Piper's voice
    assert start.how in REPLY_START_HOW and start.unit > 0
    assert "endpoint" in start.parts_ms
    # The first audio leaves after the question's end, within the unit that ends the turn
    # and the one after it (and its compute).
    assert start.first_audio_s is not None and 0 < start.first_audio_s < 3.0
    assert start.gap_s >= 0.0


def test_the_reply_timed_is_the_last_turns(inline_engine):
    two_turns = next(item for item in ITEMS if len(item.turns) == 2)  # My name is Anna. / ...
    start = drive(inline_engine, two_turns, "piper", 11)
    assert start.first_audio_s is not None and 0 < start.first_audio_s < 3.0
