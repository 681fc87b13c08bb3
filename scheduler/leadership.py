"""One scheduler's part in active/standby leadership (--ha): whether it may grant now, the
epoch and leader it knows of, and the rebuild window after it begins to lead.

The Scheduler owns one `Leadership` and asks it at each entry point (`check`); the election
(server.py) drives both through Scheduler.lead and Scheduler.follow, since a scheduler that
stops leading also ends its streams and forgets its state, which is the Scheduler's part.
Without an election a scheduler leads from the start, with epoch 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from omnifabric.scheduler.errors import NotLeader

log = logging.getLogger(__name__)

#: Seconds after a scheduler begins to lead during which requests for a mode no registered
#: worker serves wait in the queue (the workers re-register within about a second).
REBUILD_S = 3.0


class Leadership:
    """The leadership state and its rules; event-loop only, like the Scheduler."""

    def __init__(self) -> None:
        self.epoch = 0
        """The epoch of this scheduler's leadership (0 without an election)."""
        self.leader = ""
        """The leader's name as the store holds it, this process's own while it leads (""
        when unknown or without an election)."""
        self.standby = False
        """True while another scheduler may lead (with an election, from the start)."""
        self.store_problem: Callable[[], str] = lambda: ""
        """The election's account of why its store cannot be used ("" while it can): a
        standby's refusals say it."""
        self.term_valid: Callable[[], bool] = lambda: True
        """The election's own check that this process's term cannot have expired yet: a
        process paused past its TTL grants nothing when it wakes, before it hears so."""
        self.terms = 0
        """Leaderships this process has begun (with an election): each after the first is a
        failover or handover to it."""
        self.rebuild_s: float | None = None
        """The last rebuild: seconds from taking the lead to the last worker registration or
        re-sent request within REBUILD_S of it (None before any; grows during the window)."""
        self._led_at = -REBUILD_S
        """time.monotonic() when this scheduler last began to lead (with an election)."""

    def leads(self) -> bool:
        """True while this scheduler may grant: it leads (or has no election) and its term
        cannot have expired."""
        return not self.standby and self.term_valid()

    def not_leader(self) -> NotLeader:
        """The refusal of a standby: it names the leader, or why no scheduler can lead."""
        return NotLeader(self.leader, self.store_problem())

    def check(self) -> None:
        """Raise NotLeader unless this scheduler may grant now."""
        if not self.leads():
            raise self.not_leader()

    def refusal(self) -> NotLeader | None:
        """Why a standby ends its streams; None while it leads (even past its term, which
        `check` refuses but which the election has not told it yet)."""
        return self.not_leader() if self.standby else None

    def lead(self, epoch: int, name: str = "") -> None:
        """Start leading with `epoch` (under `name`, this process's holder name); the
        rebuild window opens now."""
        self.epoch, self.leader, self.standby = epoch, name, False
        self._led_at = time.monotonic()
        self.terms += 1
        self.rebuild_s = 0.0
        log.info("leading (epoch %d): taking registrations and requests", epoch)

    def follow(self, leader: str = "", epoch: int = 0) -> bool:
        """Be (or stay) a standby of `leader` (its `epoch`, when known); True when this
        scheduler stands by only now, so that the state it led with must go."""
        self.leader = leader
        self.epoch = max(self.epoch, epoch)
        if self.standby:
            return False
        self.standby = True
        return True

    def rebuilding(self, now: float) -> bool:
        """True for a while after this scheduler began to lead: the workers are still
        coming to register, so a request no registered worker serves waits instead of
        being refused."""
        return now < self._led_at + REBUILD_S

    def rebuilt_by(self, now: float) -> None:
        """A worker registered or a waiting caller came back at `now`: while the rebuild
        window is open, the rebuild lasted at least until then."""
        if self.terms and self.rebuilding(now):
            self.rebuild_s = max(self.rebuild_s or 0.0, now - self._led_at)
