"""The worker's lease book fences grants by the scheduler leadership's epoch."""

from __future__ import annotations

import pytest

from omnifabric.worker.errors import StaleLease
from omnifabric.worker.leases import LeaseBook, LeaseGrant


async def test_a_lower_epoch_is_refused_with_a_clear_error() -> None:
    book = LeaseBook()
    book.grant(LeaseGrant("old", 0, "audio", epoch=1))
    assert book.observe_epoch(2)  # a newer leader was seen (registration or GetLeader)
    with pytest.raises(StaleLease, match=r"^stale_epoch: lease 'late' .* epoch 1; .* epoch 2$"):
        book.grant(LeaseGrant("late", 0, "audio", epoch=1))
    # A grant refused, or one from before the newer epoch, cannot be claimed.
    for lease_id in ("late", "old"):
        with pytest.raises(StaleLease):
            await book.claim(lease_id, "audio", 0.1, lambda reason: None)
    with pytest.raises(StaleLease):
        book.check_epoch("any", 1)
    book.check_epoch("any", 0)  # a holder that names no epoch (no election) passes
    book.grant(LeaseGrant("new", 0, "audio", epoch=2))
    assert (await book.claim("new", "audio", 0.1, lambda reason: None)).epoch == 2
    assert not book.observe_epoch(1) and book.epoch == 2


async def test_without_an_election_epochs_stay_zero() -> None:
    book = LeaseBook()
    book.grant(LeaseGrant("a", 0, "audio"))
    assert (await book.claim("a", "audio", 0.1, lambda reason: None)).epoch == 0
