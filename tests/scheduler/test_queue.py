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


def test_a_resent_ticket_takes_its_place_by_arrival() -> None:
    queue = WaitQueue(queue_max=3)
    late = [Ticket(Mode.AUDIO, f"new{n}", enqueued_at=100.0 + n) for n in range(3)]
    for ticket in late:
        queue.push(ticket)
    # Re-sent after a switch of leader: arrived before new1, and the queue is full.
    with pytest.raises(QueueFull):
        queue.push(Ticket(Mode.AUDIO, "old", enqueued_at=100.5))
    old = Ticket(Mode.AUDIO, "old", enqueued_at=100.5)
    assert queue.push(old, over_max=True) == 2
    first = Ticket(Mode.VIDEO, "first", enqueued_at=50.0)
    assert queue.push(first, over_max=True) == 1
    assert [t.session_id for t in queue] == ["first", "new0", "old", "new1", "new2"]
    assert [queue.position(t) for t in (first, late[0], old, late[1], late[2])] == [1, 2, 3, 4, 5]
    # A tie keeps arrival order at the new leader (behind the one already there).
    tie = Ticket(Mode.AUDIO, "tie", enqueued_at=100.5)
    assert queue.push(tie, over_max=True) == 4
    assert queue.remove(old) and queue.position(tie) == 3


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
