"""A worker whose engine steps sessions together (issue 38's fabric part), on a real stack:
the synthetic engine's batched entry, four callers at once, each answered in real time,
and the worker's batch histogram showing steps that held several sessions."""

from __future__ import annotations

import asyncio

import pytest

from omnifabric.common.stats import percentile
from omnifabric.tools.client import run_session
from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, scrape_metrics
from tests.stack import Stack

QUESTION = [SILENCE, SPEECH, SILENCE]
NO_STARTUP = {"config": {"force_listen_count": 0}}


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path)
    stack.start_scheduler()
    # One engine thread, 200 ms a unit alone; a step of N sessions 200 x (1 + 0.1 (N - 1)).
    stack.start_worker(
        "--slots", "4", "--engine-threads", "1", "--compute-ms", "200", "--batch-share", "0.1"
    )
    stack.start_edge()
    yield stack
    stack.stop()


def metric(samples, name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


async def test_four_callers_are_stepped_together_and_each_answered(stack):
    url = f"{stack.url}?mode=audio"
    runs = [
        run_session(url, QUESTION, pace_s=1.0, reply_tail_s=5, init_extra=NO_STARTUP)
        for _ in range(4)
    ]
    reports = await asyncio.wait_for(asyncio.gather(*runs), scaled(60))
    for report in reports:
        assert report.error is None and report.closed_reason == "user_stop", report.error
        assert not report.lost_units()
        assert any("reply" in u.text for u in report.units.values()), "not answered"
        rtts = [u.rtt_ms for u in report.units.values() if u.rtt_ms is not None]
        # Four sessions time-sliced on one thread would take 4 x 200 ms a second; a step of
        # four takes 260 ms.
        assert percentile(rtts, 95) < 1000.0, rtts
    samples = scrape_metrics(stack.workers[0].metrics_address())
    steps = metric(samples, "omni_worker_batch_sessions_count")
    served = metric(samples, "omni_worker_batch_sessions_sum")
    assert steps > 0 and served / steps > 1.5, (served, steps)
    assert "batched steps: one engine call" in stack.workers[0].log_path.read_text()
