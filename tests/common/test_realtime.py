"""The real-time admission rule both the scheduler and a worker's default slots follow."""

from __future__ import annotations

import pytest

from omnifabric.common.realtime import MOST_SESSIONS, fits, sessions_within


@pytest.mark.parametrize(
    ("threads", "cost", "added", "expected"),
    [
        (1, 0.3, 0.3, 2),  # 0.6 + 0.3 > 0.8: a third does not fit
        (1, 0.4, 0.4, 2),  # 0.8 exactly fits
        (1, 0.5, 0.5, 1),
        (2, 0.3, 0.3, 5),
        (1, 2.0, 2.0, 1),  # slower than real time alone: an idle worker still takes one
        (1, 0.1, 0.02, 8),  # a batched engine: one more adds a fraction
        (4, 0.0, 0.0, MOST_SESSIONS),
    ],
)
def test_sessions_within(threads, cost, added, expected):
    assert sessions_within(threads, cost, added, 0.8) == expected
    if expected < MOST_SESSIONS and cost > 0:
        held = 1
        while fits(threads, held * cost, added, 0.8):
            held += 1
        assert held == expected  # the formula counts as fits() decides, one by one
