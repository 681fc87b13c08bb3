"""The real-time admission rule: the sessions on a worker, and one more, must keep within a
margin of its engine's time. The scheduler leases by it (scheduler.registry) and a worker
sizes its default slots by it (worker.runtime), so both read it here.

Costs are engine seconds per second of a session's input (worker.headroom measures them);
an engine with `threads` threads has `threads` engine seconds a second to give.
"""

from __future__ import annotations

import math

#: The share of the engine's time admitted sessions may take, unless configured: room for
#: the units of a reply that cost more than the quantile, and for the host's own noise.
MARGIN = 0.8
#: The most sessions sessions_within() counts to (a cost of 0 fits any number).
MOST_SESSIONS = 4096


def fits(threads: int, committed: float, added: float, margin: float) -> bool:
    """Whether sessions costing `committed` in all, and one more that adds `added`, stay
    within `margin` of `threads` engine threads."""
    return committed + added <= margin * max(1, threads) + 1e-9


def peaks_fit(threads: int, held_peak: float, added_peak: float) -> bool:
    """Whether the dearest unit of the sessions held (`held_peak`, engine seconds per second)
    and one more session's dearest unit (what it adds: `added_peak`) can run at once within
    `threads` engine threads, so that neither is late. No margin: peaks are already the
    dear end of what units cost (worker.headroom.PEAK_QUANTILE)."""
    return held_peak + added_peak <= max(1, threads) + 1e-9


def sessions_within(threads: int, session_cost: float, added_cost: float, margin: float) -> int:
    """How many sessions of one cost a worker holds in real time: at least 1 (a worker with
    none always takes one), at most MOST_SESSIONS."""
    if session_cost <= 0:
        return MOST_SESSIONS
    # The first n with n x session_cost + added_cost over the margin: n sessions fit.
    room = margin * max(1, threads) + 1e-9 - added_cost
    return max(1, min(MOST_SESSIONS, math.floor(room / session_cost) + 1))
