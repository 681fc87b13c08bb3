"""The edge's unit cadence (edge.cadence) without I/O: cut and paced, as the driver calls
them."""

from __future__ import annotations

import contextvars

import numpy as np
import pytest

from omnifabric.edge import events as ev
from omnifabric.edge import pcm
from omnifabric.edge.cadence import (
    CUT,
    CUT_QUIET_S,
    FILL_GRACE_S,
    IN_FLIGHT_UNITS,
    MAX_BACKLOG_S,
    NEXT_CUT_QUIET_S,
    PACED,
    CutCadence,
    PacedCadence,
    SpeechEnd,
    for_traits,
    unit_length,
)


def _out(seq: int, dropped: tuple[int, ...] = ()) -> ev.Output:
    return ev.Output(seq, True, "", b"", False, 0, {}, ev.Usage(), dropped_seqs=dropped)


def _samples(units: list[ev.AppendCommand]) -> np.ndarray:
    return np.frombuffer(b"".join(u.pcm for u in units), "<f4")


def test_the_traits_name_the_cadence():
    assert isinstance(for_traits(CUT), CutCadence)
    assert isinstance(for_traits(PACED), PacedCadence)
    assert for_traits(None) is None
    with pytest.raises(ValueError):
        for_traits("jazz")


def test_the_unit_is_a_second_within_the_workers_bounds():
    assert unit_length(None) == 16000
    assert unit_length((1600, 480000)) == 16000
    assert unit_length((20000, 480000)) == 20000  # a worker that takes longer units only
    assert unit_length((1600, 8000)) == 8000


def test_cut_gathers_to_the_shortest_then_sends_all_in_equal_parts():
    c = CutCadence()
    audio = np.arange(100000, dtype=np.float32)
    c.push(audio[:3000], 16000)
    assert c.due(0.0, clock=False) == []  # not started: nothing goes
    c.start((4000, 30000), 0.0)
    assert c.due(0.0, clock=False) == []  # 3000 < the shortest unit
    c.push(audio[3000:70000], 16000)
    units = c.due(0.0, clock=False)
    assert [len(u.pcm) // 4 for u in units] == [23333, 23333, 23334]
    assert np.array_equal(_samples(units), audio[:70000])  # nothing lost or reordered
    c.push(audio[70000:71000], 16000)
    c.clear()  # an answer began: what waited is dropped
    c.push(audio[71000:75000], 16000)
    assert np.array_equal(_samples(c.due(0.0, clock=False)), audio[71000:75000])
    (stop,) = c.end_turn()
    assert stop.force_listen and len(stop.pcm) == 16000 * 4 and not _samples([stop]).any()


def test_paced_sends_one_unit_in_flight_and_the_next_when_answered():
    c = PacedCadence()
    c.push(np.full(16000 * 3, 0.5, np.float32), 16000)  # 3 s, before the start
    assert c.due(100.0, clock=True) == []  # held until the session starts
    c.start((1600, 480000), 100.0)
    (first,) = c.due(100.0, clock=False)
    assert len(first.pcm) == 16000 * 4 and not first.force_listen
    c.sent(1, 100.0)
    assert c.due(100.1, clock=True) == []  # one unit in flight
    c.answered(_out(1))
    (second,) = c.due(100.2, clock=False)
    c.sent(2, 100.2)
    c.answered(_out(3, dropped=(2,)))  # a unit the worker joined into another is answered
    (third,) = c.due(100.3, clock=False)
    c.sent(3, 100.3)
    # An unanswered unit holds the next back only so long.
    c.push(np.zeros(16000, np.float32), 16000)
    assert c.due(100.3 + IN_FLIGHT_UNITS - 0.01, clock=True) == []
    assert len(c.due(100.3 + IN_FLIGHT_UNITS, clock=True)) == 1


def test_paced_fills_a_late_second_with_silence_and_resamples_as_a_stream():
    c = PacedCadence()
    c.start(None, 10.0)
    assert c.due(10.0 + 1.0, clock=True) == []  # within the grace
    tone = np.sin(np.arange(12000) / 10.0).astype(np.float32)  # half a second at 24 kHz
    for piece in np.split(tone, 5):  # as a client streams it
        c.push(piece, 24000)
    assert c.due(10.0 + 1.0, clock=False) == []  # not a whole unit, and no clock
    (unit,) = c.due(10.0 + 1.0 + FILL_GRACE_S, clock=True)
    got = np.frombuffer(unit.pcm, "<f4")
    one = pcm.Resampler(24000, 16000)  # the same stream, in one piece
    heard = one.process(tone)
    assert got.size == 16000 and 7800 < heard.size <= 8000  # a few ms held back ...
    # ... paid once, as that much silence before the stream
    lead = np.flatnonzero(got)[0]
    assert 0 < lead <= 200 and not got[:lead].any()
    assert np.allclose(got[lead : lead + heard.size], heard, atol=1e-6)  # no seam
    assert not got[lead + heard.size :].any()


@pytest.mark.parametrize("append_ms", [20, 100])
def test_paced_a_unit_is_whole_once_the_clients_second_has_come(append_ms):
    # The resampler holds back a few ms; paid up front, a unit never waits for the
    # client's next append (it cost every unit one append's time: 100 ms with 100 ms).
    c = PacedCadence()
    c.start(None, 0.0)
    piece = 24 * append_ms
    tone = np.sin(np.arange(24000 * 2) / 7.0).astype(np.float32)
    for n, start in enumerate(range(0, tone.size, piece), start=1):
        c.push(tone[start : start + piece], 24000)
        units = c.due(0.0, clock=False)
        if n * append_ms < 1000:
            assert units == []
        elif n * append_ms == 1000:
            assert len(units) == 1  # the append that completes the second
            c.sent(1, 0.0)
            c.answered(_out(1))


def test_paced_end_turn_sends_what_came_at_once_with_force_listen():
    c = PacedCadence()
    c.start(None, 0.0)
    c.push(np.full(4000, 0.2, np.float32), 16000)
    assert c.end_turn() == []
    (unit,) = c.due(0.01, clock=False)
    assert unit.force_listen and len(unit.pcm) == 16000 * 4
    c.sent(1, 0.01)
    c.answered(_out(1))
    c.push(np.zeros(16000, np.float32), 16000)
    (nxt,) = c.due(0.02, clock=False)
    assert not nxt.force_listen


def _speech(seconds: float, level: float = 0.1) -> np.ndarray:
    """A voice-like stand-in: a tone whose RMS is `level`."""
    n = int(seconds * 16000)
    return (level * np.sqrt(2) * np.sin(np.arange(n) * 0.19)).astype(np.float32)


def _stream(c: PacedCadence, audio: np.ndarray, append_ms: int = 100) -> list[list[int]]:
    """Push `audio` in appends as a real-time client does, each unit sent answered at
    once; per append, the lengths of the units that went."""
    step = 16 * append_ms
    went = []
    for n, start in enumerate(range(0, audio.size, step), start=1):
        c.push(audio[start : start + step], 16000)
        units = c.due(n * append_ms / 1000, clock=False)
        for seq, unit in enumerate(units, start=1):
            c.sent(seq, 0.0)
            c.answered(_out(seq))
            assert not unit.force_listen
        went.append([len(u.pcm) // 4 for u in units])
    return went


def test_paced_sends_what_came_when_speech_stops_in_a_unit():
    c = PacedCadence()
    c.start((1600, 64000), 0.0, short_units=True)  # a worker that takes units of 0.1 s
    quiet = np.full(int(2.5 * 16000), 0.0005, np.float32)  # a quiet line, not digital zero
    audio = np.concatenate([_speech(0.5), quiet])
    went = _stream(c, audio)
    sent = [(i, n) for i, lengths in enumerate(went) for n in lengths]
    # CUT_QUIET_S of quiet after the words: what came so far goes (not the second) ...
    first = round((0.5 + CUT_QUIET_S) * 10) - 1  # the append that completes the quiet
    assert sent[0] == (first, int((0.5 + CUT_QUIET_S) * 16000))
    # ... then once more after NEXT_CUT_QUIET_S more quiet, then whole seconds
    second = first + round(NEXT_CUT_QUIET_S * 10)
    assert sent[1] == (second, int(NEXT_CUT_QUIET_S * 16000))
    assert sent[2] == (second + 10, 16000)
    # nothing lost, nothing padded: the units are the stream
    assert all(n == 16000 for _, n in sent[2:])
    assert sum(n for _, n in sent) + c.held_samples == audio.size


def test_paced_cuts_where_the_words_ended_in_the_unit_before():
    # The words end just before a second is up: the second goes whole, and what follows
    # goes once the quiet after the words is long enough, not a second later.
    c = PacedCadence()
    c.start((4000, 64000), 0.0, short_units=True)
    audio = np.concatenate([_speech(0.9), np.zeros(16000 * 2, np.float32)])
    sent = [n for lengths in _stream(c, audio) for n in lengths]
    # 0.1 + 0.2 s of quiet; the shortest unit taken is 0.25 s: the append that passes it
    assert sent[:2] == [16000, 4800]


@pytest.mark.parametrize(
    ("bounds", "short_units", "noise"),
    [
        ((4000, 64000), True, 0.02),  # a line as loud between words as a fifth of the speech
        ((16000, 64000), True, 0.0),  # a worker that takes whole seconds only
        (None, True, 0.0),  # a worker that said nothing of its units
        ((4000, 64000), False, 0.0),  # an engine whose units are re-chunked (MiniCPM-o)
    ],
)
def test_paced_keeps_whole_seconds_where_it_cannot_cut(bounds, short_units, noise):
    c = PacedCadence()
    c.start(bounds, 0.0, short_units)
    rng = np.random.default_rng(1)
    after = (noise * rng.standard_normal(16000 * 2)).astype(np.float32)
    sent = [n for lengths in _stream(c, np.concatenate([_speech(0.5), after])) for n in lengths]
    assert sent == [16000, 16000]


def test_speech_end_needs_speech_before_the_quiet():
    end = SpeechEnd()
    end.feed(np.zeros(16000 * 3, np.float32))
    assert not end.cut_due  # silence alone is not the end of anything
    end.feed(_speech(0.2))
    end.feed(np.zeros(int(CUT_QUIET_S * 16000) - 320, np.float32))
    assert not end.cut_due
    end.feed(np.zeros(320 + 100, np.float32))  # pieces need not be whole frames
    assert end.cut_due


def test_paced_keeps_at_most_the_backlog_and_counts_what_it_dropped():
    c = PacedCadence()
    rate = 16000
    c.push(np.arange(int(MAX_BACKLOG_S * rate) + rate, dtype=np.float32), rate)
    assert c.held_samples == int(MAX_BACKLOG_S * rate)
    assert c.dropped_s == pytest.approx(1.0)
    c.start(None, 0.0)
    (unit,) = c.due(0.0, clock=False)  # the newest audio is kept, the oldest dropped
    assert np.frombuffer(unit.pcm, "<f4")[0] == pytest.approx(rate)
    slow = PacedCadence()  # 8 kHz audio is held as the engine hears it: 16 kHz
    slow.push(np.zeros(8000 * 12, np.float32), 8000)
    assert slow.held_samples == int(MAX_BACKLOG_S * rate)


def test_a_change_of_rate_keeps_what_the_old_rate_held():
    c = PacedCadence()
    c.push(np.full(8000, 0.5, np.float32), 8000)  # a second at 8 kHz
    c.push(np.full(12000, 0.5, np.float32), 24000)  # half a second at 24 kHz
    assert abs(c.held_samples - (16000 + 8000)) < 200  # the newest few ms still held back
    c.start(None, 0.0)
    (unit,) = c.due(0.0, clock=False)
    steady = np.frombuffer(unit.pcm, "<f4")[500:15500]
    assert np.allclose(steady, 0.5, atol=0.01)


def test_a_closed_cadence_sends_nothing():
    c = PacedCadence()
    c.start(None, 0.0)
    c.push(np.zeros(32000, np.float32), 16000)
    c.close()
    assert c.due(5.0, clock=True) == [] and c.end_turn() == [] and c.due(5.0, False) == []


def test_the_worker_is_told_where_the_edge_cuts_units_at_speech_ends():
    """SessionStart.speech_cuts: on for a dialect whose cadence cuts a unit where speech
    stops (the OpenAI dialect's paced one), off for half-duplex calls' cut cadence and for
    clients of whole units (the worker's engine may leave its work on words so far to the
    cut that follows: the reference engine's guesses)."""
    from omnifabric.edge.dialects.half_duplex import HalfDuplex
    from omnifabric.edge.dialects.openai.translator import OpenAIRealtime
    from omnifabric.edge.dialects.realtime import RealtimeDuplex
    from omnifabric.edge.worker_client import lease_from, start_request
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb

    paced = for_traits(OpenAIRealtime.traits.cadence)
    assert paced is not None and paced.speech_cuts
    cut = for_traits(HalfDuplex.traits.cadence)
    assert cut is not None and not cut.speech_cuts
    assert for_traits(RealtimeDuplex.traits.cadence) is None
    lease = lease_from(scheduler_pb.Lease(lease_id="l1"))
    init = ev.InitCommand(dialect=ev.Dialect.CURRENT)
    for cuts in (True, False):
        start = start_request(lease, "s1", "audio", init, speech_cuts=cuts).start
        assert start.speech_cuts is cuts
    # A gRPC client says so itself (SessionInit.speech_cuts); its dialect has no cadence.
    from omnifabric.edge.dialects.grpc_realtime import init_command
    from omnifabric.edge.session import SessionCore
    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

    async def emit(event: object) -> None:
        pass

    def traits(edge_cuts: bool, init: ev.InitCommand) -> tuple[bool, bool]:
        core = SessionCore("audio", fabric=None, emit=emit, speech_cuts=edge_cuts)  # type: ignore[arg-type]
        return core.sender_traits(init)

    for edge_cuts in (False, True):
        # (a core binds its session to the logs' context: a copy of this one, kept apart)
        assert contextvars.copy_context().run(traits, edge_cuts, init) == (False, edge_cuts)
        for asked in (False, True):
            msg = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, speech_cuts=asked)
            assert init_command(msg).speech_cuts is asked
            found = contextvars.copy_context().run(traits, edge_cuts, init_command(msg))
            assert found == (False, asked)
