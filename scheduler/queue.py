"""The one FIFO queue of waiting Acquire requests and its wait estimate."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnifabric.scheduler.errors import QueueFull, SchedulerError
from omnifabric.scheduler.registry import Mode

if TYPE_CHECKING:
    from omnifabric.scheduler.leases import Lease


@dataclass
class Ticket:
    """One Acquire request, from arrival until it is granted or given up."""

    mode: Mode
    session_id: str
    ticket_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: The hash of the request's API key (AcquireRequest.key; "" without a limit to keep).
    key: str = ""
    #: time.monotonic() at arrival (a re-sent request: its arrival at the earlier leader).
    enqueued_at: float = field(default_factory=time.monotonic)
    #: A request re-sent after a switch of leader: its last position in the earlier
    #: leader's queue (0: a request that came here first).
    previous_position: int = 0
    #: Set once granted.
    lease: Lease | None = None
    #: Set whenever the ticket's position changes or it is granted.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by an operator's cancel while it waited.
    cancelled: bool = False
    #: Set when the way waits are estimated changed (SetEta): the holder hears it at once.
    estimate_changed: bool = False
    #: Set when the scheduler stopped leading while it waited: its caller is told this.
    refused: SchedulerError | None = None
    #: Resumable requests: what their lease is granted with (AcquireRequest's fields).
    resume_key: str = ""
    owner: str = ""
    resume_grace_s: float = 0.0


def _place(ticket: Ticket) -> tuple[int, float]:
    """A ticket's order in the queue: requests re-sent after a switch of leader first, by
    their place in the earlier leader's queue; then the rest by arrival."""
    if ticket.previous_position:
        return (0, float(ticket.previous_position))
    return (1, ticket.enqueued_at)


class WaitQueue:
    """Waiting tickets in order of arrival (re-sent ones first, see `_place`), bounded by
    `queue_max`."""

    def __init__(self, queue_max: int) -> None:
        self.queue_max = queue_max
        # dict keeps insertion order and removes from the middle in O(1).
        self._tickets: dict[str, Ticket] = {}
        # Rebuilt lazily after a change: every waiter asks for its position on each change.
        self._positions: dict[str, int] | None = None
        self._modes: Counter[Mode] = Counter()
        """Waiting tickets per mode."""
        self._keys: Counter[str] = Counter()
        """Waiting tickets per API key (those with a key to keep a limit for)."""

    def __len__(self) -> int:
        return len(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._tickets.values()))

    def __contains__(self, ticket: Ticket) -> bool:
        return ticket.ticket_id in self._tickets

    def push(self, ticket: Ticket, over_max: bool = False) -> int:
        """Queue `ticket` in its place: at the back, or, for a request re-sent after a
        switch of leader, behind those re-sent from ahead of it and before the rest.
        Returns its 1-based position. Raises QueueFull at the max unless `over_max`."""
        if len(self._tickets) >= self.queue_max and not over_max:
            raise QueueFull(len(self._tickets), self.queue_max)
        self._positions = None
        self._modes[ticket.mode] += 1
        if ticket.key:
            self._keys[ticket.key] += 1
        tickets = self._tickets
        place = _place(ticket)
        if not tickets or _place(next(reversed(tickets.values()))) <= place:
            tickets[ticket.ticket_id] = ticket
            return len(tickets)
        # Rare (re-sent requests only): rebuild the order with the ticket in its place.
        ordered = list(tickets.values())
        at = next(n for n, t in enumerate(ordered) if _place(t) > place)
        ordered.insert(at, ticket)
        self._tickets = {t.ticket_id: t for t in ordered}
        return at + 1

    def get(self, ticket_id: str) -> Ticket | None:
        """The waiting ticket with this id, or None."""
        return self._tickets.get(ticket_id)

    def remove(self, ticket: Ticket) -> bool:
        """Take `ticket` out; tickets behind it move up. False if it was not waiting."""
        if self._tickets.pop(ticket.ticket_id, None) is None:
            return False
        self._positions = None
        self._modes[ticket.mode] -= 1
        if ticket.key:
            self._keys[ticket.key] -= 1
            if not self._keys[ticket.key]:
                del self._keys[ticket.key]
        return True

    def ordered(self) -> Iterator[Ticket]:
        """The waiting tickets in order, live (no copy): the queue must not change while
        the caller walks it."""
        return iter(self._tickets.values())

    def waiting(self, mode: Mode) -> int:
        """How many tickets of `mode` wait."""
        return self._modes[mode]

    def with_key(self, key: str) -> int:
        """How many tickets of this API key wait."""
        return self._keys[key] if key else 0

    def modes(self) -> set[Mode]:
        """The modes some ticket waits for."""
        return {mode for mode, n in self._modes.items() if n > 0}

    def positions(self) -> dict[str, int]:
        """1-based position of every waiting ticket, by ticket id."""
        return dict(self._index())

    def position(self, ticket: Ticket) -> int:
        """1-based position of `ticket`, 0 if it is not waiting."""
        return self._index().get(ticket.ticket_id, 0)

    def _index(self) -> dict[str, int]:
        if self._positions is None:
            self._positions = {tid: n for n, tid in enumerate(self._tickets, start=1)}
        return self._positions


def estimate_wait_s(
    position: int,
    mean_session_s: float,
    slots: int,
    grants: Sequence[tuple[float, str]] = (),
    now: float = 0.0,
) -> float:
    """Seconds until position `position` is served, the later of two estimates.

    Flow: the slots free one mean session apart each, so `slots` of them free one every
    mean / slots seconds on average, and the p-th in line waits p x mean / slots. Right
    for sessions that began at scattered times, too short for ones that began together
    (none ends before a whole session).

    Ages, from `grants` (the held sessions' grant times, oldest first, at `now`): a
    session is expected to end one mean length after its grant (at once if older), and
    the p-th in line gets the p-th slot to free; past one round of the held sessions, each
    round adds a mean session. Right for sessions that began together, too short where
    many held sessions are past the mean and go on.

    Without held sessions (or serving slots), one mean session per full round of slots.
    """
    slots = max(1, slots)
    if not grants:
        return mean_session_s * math.ceil(position / slots)
    flow = mean_session_s * position / slots
    rounds, index = divmod(max(0, position - 1), len(grants))
    age = now - grants[index][0]
    ages = rounds * mean_session_s + max(0.0, mean_session_s - age)
    return max(flow, ages)


class SessionLengths:
    """Exponential moving average of observed session lengths, per mode; until a mode has
    one, its baseline (the same initial guess for every mode, changeable per mode)."""

    def __init__(self, alpha: float, initial_s: float) -> None:
        self.alpha = alpha
        self.baseline_s: dict[Mode, float] = {mode: initial_s for mode in Mode}
        self.samples: dict[Mode, int] = {mode: 0 for mode in Mode}
        self._mean: dict[Mode, float] = {}

    def observe(self, mode: Mode, seconds: float) -> None:
        """Fold one session length in; the first observation replaces the assumed mean."""
        old = self._mean.get(mode)
        self._mean[mode] = seconds if old is None else self.alpha * seconds + (1 - self.alpha) * old
        self.samples[mode] += 1

    def mean_s(self, mode: Mode) -> float:
        """Mean session length of `mode` in seconds (its baseline until observed)."""
        return self._mean.get(mode, self.baseline_s[mode])

    def observed_s(self, mode: Mode) -> float | None:
        """The moving average of `mode`, None before its first session."""
        return self._mean.get(mode)

    def configure(self, alpha: float | None, baseline_s: dict[Mode, float]) -> None:
        """New smoothing and baselines (None / modes not named: unchanged). ValueError for
        a value out of range, before anything changes."""
        if alpha is not None and not 0.001 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in 0.001..1, got {alpha}")
        for mode, seconds in baseline_s.items():
            if not (math.isfinite(seconds) and 0.001 <= seconds <= 86_400.0):
                raise ValueError(
                    f"the {mode.value} baseline must be in 0.001..86400 s, got {seconds}"
                )
        if alpha is not None:
            self.alpha = alpha
        self.baseline_s.update(baseline_s)
