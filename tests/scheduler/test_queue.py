"""The wait queue: FIFO order, its bound, and the wait estimate."""

from __future__ import annotations

import pytest

from omnifabric.scheduler.errors import QueueFull
from omnifabric.scheduler.queue import SessionLengths, Ticket, WaitQueue, estimate_wait_s
from omnifabric.scheduler.registry import Mode


def test_fifo_order_and_positions() -> None:
    queue = WaitQueue(queue_max=10)
    tickets = [Ticket(Mode.AUDIO, f"s{n}") for n in range(4)]
    assert [queue.push(t) for t in tickets] == [1, 2, 3, 4]
    assert list(queue) == tickets
    assert queue.remove(tickets[1])
    assert not queue.remove(tickets[1])
    assert [queue.position(t) for t in tickets] == [1, 0, 2, 3]
    assert list(queue) == [tickets[0], tickets[2], tickets[3]]


def test_queue_full_at_max() -> None:
    queue = WaitQueue(queue_max=2)
    queue.push(Ticket(Mode.AUDIO, "a"))
    queue.push(Ticket(Mode.CHAT, "b"))
    with pytest.raises(QueueFull, match=r"^queue_full: 2 requests waiting \(max 2\)"):
        queue.push(Ticket(Mode.AUDIO, "c"))
    assert len(queue) == 2
    queue.remove(next(iter(queue)))
    assert queue.push(Ticket(Mode.AUDIO, "c")) == 2


def test_resent_tickets_go_first_in_their_earlier_order() -> None:
    queue = WaitQueue(queue_max=3)
    fresh = [Ticket(Mode.AUDIO, f"new{n}") for n in range(3)]
    for ticket in fresh:
        queue.push(ticket)
    # Re-sent after a switch of leader, out of order (the queue is full: they were admitted
    # by the earlier leader).
    third = Ticket(Mode.AUDIO, "third", previous_position=3)
    with pytest.raises(QueueFull):
        queue.push(third)
    assert queue.push(third, over_max=True) == 1
    first = Ticket(Mode.VIDEO, "first", previous_position=1)
    assert queue.push(first, over_max=True) == 1
    second = Ticket(Mode.AUDIO, "second", previous_position=2)
    assert queue.push(second, over_max=True) == 2
    names = ["first", "second", "third", "new0", "new1", "new2"]
    assert [t.session_id for t in queue] == names
    assert [queue.position(t) for t in (first, second, third, *fresh)] == [1, 2, 3, 4, 5, 6]
    assert queue.remove(second) and queue.position(third) == 2
    assert queue.push(Ticket(Mode.AUDIO, "new3"), over_max=True) == 6  # new: at the back


@pytest.mark.parametrize(
    ("position", "mean_s", "slots", "expected"),
    [
        (1, 60.0, 1, 60.0),
        (3, 60.0, 1, 180.0),
        (1, 10.0, 4, 10.0),
        (4, 10.0, 4, 10.0),
        (5, 10.0, 4, 20.0),
        (2, 10.0, 0, 20.0),  # no serving slots: counted as one
    ],
)
def test_estimate_wait(position: int, mean_s: float, slots: int, expected: float) -> None:
    assert estimate_wait_s(position, mean_s, slots) == pytest.approx(expected)


def test_session_lengths_moving_average() -> None:
    lengths = SessionLengths(alpha=0.5, initial_s=60.0)
    assert lengths.mean_s(Mode.AUDIO) == 60.0
    lengths.observe(Mode.AUDIO, 10.0)
    assert lengths.mean_s(Mode.AUDIO) == 10.0
    lengths.observe(Mode.AUDIO, 20.0)
    assert lengths.mean_s(Mode.AUDIO) == pytest.approx(15.0)
    assert lengths.mean_s(Mode.VIDEO) == 60.0


def _grants(*ages: float, now: float = 100.0) -> list[tuple[float, str]]:
    """Held sessions of these ages at `now`, oldest first, as LeaseTable.grants gives them."""
    return sorted((now - age, f"l{n}") for n, age in enumerate(ages))


@pytest.mark.parametrize(
    ("position", "expected"),
    [(1, 7.0), (4, 10.0), (5, 17.0), (8, 20.0), (9, 27.0)],
)
def test_a_queue_behind_sessions_begun_together_waits_for_their_end(
    position: int, expected: float
) -> None:
    """Four slots, four sessions 3 s into their 10 s: nobody is served before 7 s, and
    each round after that a whole session more (the flow estimate would say 2.5 s)."""
    grants = _grants(3.0, 3.0, 3.0, 3.0)
    assert estimate_wait_s(position, 10.0, 4, grants, now=100.0) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("position", "expected"),
    [(1, 2.5), (2, 5.0), (3, 7.5), (4, 10.0), (6, 15.0)],
)
def test_a_queue_behind_scattered_sessions_moves_with_their_ends(
    position: int, expected: float
) -> None:
    """Sessions begun 2.5 s apart: one frees every 2.5 s, not a whole session per round of
    slots (the estimate before issue 55 said 10 s to each of the first four)."""
    grants = _grants(10.0, 7.5, 5.0, 2.5)
    assert estimate_wait_s(position, 10.0, 4, grants, now=100.0) == pytest.approx(expected)


def test_sessions_past_the_mean_leave_the_flow_estimate() -> None:
    """Held sessions all older than the mean are expected to end at any moment: what is
    left is the flow of slots, p x mean / slots, never less."""
    grants = _grants(50.0, 40.0, 30.0, 20.0)
    assert [estimate_wait_s(p, 10.0, 4, grants, now=100.0) for p in (1, 2, 5)] == [
        pytest.approx(2.5),
        pytest.approx(5.0),
        pytest.approx(12.5),
    ]
