"""The resume journal's bound: the newest results whole, older ones as their shape."""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from omnifabric.worker.engine import GenerateResult
from omnifabric.worker.journal import JOURNAL_AUDIO_RESULTS, PRUNED_TEXT, Journal
from omnifabric.worker.session_types import (
    CloseReason,
    SessionEnd,
    UnitOutput,
    UnitTimings,
    Usage,
)


def unit(seq: int) -> UnitOutput:
    """Unit `seq`: every 5th listens, the rest speak (text on odd seqs, speech on even),
    every 7th ends a turn, every 11th is buffered, every 17th is a finalize's early output."""
    listen = seq % 5 == 0
    text = "" if listen or seq % 2 == 0 else f"word{seq}"
    audio = np.ones(2400 if not listen and seq % 2 == 0 else 0, dtype=np.float32)
    result = GenerateResult(
        is_listen=listen, text=text, audio=audio, end_of_turn=seq % 7 == 0, kv_cache_length=seq
    )
    return UnitOutput(
        seq=seq,
        result=result,
        timings=UnitTimings(prefill_ms=1.0),
        usage=Usage(),
        dropped_seqs=[seq - 1] if seq % 13 == 0 else [],
        buffered=seq % 11 == 0,
        early=seq % 17 == 0,
    )


async def read_all(journal: Journal) -> list:
    return [event async for event in journal.events()]


def test_old_results_keep_their_shape_and_memory_stays_flat():
    async def run() -> None:
        keep, total = 150, 5000
        journal = Journal(asyncio.get_running_loop(), keep)
        for seq in range(1, total + 1):
            journal.emit(unit(seq))
            if seq == 1000:
                at_1000 = sys.getsizeof(journal._pruned_seqs) + sys.getsizeof(journal._pruned_flags)
        journal.emit(SessionEnd(CloseReason.CLIENT_CLOSED, "", Usage(), total, 0))
        assert journal.length == total + 1 and journal.pruned == total + 1 - keep
        assert len(journal._events) == keep
        shapes = sys.getsizeof(journal._pruned_seqs) + sys.getsizeof(journal._pruned_flags)
        assert shapes - at_1000 < 12 * (total - 1000)  # 9 bytes a pruned result, + slack
        events = await read_all(journal)
        assert len(events) == total + 1 and isinstance(events[-1], SessionEnd)
        for seq, event in enumerate(events[:-1], start=1):
            want = unit(seq)
            assert event.seq == seq and event.buffered == want.buffered
            assert event.early == want.early
            r = event.result
            assert r.is_listen == want.result.is_listen
            assert r.end_of_turn == want.result.end_of_turn
            if seq <= total + 1 - keep:  # pruned: shape only
                assert event.pruned
                assert r.text == (PRUNED_TEXT if want.result.text else "")
                assert event.audio_dropped == bool(want.result.audio.size)
                assert r.audio.size == 0 and r.kv_cache_length == 0
            else:
                assert not event.pruned and r.text == want.result.text
                assert r.kv_cache_length == seq
                if seq > total - JOURNAL_AUDIO_RESULTS:
                    assert r.audio.size == want.result.audio.size

    asyncio.run(run())


def test_a_stream_reading_live_is_not_disturbed_by_pruning():
    """A stream reading as results come gets every one whole, pruning behind it."""

    async def run() -> None:
        journal = Journal(asyncio.get_running_loop(), 3)
        seen = []

        async def reader() -> None:
            async for event in journal.events():
                seen.append(event)

        task = asyncio.create_task(reader())
        for seq in range(1, 51):
            journal.emit(unit(seq))
            await asyncio.sleep(0)
        journal.emit(SessionEnd(CloseReason.CLIENT_CLOSED, "", Usage(), 50, 0))
        await asyncio.wait_for(task, 5)
        assert [e.seq for e in seen[:-1]] == list(range(1, 51))
        assert not any(e.pruned for e in seen[:-1])
        assert journal.pruned == 48

    asyncio.run(run())


def test_an_edge_numbers_a_pruned_replay_as_it_numbered_the_live_events():
    """The worker's journal (3 kept whole) through its wire form to a resuming edge: events
    the client already has may come from pruned results (numbered the same); a resume that
    would send one again is refused, in both Realtime dialects and the gRPC one."""
    import pytest

    from omnifabric.edge import errors
    from omnifabric.edge import events as ev
    from omnifabric.edge.dialects import realtime
    from omnifabric.edge.dialects.grpc_realtime import GrpcRealtime
    from omnifabric.edge.worker_client import output_from
    from omnifabric.worker.service import encode_event

    def wire(event: UnitOutput) -> ev.Output:
        return output_from(encode_event(event).result)

    async def replayed() -> list[ev.Output]:
        journal = Journal(asyncio.get_running_loop(), 3)
        for seq in range(1, 31):
            journal.emit(unit(seq))
        events = []
        for _ in range(30):
            events.append(journal._at(len(events)))
        return [wire(e) for e in events if not e.buffered]

    outputs = asyncio.run(replayed())
    assert sum(o.pruned for o in outputs) == 25  # 27 pruned, 2 of them buffered
    whole = [wire(unit(seq)) for seq in range(1, 31) if seq % 11]
    for variant in ("session.init", "session.update"):
        live = realtime.RealtimeDuplex("audio")
        frame = {"type": variant, "payload": {}} if variant == "session.init" else {"type": variant}
        live.decode(_frame(frame))
        live.encode(ev.Created("rt_1", 10, (), "tok", 30.0))
        sent = [m for out in whole for m in live.encode(out)]
        state = live.client_state()
        first_whole = next(i for i, o in enumerate(outputs) if not o.pruned)
        # Everything from the first whole output's first event on can be sent again.
        boundary = sum(len(r) for r in _rendered(variant, whole[:first_whole])) + 1
        again = realtime.RealtimeDuplex("audio", "tok", str(boundary))
        again.refusal()
        attached = ev.Reattached("rt_1", 10, (), state, tuple(outputs), "tok", 30.0)
        resumed, *missed = again.replay(attached)
        assert missed == [m for m in sent if m["seq"] > boundary] and missed
        late = realtime.RealtimeDuplex("audio", "tok", str(boundary - 1))
        late.refusal()
        with pytest.raises(errors.ResumeExpired):
            late.replay(attached)
    grpc_dialect = GrpcRealtime()
    grpc_dialect.last_seq = 1 + first_whole
    attached = ev.Reattached("rt_1", 10, (), b"", tuple(outputs), "tok", 30.0)
    _, *missed = grpc_dialect.replay(attached)
    assert [m.output.seq for m in missed] == [o.seq for o in whole[first_whole:]]
    grpc_dialect = GrpcRealtime()
    grpc_dialect.last_seq = first_whole
    with pytest.raises(errors.ResumeExpired):
        grpc_dialect.replay(attached)


def _frame(message: dict) -> str:
    import json

    return json.dumps(message)


def _rendered(variant: str, outputs: list) -> list[list[dict]]:
    from omnifabric.edge import events as ev
    from omnifabric.edge.dialects import realtime

    dialect = ev.Dialect.FIRST if variant == "session.update" else ev.Dialect.CURRENT
    renderer = realtime.OutputRenderer(dialect, "rt_1")
    return [renderer.render(o) for o in outputs]
