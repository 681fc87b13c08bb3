"""The lease book: grants the scheduler pushed over the Register stream, and their use.

An edge may present a lease a moment before its grant arrives, so claims wait for it.
A lease is used by at most one session, once; when that session is freed the lease is
released (the registration tells the scheduler).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from omnifabric.worker.errors import LeaseInUse, LeaseNotFound, ModeMismatch, StaleLease

log = logging.getLogger("omnifabric.worker.leases")

#: How many finished lease ids to remember, so that reuse is told apart from unknown.
REMEMBERED_USED = 4096
#: How long a grant no session used stays after its registration ended, seconds.
UNUSED_GRANT_KEEP_S = 10.0


@dataclass(frozen=True)
class LeaseGrant:
    """A slot the scheduler granted on this worker for one session."""

    lease_id: str
    slot: int
    mode: str
    session_id: str = ""
    epoch: int = 0
    """The granting scheduler leadership's epoch (0 without an election)."""
    key: str = ""
    resume_key: str = ""
    owner: str = ""
    resume_grace_s: float = 0.0
    """What the request said (its key's hash, resume key, owner, grace): reported back in
    the hello, so that a new leader knows the session as the granting one did."""


class LeaseBook:
    """Granted and in-use leases. Event-loop only (no locking)."""

    def __init__(self) -> None:
        self._granted: dict[str, LeaseGrant] = {}
        self._in_use: dict[str, Callable[[str], None]] = {}
        """lease_id -> callback that ends the session using it (on revoke)."""
        self._used: OrderedDict[str, None] = OrderedDict()
        self._changed = asyncio.Condition()
        self.on_released: Callable[[str], None] | None = None
        """Called with a lease id once it is free again (to tell the scheduler)."""
        self.epoch = 0
        """The highest scheduler epoch seen (registrations, grants, leader answers): grants
        of a lower one are refused (fencing against an old leader that wakes)."""
        self._stale: OrderedDict[str, int] = OrderedDict()
        """Refused grants: lease id -> its epoch, so that a session presenting one is told."""

    def observe_epoch(self, epoch: int) -> bool:
        """Note a scheduler epoch seen; False when it is lower than one seen before."""
        if epoch < self.epoch:
            return False
        self.epoch = epoch
        return True

    def check_epoch(self, lease_id: str, epoch: int) -> None:
        """StaleLease when `epoch` (what the holder's lease says; 0: not said) is lower than
        the highest seen."""
        if epoch and epoch < self.epoch:
            raise StaleLease(lease_id, epoch, self.epoch)

    def grant(self, grant: LeaseGrant) -> None:
        """Record a lease_granted; wakes sessions waiting for it. StaleLease (nothing
        recorded) when its epoch is lower than one seen."""
        if not self.observe_epoch(grant.epoch):
            self._stale[grant.lease_id] = grant.epoch
            while len(self._stale) > REMEMBERED_USED:
                self._stale.popitem(last=False)
            raise StaleLease(grant.lease_id, grant.epoch, self.epoch)
        self._granted[grant.lease_id] = grant
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def get(self, lease_id: str) -> LeaseGrant | None:
        return self._granted.get(lease_id)

    async def wait_for(self, lease_id: str, timeout: float) -> LeaseGrant | None:
        """The grant for `lease_id`, waiting up to `timeout` seconds; None if it never came."""
        if lease_id in self._granted or lease_id in self._used:
            return self._granted.get(lease_id)
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: lease_id in self._granted or lease_id in self._used
                    ),
                    timeout,
                )
        except TimeoutError:
            return None
        return self._granted.get(lease_id)

    async def claim(
        self, lease_id: str, mode: str, timeout: float, on_revoke: Callable[[str], None]
    ) -> LeaseGrant:
        """Mark the lease in use by a session in `mode`. `on_revoke(reason)` ends it.

        Raises LeaseNotFound (no grant within `timeout`), LeaseInUse, ModeMismatch,
        StaleLease (granted by an older leadership than one seen since).
        """
        if lease_id in self._in_use or lease_id in self._used:
            raise LeaseInUse(f"lease {lease_id!r} is already in use")
        if lease_id in self._stale:
            raise StaleLease(lease_id, self._stale[lease_id], self.epoch)
        grant = await self.wait_for(lease_id, timeout)
        if lease_id in self._in_use or lease_id in self._used:
            raise LeaseInUse(f"lease {lease_id!r} is already in use")
        if grant is None:
            if lease_id in self._stale:
                raise StaleLease(lease_id, self._stale[lease_id], self.epoch)
            raise LeaseNotFound(f"lease {lease_id!r} was not granted on this worker")
        if grant.epoch < self.epoch:
            raise StaleLease(lease_id, grant.epoch, self.epoch)
        if grant.mode != mode:
            raise ModeMismatch(f"lease {lease_id!r} was granted for {grant.mode}, not {mode}")
        self._in_use[lease_id] = on_revoke
        return grant

    def release(self, lease_id: str) -> None:
        """The session using the lease is freed: forget it and report it released."""
        self._in_use.pop(lease_id, None)
        if self._granted.pop(lease_id, None) is None:
            return
        self._remember_used(lease_id)
        if self.on_released is not None:
            self.on_released(lease_id)

    def revoke(self, lease_id: str, reason: str, unused_only: bool = False) -> None:
        """The holder is gone: end the session using the lease (released once freed),
        or release an unused lease at once; `unused_only` leaves a session using it."""
        on_revoke = self._in_use.get(lease_id)
        if on_revoke is not None and unused_only:
            return  # a resumable session: it waits detached and is released when it ends
        if on_revoke is not None:
            log.info("lease %s revoked (%s): ending its session", lease_id, reason)
            on_revoke(reason)
            return
        if lease_id in self._granted:
            log.info("lease %s revoked (%s) before use", lease_id, reason)
            self.release(lease_id)
        elif self.on_released is not None:
            # Unknown or already released: answer anyway so the scheduler can settle it.
            self.on_released(lease_id)

    def expire_unused(self, after_s: float = UNUSED_GRANT_KEEP_S) -> list[str]:
        """The registration ended: release in `after_s` every grant no session uses by then.
        Until then a holder that has its offer can still present it (the scheduler that
        granted it drained or died just after; the next one counts it from the hello)."""
        unused = [lease_id for lease_id in self._granted if lease_id not in self._in_use]
        if unused:
            asyncio.get_running_loop().call_later(after_s, self._expire, unused)
        return unused

    def _expire(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            if lease_id in self._granted and lease_id not in self._in_use:
                log.info("lease %s: granted before the scheduler changed, never used", lease_id)
                self.release(lease_id)

    def active_ids(self) -> list[str]:
        """Leases held by running sessions."""
        return list(self._in_use)

    def held(self) -> list[LeaseGrant]:
        """Every grant standing: those of running sessions, then those not used yet."""
        used = [grant for lease_id in self._in_use if (grant := self._granted.get(lease_id))]
        return used + [g for lease_id, g in self._granted.items() if lease_id not in self._in_use]

    def _remember_used(self, lease_id: str) -> None:
        self._used[lease_id] = None
        while len(self._used) > REMEMBERED_USED:
            self._used.popitem(last=False)
