"""The unit loop's pieces without gRPC: mailbox (newest wins), lease book, session ends."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omnifabric.worker import mailbox as mailbox_module
from omnifabric.worker.engine import DuplexSettings, GenerateResult
from omnifabric.worker.engines.synthetic import SyntheticEngine, SyntheticSession
from omnifabric.worker.errors import LeaseInUse, LeaseNotFound, ModeMismatch
from omnifabric.worker.leases import LeaseBook, LeaseGrant
from omnifabric.worker.mailbox import Mailbox
from omnifabric.worker.runner import TimeSliced
from omnifabric.worker.session import DuplexSession
from omnifabric.worker.session_types import CloseReason, SessionEnd, SessionLimits, SessionSpec
from omnifabric.worker.units import UnitInput
from tests.conftest import scaled

SILENCE = np.zeros(16000, dtype=np.float32)


def test_mailbox_newest_wins():
    box = Mailbox()
    for seq in (1, 2, 3):
        box.put(UnitInput(seq=seq, pcm=SILENCE))
    assert [u.seq for u in box.take_all()] == [3]
    assert box.take_all() == []
    assert box.take_dropped() == [1, 2] and box.take_dropped() == []
    box.put(UnitInput(seq=4, pcm=SILENCE))
    box.discard()
    assert box.dropped_total == 3
    box.join = True  # re-chunked sessions keep every waiting unit
    for seq in (5, 6):
        box.put(UnitInput(seq=seq, pcm=SILENCE))
    assert [u.seq for u in box.take_all()] == [5, 6] and box.take_dropped() == []


class HearingEngine(SyntheticEngine):
    """The synthetic engine, keeping the audio of every unit its sessions prefill; with
    `model_unit` its sessions take units of exactly that many samples (re-chunked)."""

    def __init__(self, compute_ms: float, model_unit: int = 0, **kw) -> None:
        super().__init__(compute_ms=compute_ms, **kw)
        self.heard: list[np.ndarray] = []
        self.model_unit = model_unit

    def open_session(self, session_id: str, mode: str) -> SyntheticSession:
        engine_session = super().open_session(session_id, mode)
        prefill = engine_session.prefill
        if self.model_unit:
            sizes = (self.model_unit, self.model_unit)
            engine_session.unit_samples = lambda: sizes  # type: ignore[method-assign]

        def hearing(pcm, frames, max_slice_nums):
            self.heard.append(np.array(pcm, copy=True))
            return prefill(pcm, frames, max_slice_nums)

        engine_session.prefill = hearing  # type: ignore[method-assign]
        return engine_session


async def feed_a_slow_engine(half_duplex: bool, units: int = 6, model_unit: int = 0):
    """`units` half-second units, one every 10 ms, to an engine taking 60 ms a unit (of
    `model_unit` samples, re-chunked, when given): the audio it heard (joined), the seqs
    answered with a model step, those answered as buffered, and the session's end."""
    engine = HearingEngine(compute_ms=60, model_unit=model_unit)
    executor = ThreadPoolExecutor(2)
    spec = SessionSpec(
        session_id="s", lease_id="l", mode="audio", settings=DuplexSettings(half_duplex=half_duplex)
    )
    session = DuplexSession(spec, engine, executor, SessionLimits(60, 8192))
    await session.open()
    runner = asyncio.ensure_future(session.run())
    for seq in range(1, units + 1):
        session.submit(UnitInput(seq=seq, pcm=np.full(8000, seq / 100, np.float32)))
        await asyncio.sleep(0.01)
    served: list[int] = []
    buffered: list[int] = []
    async for event in session.journal.events():
        if isinstance(event, SessionEnd):
            break
        (buffered if event.buffered else served).append(event.seq)
        if event.seq == units:
            session.close(CloseReason.USER_STOP)
    end = await asyncio.wait_for(runner, scaled(5))
    executor.shutdown()
    return np.concatenate(engine.heard), served, buffered, end


async def test_a_half_duplex_turn_loses_no_audio_to_a_slow_engine():
    """Units arriving faster than the engine serves them: a half-duplex call hears all of
    their audio in order (those that waited joined into one unit, the others answered as
    buffered); a duplex session keeps the newest (real time first)."""
    sent = np.concatenate([np.full(8000, seq / 100, np.float32) for seq in range(1, 7)])
    heard, served, buffered, end = await feed_a_slow_engine(half_duplex=True)
    assert np.array_equal(heard, sent) and end.units_dropped == 0
    assert sorted(served + buffered) == [1, 2, 3, 4, 5, 6] and buffered and served[-1] == 6
    assert len(served) < 6  # fewer model steps than units: the waiting ones were joined

    heard, served, buffered, end = await feed_a_slow_engine(half_duplex=False)
    assert buffered == [] and served[0] == 1 and served[-1] == 6
    assert end.units_dropped == 6 - len(served) > 0 and len(heard) == 8000 * len(served)


async def test_a_half_duplex_turn_loses_no_audio_to_a_slow_rechunked_engine():
    """An engine that takes fixed model units (MiniCPM-o: 1 s) is fed them one by
    one: a half-duplex call hears every one, however many waited; a duplex session
    keeps the newest MAX_WAITING_MODEL_UNITS."""
    sent = np.concatenate([np.full(8000, seq / 100, np.float32) for seq in range(1, 13)])
    heard, served, buffered, end = await feed_a_slow_engine(True, units=12, model_unit=8000)
    assert end.units_dropped == 0 and np.array_equal(heard, sent)
    assert sorted(served + buffered) == list(range(1, 13))

    heard, served, buffered, end = await feed_a_slow_engine(False, units=12, model_unit=8000)
    assert end.units_dropped > 0 and len(heard) < len(sent)


async def test_the_session_says_the_engines_own_unit_when_it_rechunks():
    """DuplexSession.model_unit_samples: the engine's later unit when its units are
    re-chunked, 0 when it takes units as they come (SessionStarted.units_as_sent: the
    sender's cadence cuts short units only then)."""
    for model_unit in (0, 8000):
        spec = SessionSpec(session_id="s", lease_id="l", mode="audio")
        engine = HearingEngine(compute_ms=1, model_unit=model_unit)
        session = DuplexSession(spec, engine, ThreadPoolExecutor(1), SessionLimits(60, 8192))
        await session.open()
        assert session.model_unit_samples == model_unit
        runner = asyncio.ensure_future(session.run())
        session.close(CloseReason.USER_STOP)
        await asyncio.wait_for(runner, scaled(10))


async def test_a_half_duplex_join_keeps_the_newest_audio_within_its_cap(monkeypatch):
    """Beyond HALF_DUPLEX_JOIN_SAMPLES of waiting audio, the oldest units are dropped
    (counted), never a piece from the middle."""
    monkeypatch.setattr(mailbox_module, "HALF_DUPLEX_JOIN_SAMPLES", 16000)
    heard, served, buffered, end = await feed_a_slow_engine(half_duplex=True)
    assert end.units_dropped > 0 and served[-1] == 6
    # What was heard is the sent audio with whole units left out, in order, the last one kept.
    seqs = [round(float(v) * 100) for v in heard[::8000]]
    assert seqs == sorted(seqs) and seqs[-1] == 6 and len(heard) == 8000 * len(seqs)
    assert len(seqs) == 6 - end.units_dropped


async def test_lease_book_claims():
    book = LeaseBook()
    released = []
    book.on_released = released.append
    with pytest.raises(LeaseNotFound):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    book.grant(LeaseGrant("a", 0, "audio"))
    book.grant(LeaseGrant("v", 1, "video"))
    with pytest.raises(ModeMismatch):
        await book.claim("v", "audio", 0.05, lambda reason: None)
    revoked = []
    await book.claim("a", "audio", 0.05, revoked.append)
    with pytest.raises(LeaseInUse):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    assert book.active_ids() == ["a"]
    book.revoke("a", "gone")
    assert revoked == ["gone"] and released == []
    book.release("a")
    assert released == ["a"] and book.active_ids() == []
    with pytest.raises(LeaseInUse):
        await book.claim("a", "audio", 0.05, lambda reason: None)
    book.grant(LeaseGrant("w", 2, "audio"))
    await book.claim("w", "audio", 0.05, lambda reason: None)
    assert [g.lease_id for g in book.held()] == ["w", "v"]  # in use first
    # The registration ended: an unused grant stays for its holder a while, then goes back.
    assert book.expire_unused(0.1) == ["v"]
    book.grant(LeaseGrant("x", 3, "audio"))
    assert book.expire_unused(0.1) == ["v", "x"]
    await book.claim("x", "audio", 0.05, lambda reason: None)  # its holder came
    await asyncio.sleep(0.3)
    assert released == ["a", "v"] and [g.lease_id for g in book.held()] == ["w", "x"]


async def test_lease_book_waits_for_a_late_grant():
    book = LeaseBook()
    claim = asyncio.ensure_future(book.claim("late", "audio", scaled(2), lambda r: None))
    await asyncio.sleep(0.05)
    book.grant(LeaseGrant("late", 0, "audio"))
    assert (await asyncio.wait_for(claim, scaled(2))).lease_id == "late"


async def run_session(limits, units=(), close=None):
    executor = ThreadPoolExecutor(2)
    freed = []
    session = DuplexSession(
        SessionSpec(session_id="s", lease_id="l", mode="audio"),
        SyntheticEngine(compute_ms=0),
        executor,
        limits,
        on_freed=lambda s, report: freed.append(report),
    )
    await session.open()
    runner = asyncio.ensure_future(session.run())
    for seq in units:
        session.submit(UnitInput(seq=seq, pcm=SILENCE))
        await asyncio.sleep(0.02)
    if close:
        session.close(close)
    events = []
    async for event in session.journal.events():
        events.append(event)
    await asyncio.wait_for(runner, scaled(2))
    executor.shutdown()
    assert len(freed) == 1 and freed[0] is not None
    return events


async def serve_one_by_one(session: DuplexSession, seqs) -> asyncio.Future:
    """Open the session, serve `seqs` each after the previous one's result, then close it
    (user stop); returns its running unit loop to await."""
    await session.open()
    serving = asyncio.ensure_future(session.run())
    for seq in seqs:
        session.submit(UnitInput(seq=seq, pcm=SILENCE))
        async for event in session.journal.events():
            if event.seq == seq:
                break
    session.close(CloseReason.USER_STOP)
    return serving


class RecordingRunner(TimeSliced):
    """Today's runner, noting when each unit's run starts and its finalize is done."""

    def __init__(self, executor):
        super().__init__(executor, None, asyncio.get_running_loop())
        self.calls = []

    def run(self, session, unit, force_listen, max_slices):
        self.calls.append(("run", unit.seq))
        return super().run(session, unit, force_listen, max_slices)

    async def finalize(self, session, seq):
        spent = await super().finalize(session, seq)
        self.calls.append(("finalized", seq))
        return spent


async def test_a_given_runner_serves_each_unit_after_the_previous_finalize():
    """The seam where a batcher plugs in: a runner handed to the session runs its units and
    finalizes them, and the session starts no run before the previous finalize is done."""
    executor = ThreadPoolExecutor(2)
    runner = RecordingRunner(executor)
    session = DuplexSession(
        SessionSpec(session_id="s", lease_id="l", mode="audio"),
        SyntheticEngine(compute_ms=0, finalize_ms=50),
        executor,
        SessionLimits(60, 8192),
        runner=runner,
    )
    serving = await serve_one_by_one(session, (1, 2, 3))
    end = await asyncio.wait_for(serving, scaled(2))
    executor.shutdown()
    assert end.units_served == 3
    assert runner.calls == [(kind, seq) for seq in (1, 2, 3) for kind in ("run", "finalized")]


async def test_a_late_unit_says_where_its_time_went(caplog):
    """A short unit held behind its session's slow finalize (1.1 s here) is late, and the
    worker's log says so with the wait that made it late (the first LOGGED_LATE_UNITS)."""
    executor = ThreadPoolExecutor(2)
    session = DuplexSession(
        SessionSpec(session_id="slow", lease_id="l", mode="audio"),
        SyntheticEngine(compute_ms=0, finalize_ms=1100),
        executor,
        SessionLimits(60, 8192),
    )
    await session.open()
    serving = asyncio.ensure_future(session.run())
    results = []
    with caplog.at_level("INFO", logger="omnifabric.worker.session"):
        for seq in (1, 2):
            session.submit(UnitInput(seq=seq, pcm=SILENCE[:1600]))  # 0.1 s units
            async for event in session.journal.events():
                if event.seq == seq:
                    results.append(event)
                    break
        session.close(CloseReason.USER_STOP)
        end = await asyncio.wait_for(serving, scaled(5))
    executor.shutdown()
    assert [r.late for r in results] == [False, True] and end.late_units == 1
    lines = [r.getMessage() for r in caplog.records if " late: " in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("session slow: unit 2 late: answered 1.")
    waited = float(lines[0].split("waiting for its finalize ")[1].split(";")[0])
    assert waited >= 900  # the finalize's 1.1 s, less the time before the unit came


async def test_session_ends_once_with_the_close_reason():
    events = await run_session(SessionLimits(60, 8192), units=[1, 2], close=CloseReason.USER_STOP)
    assert [e.seq for e in events[:-1]] == [1, 2]
    assert isinstance(events[-1], SessionEnd) and events[-1].reason == CloseReason.USER_STOP


async def test_session_duration_limit():
    loop = asyncio.get_running_loop()
    began = loop.time()
    events = await run_session(SessionLimits(0.3, 8192))
    assert events[-1].reason == CloseReason.TIMEOUT
    assert 0.3 <= loop.time() - began < scaled(1.0)


async def test_session_context_cap():
    events = await run_session(SessionLimits(60, 26), units=[1, 2, 3])
    assert [type(e).__name__ for e in events] == ["UnitOutput", "SessionEnd"]
    assert events[-1].reason == CloseReason.CONTEXT_FULL


class ReplyInFinalize(SyntheticEngine):
    """Every unit listens; the second one's finalize starts a reply (as the reference
    engine's does when the user's turn ended too late in a unit to answer within it)."""

    def open_session(self, session_id, mode):
        session = super().open_session(session_id, mode)
        finalized = []

        class Session(type(session)):
            def finalize(self):
                super().finalize()
                finalized.append(True)

            @property
            def replying(self):
                return len(finalized) == 2

        session.__class__ = Session
        return session


async def test_a_unit_whose_finalize_starts_a_reply_counts_as_speaking():
    """The headroom's speaking units are the dear ones: a listening unit whose finalize
    started the reply is one of them."""
    executor = ThreadPoolExecutor(2)
    served = []
    session = DuplexSession(
        SessionSpec(session_id="s", lease_id="l", mode="audio"),
        ReplyInFinalize(compute_ms=0),
        executor,
        SessionLimits(60, 8192),
        on_unit=lambda s, length, engine, wall, speaking: served.append(speaking),
    )
    serving = await serve_one_by_one(session, (1, 2, 3))
    await asyncio.wait_for(serving, scaled(2))
    executor.shutdown()
    assert served == [False, True, False]


class EarlyInFinalize(SyntheticEngine):
    """Every unit listens; the second one's finalize begins a reply and hands its first
    piece to the session's early_sink when it has one (the reference engine's way), else
    keeps it for the next unit's result."""

    def open_session(self, session_id, mode):
        session = super().open_session(session_id, mode)
        engine = self

        class Session(type(session)):
            finalized = 0
            held_piece: GenerateResult | None = None

            def finalize(self):
                super().finalize()
                self.finalized += 1
                if self.finalized != 2:
                    return
                piece = GenerateResult(
                    is_listen=False, text="Hello", audio=np.ones(2400, np.float32), n_tokens=2
                )
                engine.sinks.append(self.early_sink)
                if self.early_sink is not None:
                    self.early_sink(piece)
                else:
                    self.held_piece = piece

            def generate(self, force_listen):
                kept, self.held_piece = self.held_piece, None
                return kept if kept is not None else super().generate(force_listen)

        session.__class__ = Session
        return session

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sinks = []


async def early_session(**spec) -> tuple[list, list]:
    """Units 1-3 one after another on EarlyInFinalize: the session's events (the end
    left out) and the sinks its engine session had."""
    executor = ThreadPoolExecutor(2)
    engine = EarlyInFinalize(compute_ms=0)
    session = DuplexSession(
        SessionSpec(session_id="s", lease_id="l", mode="audio", **spec),
        engine,
        executor,
        SessionLimits(60, 8192),
    )
    serving = await serve_one_by_one(session, (1, 2, 3))
    await asyncio.wait_for(serving, scaled(2))
    executor.shutdown()
    events = [e async for e in session.journal.events()]
    return [e for e in events if not isinstance(e, SessionEnd)], engine.sinks


async def test_a_finalize_output_goes_out_between_units_when_the_sender_takes_it():
    """SessionStart.early_results: what unit 2's finalize made is sent at once, as an early
    result carrying seq 2, before unit 3's result; its tokens are counted once."""
    events, sinks = await early_session(early_results=True)
    assert [(e.seq, e.early, e.result.is_listen) for e in events] == [
        (1, False, True),
        (2, False, True),
        (2, True, False),
        (3, False, True),
    ]
    early = events[2]
    assert early.result.text == "Hello" and early.usage.output_text_tokens == 2
    assert events[3].usage.output_text_tokens == 2
    assert sinks[0] is not None


@pytest.mark.parametrize(
    "spec", [{}, {"early_results": True, "settings": DuplexSettings(half_duplex=True)}]
)
async def test_without_early_results_every_output_rides_with_a_unit(spec):
    """A sender that did not ask (or a half-duplex call, whose units the worker feeds
    itself) gets the finalize's output with the next unit's result: the engine session has
    no early_sink."""
    events, sinks = await early_session(**spec)
    assert sinks == [None]
    assert not any(e.early for e in events)
    spoke = [e for e in events if not e.result.is_listen]
    assert (spoke[0].seq, spoke[0].result.text) == (3, "Hello")


# ---- a half-duplex answer goes on by itself ----------------------------------------------

SPEECH = np.full(16000, 0.1, np.float32)


async def half_duplex_call(engine: SyntheticEngine, **settings):
    """A half-duplex session on `engine`, its unit loop running: (session, loop, executor)."""
    executor = ThreadPoolExecutor(2)
    spec = SessionSpec(
        session_id="s",
        lease_id="l",
        mode="audio",
        settings=DuplexSettings(half_duplex=True, **settings),
    )
    session = DuplexSession(spec, engine, executor, SessionLimits(60, 8192))
    await session.open()
    return session, asyncio.ensure_future(session.run()), executor


async def results_until(session: DuplexSession, start: int, done) -> list:
    """The session's results from journal index `start` until one for which `done` holds
    (that one included)."""
    seen = []
    async with asyncio.timeout(scaled(5)):
        index = 0
        async for event in session.journal.events():
            index += 1
            if index <= start:
                continue
            assert not isinstance(event, SessionEnd), event
            if not event.buffered:
                seen.append(event)
                if done(event):
                    return seen
    raise AssertionError("the session ended")


async def ask(session: DuplexSession, seqs: tuple[int, int], pieces: int = 1) -> list:
    """The user's turn (a unit of speech, `pieces` model units, then one of silence: the
    engine answers it); the results from the silence's until the engine ends its turn."""
    start = session.journal.length
    session.submit(UnitInput(seq=seqs[0], pcm=SPEECH))
    heard = await results_until(session, start, lambda e: e.seq == seqs[0])
    if pieces > 1:
        heard += await results_until(session, start + 1, lambda e: e.seq == seqs[0])
    assert len(heard) == pieces and all(e.result.is_listen for e in heard)
    start = session.journal.length
    session.submit(UnitInput(seq=seqs[1], pcm=SILENCE))
    return await results_until(session, start, lambda e: e.result.end_of_turn)


async def end_call(session: DuplexSession, loop, executor) -> SessionEnd:
    session.close(CloseReason.USER_STOP)
    end = await asyncio.wait_for(loop, scaled(5))
    executor.shutdown()
    return end


@pytest.mark.parametrize("model_unit", [0, 8000])
async def test_a_half_duplex_answer_goes_on_without_the_senders_units(model_unit):
    """From the engine's first speaking unit, the worker feeds the engine silence itself,
    back to back, until it ends its turn: every piece streams under the seq of the unit that
    began the answer (answered already: no unit of the sender waits for these), then the
    loop waits for the sender again. Re-chunked engines get silence of their unit length."""
    engine = HearingEngine(compute_ms=1, model_unit=model_unit, force_listen_count=0, reply_units=4)
    session, loop, executor = await half_duplex_call(engine)
    pieces = 16000 // model_unit if model_unit else 1
    answer = await ask(session, (1, 2), pieces)
    assert [e.seq for e in answer] == [2, 2, 2, 2]
    assert [e.result.is_listen for e in answer] == [False] * 4
    assert [e.result.text.split()[-1] for e in answer] == ["1", "2", "3", "4"]
    assert answer[-1].result.end_of_turn and session.answer is None
    assert all(not e.dropped_seqs for e in answer)
    # The engine heard the turn, then only the worker's silence, of its unit length.
    pumped = engine.heard[pieces + 1 :]  # a re-chunked silence's second piece: not heard
    assert len(pumped) == 3 and all(not p.any() for p in pumped)
    assert {p.size for p in pumped} == {model_unit or 16000}
    served = session.units_served
    await asyncio.sleep(0.1)
    assert session.units_served == served  # nothing more without the sender
    # The next turn is answered the same way.
    second = await ask(session, (3, 4), pieces)
    assert [e.seq for e in second] == [4] * 4 and "reply 2" in second[0].result.text
    end = await end_call(session, loop, executor)
    assert end.units_dropped == 0 and end.units_served == served + pieces + 4


async def test_a_half_duplex_answer_ends_at_its_token_cap():
    """A half-duplex session's max_tokens caps each answer (the reference server's
    max_new_tokens), not the session: the unit after the answer's tokens reach it carries
    force_listen and ends the turn; the next answer counts from zero."""
    engine = HearingEngine(compute_ms=1, force_listen_count=0, reply_units=5)
    session, loop, executor = await half_duplex_call(engine, max_tokens=6)
    for turn, seqs in enumerate(((1, 2), (3, 4)), start=1):
        answer = await ask(session, seqs)
        # Four tokens a piece: the second reaches 6, the third unit ends the answer.
        assert [e.result.is_listen for e in answer] == [False, False, True]
        assert answer[-1].result.end_of_turn and {e.seq for e in answer} == {seqs[1]}
        assert f"reply {turn} part 2" in answer[1].result.text
    end = await end_call(session, loop, executor)
    assert end.usage.output_text_tokens == 16  # beyond 6: the cap is each answer's


async def test_a_half_duplex_answer_ignores_input_and_ends_on_a_force_listen_unit():
    """The sender's units while the answer goes on are not heard (reported dropped with the
    next piece: speech would have barged in); its force_listen unit (the external stop)
    ends the answer, and the result that ends it answers that unit."""
    engine = HearingEngine(compute_ms=20, force_listen_count=0, reply_units=100)
    session, loop, executor = await half_duplex_call(engine)
    start = session.journal.length
    session.submit(UnitInput(seq=1, pcm=SPEECH))
    await results_until(session, start, lambda e: e.seq == 1)
    start = session.journal.length
    session.submit(UnitInput(seq=2, pcm=SILENCE))
    await results_until(session, start, lambda e: not e.result.is_listen)
    heard = len(engine.heard)
    start = session.journal.length
    session.submit(UnitInput(seq=3, pcm=SPEECH))  # not heard: the model answers
    dropped = await results_until(session, start, lambda e: 3 in e.dropped_seqs)
    assert [e.seq for e in dropped] and {e.seq for e in dropped} == {2}
    assert not dropped[-1].result.is_listen  # no barge-in: the answer goes on
    start = session.journal.length
    session.submit(UnitInput(seq=4, pcm=SILENCE, force_listen=True))
    stopped = await results_until(session, start, lambda e: e.seq == 4)
    assert stopped[-1].result.is_listen and stopped[-1].result.end_of_turn
    assert {e.seq for e in stopped[:-1]} <= {2} and session.answer is None
    assert not any(p.any() for p in engine.heard[heard:])  # only silence since
    end = await end_call(session, loop, executor)
    assert end.units_dropped == 1
