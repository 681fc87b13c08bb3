"""A session's resume journal: every event it emitted, in order, read by the streams that
carry it (a resumed stream replays from the start), and which stream that is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import numpy as np

from omnifabric.worker.session_types import SessionEnd, UnitOutput

#: Results whose speech the session keeps for a resumed stream's replay (the newest); older
#: results are kept without it (~96 KB a second of speech: ~11 MB per session at most).
JOURNAL_AUDIO_RESULTS = 120


class Journal:
    """The events of one session, and its streams: each attach (start, resume) takes the
    session from the previous stream; a stream that ended without close is let go; a
    session whose stream is gone waits detached for a resume."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: list[UnitOutput | SessionEnd] = []
        """Every event of the session, in order: streams read it by index (a resumed
        stream from the start)."""
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
        return len(self._events)

    def emit(self, event: UnitOutput | SessionEnd) -> None:
        """Add an event and wake the streams; beyond JOURNAL_AUDIO_RESULTS, the oldest
        result still holding speech is kept without it."""
        self._events.append(event)
        old = len(self._events) - 1 - JOURNAL_AUDIO_RESULTS
        if old >= 0:
            kept = self._events[old]
            if isinstance(kept, UnitOutput) and kept.result.audio.size:
                audio = np.zeros(0, dtype=np.float32)
                self._events[old] = replace(
                    kept, result=replace(kept.result, audio=audio), audio_dropped=True
                )
        self._wake_streams()

    async def events(self, attachment: int = 0) -> AsyncIterator[UnitOutput | SessionEnd]:
        """Every event from the first, in order, then exactly one SessionEnd; returns early
        when another stream attached after `attachment` (superseded)."""
        index = 0
        while True:
            if attachment and (self.attachment != attachment or attachment in self._let_go):
                return
            if index < len(self._events):
                event = self._events[index]
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

    def detach(self, grace_s: float, expire: Callable[..., object], *args: Any) -> None:
        """No stream carries the session: `expire(*args)` in `grace_s` unless one attaches."""
        self._detach_timer = self._loop.call_later(grace_s, expire, *args)

    def cancel_detach(self) -> None:
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None
