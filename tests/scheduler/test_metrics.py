"""Scheduler metrics: queue, leases (granted/returned/expired), queue_full, workers and
slots follow the core; /metrics over HTTP; JSON log lines name the session."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request

import pytest

from omnifabric.common import logs
from omnifabric.common.metrics import serve_http
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import LeaseOffer, QueueUpdate, Scheduler, WorkerHello
from omnifabric.scheduler.errors import QueueFull
from omnifabric.scheduler.registry import Health, Mode
from tests.conftest import scaled
from tests.scheduler.clients import announce


def _hello(worker_id: str = "w1", slots: int = 1) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        address="127.0.0.1:1",
        slots=slots,
        modes=frozenset({Mode.AUDIO}),
        engine="synthetic",
        health=Health.SERVING,
    )


async def test_counters_and_state_follow_the_core():
    core = Scheduler(SchedulerConfig(queue_max=1, release_timeout_s=0.05))
    value = core.metrics.registry.get_sample_value
    worker = core.register(_hello())
    announcer = asyncio.ensure_future(announce(worker))
    try:
        assert value("omni_scheduler_workers", {"health": "serving"}) == 1
        assert value("omni_scheduler_worker_slots_free", {"worker_id": "w1"}) == 1

        first = core.acquire(Mode.AUDIO, "s1")
        assert isinstance(await anext(first), LeaseOffer)
        assert value("omni_scheduler_leases_granted_total") == 1
        assert value("omni_scheduler_leases_active") == 1
        assert value("omni_scheduler_worker_slots_free", {"worker_id": "w1"}) == 0

        second = core.acquire(Mode.AUDIO, "s2")
        assert isinstance(await anext(second), QueueUpdate)
        assert value("omni_scheduler_queue_length") == 1
        with pytest.raises(QueueFull):
            await anext(core.acquire(Mode.AUDIO, "s3"))
        assert value("omni_scheduler_queue_full_rejections_total") == 1

        # The first holder leaves; the worker never confirms: the release timeout frees
        # the slot ("expired") and the waiting session gets it.
        await first.aclose()
        assert value("omni_scheduler_leases_returned_total") == 1
        offer = await asyncio.wait_for(anext(second), scaled(2))
        assert isinstance(offer, LeaseOffer)
        assert value("omni_scheduler_leases_expired_total") == 1
        assert value("omni_scheduler_leases_granted_total") == 2
        assert value("omni_scheduler_queue_length") == 0
        assert value("omni_scheduler_queue_wait_seconds_count", {"mode": "audio"}) == 2
        assert value("omni_scheduler_queue_wait_seconds_sum", {"mode": "audio"}) >= 0.05

        core.unregister(worker)
        assert await anext(second) is not None  # the lease is lost with its worker
        assert value("omni_scheduler_leases_lost_total") == 1
        assert value("omni_scheduler_workers", {"health": "serving"}) == 0
        await second.aclose()
    finally:
        announcer.cancel()


async def test_serve_http_answers_metrics():
    core = Scheduler(SchedulerConfig())
    core.register(_hello("w9", slots=3))
    server, port = serve_http(core.metrics.registry, "127.0.0.1", 0)
    try:

        def scrape(path: str) -> tuple[int, str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                return reply.status, reply.read().decode()

        status, body = await asyncio.to_thread(scrape, "/metrics")
        assert status == 200
        assert 'omni_scheduler_worker_slots{worker_id="w9"} 3.0' in body
        assert "# HELP omni_scheduler_queue_wait_seconds" in body
        assert (await asyncio.to_thread(scrape, "/healthz"))[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_config_metrics_port_range():
    assert SchedulerConfig().metrics_port == 9150
    assert SchedulerConfig.from_env({"OMNI_SCHEDULER_METRICS_PORT": "-1"}).metrics_port == -1
    with pytest.raises(ValueError, match="OMNI_SCHEDULER_METRICS_PORT"):
        SchedulerConfig.from_env({"OMNI_SCHEDULER_METRICS_PORT": "70000"})


def test_grant_log_line_names_the_session_in_json():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("scheduler"))
    logger = logging.getLogger("omnifabric.scheduler.core")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:

        async def grant() -> None:
            core = Scheduler(SchedulerConfig())
            worker = core.register(_hello())
            events = core.acquire(Mode.AUDIO, "rt_42")
            task = asyncio.ensure_future(anext(events))
            notice = await worker.outbox.get()
            notice.lease.announced.set()
            await task
            await events.aclose()

        asyncio.run(grant())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    grant_line = next(line for line in lines if line["msg"].startswith("lease "))
    assert grant_line["session_id"] == "rt_42"
    assert (grant_line["service"], grant_line["logger"]) == (
        "scheduler",
        "omnifabric.scheduler.core",
    )


def test_leaderships_and_rebuild_seconds_follow_the_core(monkeypatch):
    """Leaderships begun count every lead() (a failover or handover to this scheduler); the
    rebuild gauge has no sample before the first, then the time from taking the lead to the
    last registration within the rebuild window."""
    from omnifabric.scheduler import core as core_module
    from omnifabric.scheduler.leadership import REBUILD_S

    clock = [1000.0]
    monkeypatch.setattr(core_module.time, "monotonic", lambda: clock[0])
    core = Scheduler(SchedulerConfig())
    value = core.metrics.registry.get_sample_value
    assert value("omni_scheduler_leaderships_total") == 0
    assert value("omni_scheduler_rebuild_seconds") is None
    assert "# TYPE omni_scheduler_rebuild_seconds gauge" in core.metrics.exposition().decode()

    core.lead(1, "a")
    assert value("omni_scheduler_leaderships_total") == 1
    assert value("omni_scheduler_rebuild_seconds") == 0
    clock[0] += 0.25
    core.register(_hello("w1"))
    assert value("omni_scheduler_rebuild_seconds") == pytest.approx(0.25)
    clock[0] += REBUILD_S  # past the window: a late registration is no rebuild
    core.register(_hello("w2"))
    assert value("omni_scheduler_rebuild_seconds") == pytest.approx(0.25)

    core.follow("b", 2)
    core.lead(3, "a")
    assert value("omni_scheduler_leaderships_total") == 2
    assert value("omni_scheduler_rebuild_seconds") == 0
    assert value("omni_scheduler_epoch") == 3
