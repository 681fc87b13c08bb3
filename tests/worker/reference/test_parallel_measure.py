"""The reference engine's warm-up measure of the engine threads that count (issue 54): a
slow first reply alone must not make two copies at once look like two threads' work."""

from __future__ import annotations

import threading
import time

import numpy as np

from omnifabric.worker.engines.reference.engine import ReferenceEngine


class _Serial:
    """A reply and a hearing that take turns on one lock, 0.2 s each: two copies at once
    do one copy's work."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def _do(self) -> None:
        with self.lock:
            time.sleep(0.2)

    def chat(self, turn):
        self._do()
        yield from ()

    def hear(self, audio):
        self._do()


def test_a_slow_first_reply_alone_does_not_count_a_second_thread():
    # The warm-up's first reply took 2.0 s (cold, or the host was busy); alone the work
    # takes 0.4 s and two copies 0.8 s: one thread's work, whatever the first reply took.
    e = ReferenceEngine(slots=2, threads=2)
    work = _Serial()
    e.chat = work.chat  # type: ignore[method-assign]
    e._asr = work  # type: ignore[assignment]
    assert e._measure_parallel(None, np.zeros(16000, np.float32), alone_s=2.0) == 1
