"""A session's incoming units: the mailbox the stream fills (the newest unit wins), and
the intake that turns what the loop takes from it into the model units to serve
(re-chunked to the engine's exact lengths, or a half-duplex call's waiting units joined),
and makes the silent units a half-duplex answer goes on with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from omnifabric.worker.rechunk import Rechunker
from omnifabric.worker.units import UnitInput

#: The session's own lines (worker.session's logger): a unit dropped here is the session's.
log = logging.getLogger("omnifabric.worker.session")

#: Re-chunked sessions: model units that may wait at once; older audio beyond them is
#: dropped (counted) so an engine slower than real time builds no backlog. A half-duplex
#: call's model units may wait up to HALF_DUPLEX_JOIN_SAMPLES of audio instead: its turn
#: is heard whole, late rather than in pieces.
MAX_WAITING_MODEL_UNITS = 4

#: Half-duplex calls on engines that take client units as they come: the units that
#: arrived while the engine was busy are heard as one unit (a turn is heard whole, as the
#: reference server buffers it), of this much audio at most (16 kHz samples, 30 s); older
#: units beyond it are dropped (counted).
HALF_DUPLEX_JOIN_SAMPLES = 30 * 16000

#: A half-duplex answer's silent units (engines that take any length; 16 kHz samples):
#: one second, as the edge used to send them.
ANSWER_SILENCE_SAMPLES = 16000


class Mailbox:
    """The next unit: one slot where a unit that arrives while one waits replaces it (the
    newest wins); with `join`, every waiting unit is kept instead (for the re-chunker, or
    to be heard as one unit in a half-duplex call)."""

    def __init__(self) -> None:
        self._units: list[UnitInput] = []
        self.join = False
        self.dropped: list[int] = []
        """Seqs replaced since the last take_dropped()."""
        self.dropped_total = 0

    def put(self, unit: UnitInput) -> None:
        if self._units and not self.join:
            self.drop(self._units.pop().seq)
        self._units.append(unit)

    def drop(self, seq: int) -> None:
        self.dropped.append(seq)
        self.dropped_total += 1

    def take_all(self) -> list[UnitInput]:
        units, self._units = self._units, []
        return units

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def discard(self) -> None:
        """Count units still waiting at the end as dropped."""
        self.dropped_total += len(self._units)
        self._units = []


class Intake:
    """The model units to serve for the client units taken from `mailbox`: the units
    themselves, re-chunked to the engine's exact lengths, or (a half-duplex call) those
    that waited joined into one. A client unit that makes no model unit of its own is
    answered through `buffered`; audio beyond what may wait is dropped (counted in the
    mailbox)."""

    def __init__(
        self, session_id: str, mailbox: Mailbox, buffered: Callable[[UnitInput], None]
    ) -> None:
        self.session_id = session_id
        self.mailbox = mailbox
        self.buffered = buffered
        self._chunker: Rechunker | None = None
        """Set when the engine needs exact unit lengths: client units are re-chunked."""
        self._joins = False
        """A half-duplex call without a chunker: units that waited are heard as one."""
        self._max_waiting = MAX_WAITING_MODEL_UNITS
        """Re-chunked: the model units that may wait at once (more in a half-duplex call)."""

    def configure(self, sizes: tuple[int, int] | None, half_duplex: bool) -> None:
        """Set up for the engine session's unit lengths (EngineSession.unit_samples) and
        whether the call is half-duplex; the mailbox then keeps every waiting unit when
        they are re-chunked or joined."""
        self._chunker = Rechunker(*sizes) if sizes else None
        self._joins = self._chunker is None and half_duplex
        if self._chunker is not None and half_duplex:
            self._max_waiting = max(
                MAX_WAITING_MODEL_UNITS, HALF_DUPLEX_JOIN_SAMPLES // self._chunker.size
            )
        self.mailbox.join = self._chunker is not None or self._joins

    def model_units(self, units: list[UnitInput]) -> list[UnitInput]:
        """The model units to serve for the client units taken: the units themselves, or
        re-chunked (client units that complete none are answered as buffered; beyond
        MAX_WAITING_MODEL_UNITS, or a half-duplex call's 30 s, the oldest audio is dropped
        and its units reported)."""
        if self._chunker is None:
            return self._joined(units) if self._joins and len(units) > 1 else units
        pieces: list[UnitInput] = []
        for unit in units:
            made = self._chunker.push(unit)
            if not made:
                self.buffered(unit)
            pieces += made
        excess = len(pieces) - self._max_waiting
        if excess > 0:
            dropped, pieces = pieces[:excess], pieces[excess:]
            kept = {p.seq for p in pieces}
            for seq in sorted({p.seq for p in dropped} - kept):
                self.mailbox.drop(seq)
            log.warning(
                "session %s: %d s of audio behind: the oldest %d dropped",
                self.session_id,
                excess + len(pieces),
                excess,
            )
        return pieces

    def silence(self, seq: int, force_listen: bool, received_at: float) -> list[UnitInput]:
        """The model unit the worker feeds a half-duplex answer to go on (see
        DuplexSession._pumped): silence of the engine's unit length, through the re-chunker
        (which may still hold the end of the user's turn), else ANSWER_SILENCE_SAMPLES.
        Under `seq`, with `force_listen` (the answer ends)."""
        size = self._chunker.size if self._chunker is not None else ANSWER_SILENCE_SAMPLES
        unit = UnitInput(
            seq=seq,
            pcm=np.zeros(size, np.float32),
            force_listen=force_listen,
            received_at=received_at,
        )
        return [unit] if self._chunker is None else self._chunker.push(unit)

    def _joined(self, units: list[UnitInput]) -> list[UnitInput]:
        """A half-duplex call's units that waited while the engine was busy, as one unit
        under the newest's seq: the others are answered as buffered, and those beyond
        HALF_DUPLEX_JOIN_SAMPLES (the oldest) as dropped. An engine slower than real time
        then hears the whole question instead of its newest half-second."""
        kept: list[UnitInput] = []
        samples = 0
        for unit in reversed(units):
            samples += len(unit.pcm)
            if kept and samples > HALF_DUPLEX_JOIN_SAMPLES:
                break
            kept.append(unit)
        kept.reverse()
        for unit in units[: len(units) - len(kept)]:
            self.mailbox.drop(unit.seq)
        if len(kept) < len(units):
            log.warning(
                "session %s: %d units waited: the oldest %d dropped",
                self.session_id,
                len(units),
                len(units) - len(kept),
            )
        for unit in kept[:-1]:
            self.buffered(unit)
        newest = kept[-1]
        joined = replace(
            newest,
            pcm=np.concatenate([u.pcm for u in kept]),
            frames=[f for u in kept for f in u.frames],
            force_listen=any(u.force_listen for u in kept),
        )
        return [joined]
