"""The client's idea of when the model's last reply is over (probe and eval keep sending
silence after their input until then)."""

from __future__ import annotations

from omnifabric.tools.client import SessionReport, UnitRecord


def report(*kinds: str) -> SessionReport:
    """Units 1.. answered as `kinds`: L listen, S speak, E speak ending the turn, - none."""
    out = SessionReport()
    for seq, kind in enumerate(kinds, 1):
        name = {"L": "listen", "S": "speak", "E": "speak", "-": ""}[kind]
        out.units[seq] = UnitRecord(seq=seq, sent_at=0.0, kind=name, end_of_turn=kind == "E")
    return out


def test_the_last_reply_counts_not_the_first():
    # Two questions in 6 units of input: the first reply ended inside the input, the second
    # is still being spoken when the input ends: not done (before, the first one counted).
    assert not report("L", "S", "E", "L", "L", "S", "S").reply_done(6)
    assert report("L", "S", "E", "L", "L", "S", "S", "E").reply_done(6)
    assert report("L", "S", "S", "L").reply_done(3)  # a listen after speech ends it too


def test_a_reply_that_ended_within_the_input_waits_for_a_last_question():
    done_early = report("S", "E", "L", "L")  # 4 units of input, the reply at units 1-2
    assert not done_early.reply_done(4)
    assert not report("S", "E", "L", "L", "L").reply_done(4)  # one quiet unit after
    assert report("S", "E", "L", "L", "L", "L").reply_done(4)  # two: nothing more came
    # A reply that starts after the input is waited for to its end.
    assert not report("S", "E", "L", "L", "L", "S").reply_done(4)
    assert report("S", "E", "L", "L", "L", "S", "E").reply_done(4)


def test_no_speech_is_no_reply():
    assert not report("L", "L", "L", "L").reply_done(2)
    assert not report().reply_done(0)
