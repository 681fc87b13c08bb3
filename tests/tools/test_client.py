"""The client's idea of when the model's last reply is over (probe and eval keep sending
silence after their input until then)."""

from __future__ import annotations

import pytest

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


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_waits_for_the_engine_are_engine_time_not_overhead(tmp_path):
    """A unit that waits in the worker for the session's earlier unit, for its compute
    (engine_busy_ms) or for its deferred finalize (finalize_wait_ms: the next second of
    speech on a real engine), counts the wait as engine time, and the overhead is the
    fabric's share only (issue 36: the probe read 369-564 ms of "overhead" on the reference
    engine)."""
    import asyncio

    from omnifabric.tools.client import SILENCE_UNIT, run_session
    from tests.conftest import scaled
    from tests.stack import Stack

    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "1", "--compute-ms", "400", "--finalize-ms", "500")
        stack.start_edge()
        url = f"{stack.url}?mode=audio"

        async def both():
            # Each unit as soon as the previous answer came: it waits for that finalize.
            lockstep = await run_session(url, [SILENCE_UNIT] * 4, pace_s=0.0)
            # A second unit 0.1 s after the first: it waits for the first one's compute.
            early = await run_session(url, [SILENCE_UNIT] * 2, pace_s=0.1)
            return lockstep, early

        lockstep, early = asyncio.run(asyncio.wait_for(both(), scaled(90)))
    finally:
        stack.stop()
    units = [lockstep.units[seq] for seq in sorted(lockstep.units)]
    assert [u.kind for u in units] == ["listen"] * 4, units
    for u in units[1:]:
        assert u.finalize_wait_ms > 200, u  # 500 ms less the round trip to the client
    second = early.units[2]
    assert second.kind == "listen" and second.engine_busy_ms > 150, second
    answered = [*units[1:], second]
    for u in answered:
        assert u.rtt_ms is not None and u.overhead_ms == u.rtt_ms - u.engine_ms
    overheads = sorted(u.overhead_ms for u in answered if u.overhead_ms is not None)
    assert overheads[len(overheads) // 2] < 200, overheads  # no wait of 300-500 ms in it
