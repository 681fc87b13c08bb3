"""The worker's real-time headroom: what a session costs (its recent units' mean, never under
the mean of speaking ones, the engine's estimate until enough were measured), late
units within the window, and the figures the scheduler reads."""

from __future__ import annotations

import pytest

from omnifabric.common.stats import percentile
from omnifabric.worker.headroom import MIN_MEASURED, Headroom


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_estimate_holds_until_units_are_measured_then_recent_units_decide():
    clock = Clock()
    room = Headroom(1, {"audio": 0.5, "chat": 1.0}, lambda c: c, window_s=10.0, clock=clock)
    assert room.session_cost("audio") == 0.5  # before any unit: the engine's estimate
    for _ in range(MIN_MEASURED - 1):
        room.unit("audio", "L1", 1.0, 0.1, 0.2)
        clock.now += 1.0
    assert room.session_cost("audio") == 0.5  # too few measured to go below it
    room.unit("audio", "L1", 1.0, 0.1, 0.2)
    assert room.session_cost("audio") == pytest.approx(0.1)
    # Half a second of input at 0.1 s of engine time is 0.2 a second; the window (10 s)
    # holds these 5 and the last 6 of the others.
    for _ in range(5):
        clock.now += 1.0
        room.unit("audio", "L1", 0.5, 0.1, 0.2)
    assert room.session_cost("audio") == pytest.approx((5 * 0.2 + 6 * 0.1) / 11)
    figures = room.figures()
    assert figures.costs["audio"].session_cost == figures.costs["audio"].added_cost
    assert figures.costs["chat"].session_cost == 1.0 and figures.engine_threads == 1


def test_a_session_costs_what_its_replies_cost():
    """Nine listening units in ten cost 0.05, the speaking ones 0.6: a session is taken to
    cost what it costs while it speaks (the admitted must keep real time then too), not its
    average (0.105)."""
    clock = Clock()
    room = Headroom(2, {"audio": 0.0}, lambda c: c / 4, window_s=60.0, clock=clock)
    for n in range(40):
        clock.now += 1.0
        speaking = n % 10 == 0
        room.unit("audio", "L1", 1.0, 0.6 if speaking else 0.05, 0.7, speaking=speaking)
    assert room.session_cost("audio") == pytest.approx(0.6)
    assert room.figures().costs["audio"].added_cost == pytest.approx(0.15)  # the engine's
    # A reply's cost sits in its first units (the reference engine: 2.0, 0.5, then 0.02
    # a second): the session costs the reply's mean, not its cheapest units' median.
    clock.now += 60.0  # the earlier units leave the window
    for cost in (2.0, 0.5, 0.02) * 2 + (0.05,) * 20:
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, cost, 1.0, speaking=cost != 0.05)
    assert room.session_cost("audio") == pytest.approx((2.0 + 0.5 + 0.02) / 3)


def test_late_units_count_within_the_window_and_by_lease():
    clock = Clock()
    room = Headroom(1, {"audio": 0.3}, lambda c: c, window_s=3.0, clock=clock)
    assert not room.unit("audio", "L1", 1.0, 0.3, 0.99)
    assert room.unit("audio", "L1", 1.0, 0.3, 1.2)  # later than its own length
    # A unit shorter than a second (cut where speech stopped) is late after a second only:
    # it may wait for the finalize of the unit before it.
    assert not room.unit("audio", "L2", 0.5, 0.3, 0.9)
    assert room.unit("audio", "L2", 0.5, 0.3, 1.01)
    assert room.unit("audio", "L2", 2.0, 0.3, 2.1) and not room.unit("audio", "L2", 2.0, 0.3, 1.9)
    figures = room.figures()
    assert (figures.late_recent, figures.late_total) == (3, 3)
    assert figures.late_by_lease == {"L1": 1, "L2": 2}
    ratios = [0.99, 1.2, 1.8, 2.02, 1.05, 0.95]
    assert figures.unit_p95_ratio == pytest.approx(percentile(ratios, 95))
    clock.now += 3.5  # the window passed: recovered (the total stays)
    room.session_ended("L2")
    figures = room.figures()
    assert (figures.late_recent, figures.late_total) == (0, 3)
    assert figures.late_by_lease == {"L1": 1}


def test_a_slow_spell_leaves_the_costs_with_the_window():
    clock = Clock()
    room = Headroom(1, {"audio": 0.3}, lambda c: c, window_s=5.0, clock=clock)
    for _ in range(MIN_MEASURED):
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, 0.3, 0.4)
    for _ in range(5):  # a neighbour on the core: each unit takes four times as long
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, 1.2, 1.3)
    # The window (5 s, its start included) holds the five slow ones and the last quick one.
    assert room.session_cost("audio") == pytest.approx((5 * 1.2 + 0.3) / 6)
    for _ in range(6):
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, 0.3, 0.4)
    assert room.session_cost("audio") == pytest.approx(0.3)


def test_the_headroom_counts_the_engine_threads_that_run_at_full_speed():
    """An engine whose threads slow each other down (the reference engine on a host of few
    cores measures it at warm-up) gives the headroom the threads it measured, not all."""
    from omnifabric.worker.config import WorkerConfig
    from omnifabric.worker.engines.synthetic import SyntheticEngine
    from omnifabric.worker.runtime import WorkerRuntime

    engine = SyntheticEngine(compute_ms=0, slots=4)
    engine.parallel_units = 1
    runtime = WorkerRuntime(WorkerConfig(engine="synthetic", batching="off"), engine)
    try:
        assert runtime.engine_threads == 4  # before warm-up: one per engine thread
        runtime._measure_headroom(0.5)
        assert runtime.engine_threads == 1
        assert runtime.headroom is not None and runtime.headroom.figures().engine_threads == 1
    finally:
        runtime.executor.shutdown()


@pytest.mark.parametrize("batching", ["off", "on"])
def test_a_time_sliced_worker_adds_a_whole_peak_a_batched_one_none(batching):
    from omnifabric.worker.config import WorkerConfig
    from omnifabric.worker.engines.synthetic import SyntheticEngine
    from omnifabric.worker.runtime import WorkerRuntime

    engine = SyntheticEngine(compute_ms=100, slots=4, batch_share=0.1)
    runtime = WorkerRuntime(WorkerConfig(engine="synthetic", batching=batching), engine)
    try:
        runtime._measure_headroom(0.5)
        assert runtime.headroom is not None and (runtime.stepper is None) == (batching == "off")
        cost = runtime.headroom.figures().costs["audio"]
        assert cost.peak_cost > 0
        assert cost.added_peak == (cost.peak_cost if batching == "off" else 0.0)
    finally:
        runtime.executor.shutdown()


def test_a_session_peaks_at_its_dearest_unit_and_keeps_it_while_it_listens():
    """The unit that ends a turn costs 0.95, the reply's others 0.3 and 0.02, listening
    0.05: the peak is the dear unit (the mean stays the reply's), what one more adds at its
    peak is the engine's `added` of it, and the peak outlives the window while the session
    listens (its last speaking units)."""
    clock = Clock()
    room = Headroom(1, {"audio": 0.2}, lambda c: c / 4, window_s=10.0, clock=clock)
    assert room.peak_cost("audio") == pytest.approx(0.2)  # the estimate, nothing measured
    for cost in (0.05,) * 20 + (0.95, 0.3, 0.02):
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, cost, 0.99, speaking=cost != 0.05)
    assert room.peak_cost("audio") == pytest.approx(0.95)
    assert room.session_cost("audio") == pytest.approx((0.95 + 0.3 + 0.02) / 3)
    cost = room.figures().costs["audio"]
    assert (cost.peak_cost, cost.added_peak) == pytest.approx((0.95, 0.95 / 4))
    for _ in range(30):  # half a minute of listening: the window holds no reply
        clock.now += 1.0
        room.unit("audio", "L1", 1.0, 0.05, 0.1)
    assert room.peak_cost("audio") == pytest.approx(0.95)
    assert room.peak_cost("video") == 0.0
    # A batched step's rows do not wait for each other's dear units: it adds no peak.
    rows = Headroom(1, {"audio": 0.2}, lambda c: c / 4, added_peak=lambda _peak: 0.0)
    assert rows.figures().costs["audio"].added_peak == 0.0
