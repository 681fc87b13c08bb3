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
