"""Real-time admission on a real stack (issue 37): a worker takes only the sessions it serves
in real time; the others wait in the FIFO queue with a position and an ETA, then are
served, and every caller is answered.

The synthetic engine here has one engine thread and 300 ms of compute a unit: a session
costs 0.3 engine seconds per second, so at the default margin (0.8 of the thread) two
sessions fit and a third would not (0.9), whatever the 8 slots say.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from omnifabric.common.stats import percentile
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.tools.client import SessionReport, run_session
from tests.conftest import scaled
from tests.e2e.test_fabric import scheduler_status
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient, wait_for
from tests.stack import Stack

#: A question, then silence until the reply ended (no units forced to listen at the start).
QUESTION = [SPEECH, SILENCE]
NO_STARTUP = {"config": {"force_listen_count": 0}}


#: Callers in real time for ~15 s, a worker slowed and recovering for ~10 s (tests/conftest.py).
pytestmark = pytest.mark.ci_long


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path)
    stack.start_scheduler()
    stack.start_worker("--slots", "8", "--engine-threads", "1", "--compute-ms", "300")
    stack.start_edge()
    yield stack
    stack.stop()


def queued(report: SessionReport) -> dict | None:
    """The caller's first queue position event, None when it was admitted at once."""
    return next((e for e in report.events if e["type"] == "session.queued"), None)


async def callers(stack: Stack, n: int) -> list[SessionReport]:
    """`n` callers arriving together, each speaking in real time until its reply ended."""
    url = f"{stack.url}?mode=audio"
    runs = [
        run_session(url, QUESTION, pace_s=1.0, reply_tail_s=4, init_extra=NO_STARTUP)
        for _ in range(n)
    ]
    return list(await asyncio.wait_for(asyncio.gather(*runs), scaled(120)))


async def test_a_worker_admits_what_it_serves_in_real_time_and_queues_the_rest(stack):
    async def watch() -> list:
        """The worker's status while the first callers hold it."""
        await asyncio.sleep(3.0)
        return list((await scheduler_status(stack.scheduler_address)).workers)

    seen, first = await asyncio.gather(watch(), callers(stack, 4))
    [worker] = seen
    cost = {c.mode: c.session_cost for c in worker.headroom.costs}
    assert cost[common_pb2.MODE_AUDIO] == pytest.approx(0.3, abs=0.05)
    assert worker.headroom.engine_threads == 1 and worker.slots == 8
    assert common_pb2.MODE_AUDIO not in worker.admits  # two held: a third would not fit
    waiting = [queued(r) for r in first if queued(r) is not None]
    admitted = [r for r in first if queued(r) is None]
    assert len(admitted) == 2 and len(waiting) == 2, [queued(r) for r in first]
    assert sorted(e["position"] for e in waiting) == [1, 2]
    assert all(e["estimated_wait_s"] > 0 for e in waiting)
    for report in first:
        assert report.closed_reason == "user_stop" and report.error is None, report.error
        assert not report.lost_units(), report.lost_units()
        assert any("reply" in u.text for u in report.units.values()), "not answered"
    for report in admitted:  # real time: every unit answered within its second
        assert all(u.kind in ("listen", "speak") for u in report.units.values())
        rtts = [u.rtt_ms for u in report.units.values() if u.rtt_ms is not None]
        assert percentile(rtts, 95) < 1000.0, rtts
    # The waiting ones were served once the first ended (a session here lasts ~5 s).
    assert min(r.queue_wait_s for r in first if queued(r)) > 2.5

    # The queue learned how long a session holds the worker: the next waiting callers'
    # estimate is about their actual wait.
    second = await callers(stack, 4)
    for report in second:
        event = queued(report)
        if event is not None:
            ratio = event["estimated_wait_s"] / report.queue_wait_s
            assert 0.5 < ratio < 2.0, (event, report.queue_wait_s)
    assert sum(queued(r) is not None for r in second) == 2


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` onto one CPU (threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a core to pin a worker to")
async def test_a_slowed_worker_stops_taking_sessions_and_recovers(tmp_path):
    """A worker whose core gets three busy neighbours serves its units late: it takes no new
    session (the newcomer waits in the queue), its own session goes on, and once the
    neighbours are gone it recovers and serves the newcomer."""
    stack = Stack(tmp_path)
    hogs: list[subprocess.Popen] = []
    try:
        stack.start_scheduler()
        worker = stack.start_worker(
            *("--slots", "8", "--engine-threads", "1", "--compute-ms", "350"),
            *("--cpu-bound", "--headroom-window", "3"),
        )
        stack.start_edge()
        pin(worker.proc.pid, 0)
        url = f"{stack.url}?mode=audio"
        held = await WsClient.open(url)
        await held.start()

        async def speak() -> None:  # a unit a second, as a caller does, until cancelled
            while True:
                await held.append(SILENCE)
                await asyncio.sleep(1.0)

        async def hear() -> None:
            while True:
                await held.recv(timeout_s=60)

        caller = [asyncio.ensure_future(speak()), asyncio.ensure_future(hear())]

        async def status():
            [w] = (await scheduler_status(stack.scheduler_address)).workers
            return w

        async def admits_audio() -> bool:
            return common_pb2.MODE_AUDIO in (await status()).admits

        # Quiet: one session of 0.35 leaves room for one more (0.7 of the 0.8).
        await wait_for(admits_audio, 15, interval_s=0.5)
        for _ in range(3):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            hogs.append(hog)
            os.sched_setaffinity(hog.pid, {0})

        async def behind() -> bool:
            w = await status()
            return w.headroom.late_units_recent > 0 and common_pb2.MODE_AUDIO not in w.admits

        await wait_for(behind, 20, interval_s=0.5)
        newcomer = await WsClient.open(url)
        assert (await newcomer.until("session.queued"))["position"] == 1
        for hog in hogs:
            hog.kill()
        # Recovered: the late units leave the window and the costs fall back; the
        # newcomer gets the worker.
        await newcomer.start()
        await newcomer.append(SILENCE)
        await newcomer.until("delta.listen")
        await newcomer.close()
        for task in caller:
            task.cancel()
        # The session it held went on all along: answered, never ended or refused.
        kinds = [e["type"] for e in held.events]
        assert "session.closed" not in kinds and "error" not in kinds, kinds
        assert kinds.count("response.output.delta") >= 5
        assert (await status()).headroom.late_units_total > 0
    finally:
        for hog in hogs:
            hog.kill()
        stack.stop()
