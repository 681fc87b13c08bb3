"""worker.engine_call: an engine call's bound counts from when an engine thread takes it up."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from omnifabric.worker.engine_call import EngineCall, Overran


def _held(gate: threading.Event) -> str:
    gate.wait(30)
    return "held"


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def test_a_call_that_waited_for_a_thread_is_bounded_from_its_start():
    """One engine thread, held 0.6 s by another call: a 0.3 s call queued behind it is
    answered under a 0.5 s bound (the wait is not the call's), where counting from its
    submission would have ended it."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    with ThreadPoolExecutor(1) as executor:
        ahead = EngineCall(executor, _held, gate)
        queued = EngineCall(executor, _sleep, 0.3)
        loop.call_later(0.6, gate.set)
        began = time.monotonic()
        assert await queued.bounded(0.5, loop) == 0.3
        assert time.monotonic() - began >= 0.9
        assert queued.started is not None and queued.started - began >= 0.55
        assert await ahead.bounded(None, loop) == "held"


async def test_a_call_running_past_its_bound_overruns_and_goes_on():
    """A call past its bound raises Overran no sooner than the bound after it started,
    even where it first waited for a thread; it is left to finish in its thread."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    with ThreadPoolExecutor(1) as executor:
        ahead = EngineCall(executor, _sleep, 0.4)
        stuck = EngineCall(executor, _held, gate)
        began = time.monotonic()
        with pytest.raises(Overran):
            await stuck.bounded(0.3, loop)
        assert stuck.started is not None
        assert time.monotonic() - stuck.started >= 0.3
        assert time.monotonic() - began >= 0.65  # 0.4 s waiting, then 0.3 s running
        assert await ahead.bounded(None, loop) == 0.4
        assert not stuck.future.done()
        gate.set()
        assert await asyncio.wrap_future(stuck.future) == "held"


async def test_the_calls_own_errors_pass_through():
    """An engine's own TimeoutError is its failure, not an overrun."""
    loop = asyncio.get_running_loop()

    def raising() -> None:
        raise TimeoutError("the engine's own")

    with ThreadPoolExecutor(1) as executor:
        with pytest.raises(TimeoutError, match="the engine's own"):
            await EngineCall(executor, raising).bounded(5.0, loop)
        with pytest.raises(TimeoutError, match="the engine's own"):
            await EngineCall(executor, raising).bounded(None, loop)


async def test_cancelling_the_wait_drops_a_call_not_yet_started():
    """The awaiting task cancelled (its session closed) while the call waits for a thread:
    the call never runs; the task's own cancellation is not taken for an overrun."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    ran: list[float] = []
    with ThreadPoolExecutor(1) as executor:
        ahead = EngineCall(executor, _held, gate)
        queued = EngineCall(executor, lambda: ran.append(1.0))
        waiting = asyncio.create_task(queued.bounded(0.2, loop))
        await asyncio.sleep(0.3)  # past one bound: the check found the call not started
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        assert await ahead.bounded(None, loop) == "held"
    assert queued.future.cancelled() and queued.started is None and ran == []
