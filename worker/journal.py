"""A session's resume journal: every event it emitted, in order, read by the streams that
carry it (a resumed stream replays from the start), and which stream that is.

Its memory is bounded whatever the session's length: the newest JOURNAL_AUDIO_RESULTS
results keep their speech, the newest JOURNAL_RESULTS everything, and older ones only their
shape (seq and six flags, 9 bytes: ~32 KB an hour of 1 s units), which is what a resumed
stream's edge needs to number the events it already sent. A pruned result is replayed as a
UnitOutput with `pruned` set (its text and speech stand-ins, its figures zero): an edge that
would have to send it again refuses the resume (resume_expired) instead of sending it wrong."""

from __future__ import annotations

import array
import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import numpy as np

from omnifabric.worker.engine import GenerateResult
from omnifabric.worker.session_types import SessionEnd, UnitOutput, UnitTimings, Usage

#: Results whose speech the session keeps for a resumed stream's replay (the newest); older
#: results are kept without it (~96 KB a second of speech: ~11 MB per session at most).
JOURNAL_AUDIO_RESULTS = 120
#: Results the journal keeps whole (the newest; ~10 minutes of 1 s units, ~2 KB each
#: without speech); older ones keep only their shape.
JOURNAL_RESULTS = 600

# A pruned result's shape: its flags.
_LISTEN, _TEXT, _AUDIO, _END_OF_TURN, _BUFFERED, _EARLY = 1, 2, 4, 8, 16, 32
#: A pruned result's text stand-in (it had text; what it was is gone).
PRUNED_TEXT = "\u2026"


def _shape(out: UnitOutput) -> int:
    r = out.result
    return (
        (_LISTEN if r.is_listen else 0)
        | (_TEXT if r.text else 0)
        | (_AUDIO if r.audio.size or out.audio_dropped else 0)
        | (_END_OF_TURN if r.end_of_turn else 0)
        | (_BUFFERED if out.buffered else 0)
        | (_EARLY if out.early else 0)
    )


class Journal:
    """The events of one session, and its streams: each attach (start, resume) takes the
    session from the previous stream; a stream that ended without close is let go; a
    session whose stream is gone waits detached for a resume."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep: int = JOURNAL_RESULTS) -> None:
        self._loop = loop
        self._keep = max(1, keep)
        self._events: collections.deque[UnitOutput | SessionEnd] = collections.deque()
        """The newest events of the session, in order, whole: streams read the journal by
        index (a resumed stream from the start), the first `pruned` indices from the
        shapes below."""
        self._pruned_seqs = array.array("Q")
        self._pruned_flags = bytearray()
        """The pruned results, oldest first: seq and shape flags."""
        self._readers: set[asyncio.Future[None]] = set()
        """One future per stream waiting for the journal to grow: setting it wakes that
        stream's task directly (one loop turn; a shared future behind asyncio.shield takes
        two, and the result would queue behind the unit's finalize)."""
        self.attachment = 0
        """Which stream carries the session: each attach (start, resume) counts one."""
        self._let_go: set[int] = set()
        """Attachments whose sender ended its stream without close (they read no more)."""
        self._detach_timer: asyncio.TimerHandle | None = None

    @property
    def length(self) -> int:
        return len(self._pruned_flags) + len(self._events)

    @property
    def pruned(self) -> int:
        """Results kept as their shape alone."""
        return len(self._pruned_flags)

    def emit(self, event: UnitOutput | SessionEnd) -> None:
        """Add an event and wake the streams; beyond JOURNAL_AUDIO_RESULTS, the oldest
        result still holding speech is kept without it, and beyond the journal's `keep`
        the oldest whole one is kept as its shape alone."""
        self._events.append(event)
        old = len(self._events) - 1 - JOURNAL_AUDIO_RESULTS
        if old >= 0:
            kept = self._events[old]
            if isinstance(kept, UnitOutput) and kept.result.audio.size:
                audio = np.zeros(0, dtype=np.float32)
                self._events[old] = replace(
                    kept, result=replace(kept.result, audio=audio), audio_dropped=True
                )
        while len(self._events) > self._keep and isinstance(self._events[0], UnitOutput):
            oldest = self._events.popleft()
            assert isinstance(oldest, UnitOutput)
            self._pruned_seqs.append(oldest.seq)
            self._pruned_flags.append(_shape(oldest))
        self._wake_streams()

    def _at(self, index: int) -> UnitOutput | SessionEnd:
        """The event at `index` (0: the session's first), a pruned one rebuilt from its
        shape."""
        pruned = len(self._pruned_flags)
        if index >= pruned:
            return self._events[index - pruned]
        flags = self._pruned_flags[index]
        result = GenerateResult(
            is_listen=bool(flags & _LISTEN),
            text=PRUNED_TEXT if flags & _TEXT else "",
            end_of_turn=bool(flags & _END_OF_TURN),
        )
        return UnitOutput(
            seq=self._pruned_seqs[index],
            result=result,
            timings=UnitTimings(),
            usage=Usage(),
            dropped_seqs=[],
            buffered=bool(flags & _BUFFERED),
            audio_dropped=bool(flags & _AUDIO),
            pruned=True,
            early=bool(flags & _EARLY),
        )

    async def events(self, attachment: int = 0) -> AsyncIterator[UnitOutput | SessionEnd]:
        """Every event from the first, in order, then exactly one SessionEnd; returns early
        when another stream attached after `attachment` (superseded)."""
        index = 0
        while True:
            if attachment and (self.attachment != attachment or attachment in self._let_go):
                return
            if index < self.length:
                event = self._at(index)
                index += 1
                yield event
                if isinstance(event, SessionEnd):
                    return
                continue
            await self._grew()

    async def _grew(self) -> None:
        waiter = self._loop.create_future()
        self._readers.add(waiter)
        try:
            await waiter
        finally:  # cancelled: only this stream's future goes
            self._readers.discard(waiter)

    def _wake_streams(self) -> None:
        for waiter in self._readers:
            if not waiter.done():
                waiter.set_result(None)
        self._readers.clear()

    def attach(self) -> int:
        """A stream takes the session (its start, or a resume): the previous one, if any,
        stops reading; a detached session stops waiting to expire. Returns the stream's
        attachment number."""
        self.cancel_detach()
        self.attachment += 1
        self._wake_streams()
        return self.attachment

    def let_go(self, attachment: int) -> None:
        """The stream of `attachment` ended without close: it stops reading events."""
        self._let_go.add(attachment)
        self._wake_streams()

    @property
    def detached(self) -> bool:
        return self._detach_timer is not None

    def resume_left_s(self) -> float | None:
        """Seconds until a detached session expires; None while attached."""
        if self._detach_timer is None:
            return None
        return max(0.0, self._detach_timer.when() - self._loop.time())

    def detach(self, grace_s: float, expire: Callable[..., object], *args: Any) -> None:
        """No stream carries the session: `expire(*args)` in `grace_s` unless one attaches."""
        self._detach_timer = self._loop.call_later(grace_s, expire, *args)

    def cancel_detach(self) -> None:
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None
