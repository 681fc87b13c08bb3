"""An engine call on the engine threads, bounded by the unit timeout from when it starts.

The worker's runners (worker.runner, worker.batcher) submit every engine call of a unit
through EngineCall and await it with `bounded`. The bound counts from the moment an engine
thread takes the call up, not from its submission: a call that waited for a free thread
behind other sessions' calls is not stuck, and counting that wait ended healthy sessions on
a busy CPU host (several sessions' finalizes of 1-3 s each queued on two engine threads).
A call that never starts waits behind calls that are themselves bounded: where those hang,
their sessions end stuck and the worker stops taking sessions (worker.runtime); the edge's
unit watchdog ends the waiting sessions' clients.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class Overran(Exception):
    """The call ran past its bound and goes on in its thread (it cannot be interrupted)."""


class EngineCall:
    """`fn(*args)` submitted to `executor`, noting when an engine thread took it up."""

    __slots__ = ("future", "started")

    def __init__(self, executor: Executor, fn: Callable[..., Any], *args: Any) -> None:
        self.started: float | None = None
        """time.monotonic() when an engine thread began the call; None while it waits."""
        self.future: Future[Any] = executor.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self.started = time.monotonic()
        return fn(*args)

    async def bounded(self, timeout_s: float | None, loop: asyncio.AbstractEventLoop) -> Any:
        """The call's result (or its own exception); raises Overran once it has run
        `timeout_s` since it started (None: unbounded). Cancelling the awaiting task cancels
        a call that has not started yet."""
        waiter = asyncio.wrap_future(self.future, loop=loop)
        if timeout_s is None:
            return await waiter
        overran = False
        timer: list[asyncio.TimerHandle] = []

        def check() -> None:
            nonlocal overran
            started = self.started
            # Not started yet: look again a whole bound later (it cannot be due before).
            left = timeout_s if started is None else started + timeout_s - time.monotonic()
            if left > 0:
                timer[0] = loop.call_later(left, check)
                return
            if self.future.done():
                return  # it ended in time: its result reaches the waiter in a loop turn
            overran = True
            # Only the wait ends: a running call ignores the cancel its future passes on.
            waiter.cancel()

        timer.append(loop.call_later(timeout_s, check))
        try:
            return await waiter
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not overran or (task is not None and task.cancelling()):
                raise  # the awaiting task itself was cancelled
            raise Overran from None
        finally:
            timer[0].cancel()
