"""End to end: /metrics on the scheduler, worker and edge processes after a real session,
and JSON log lines that name the session."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.wsclient import SILENCE, WsClient
from tests.stack import Stack

UNITS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "2", "--compute-ms", "5")
        s.start_edge()
        yield s
    finally:
        s.stop()


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET http://address/metrics: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        assert reply.status == 200
        content_type = reply.headers["Content-Type"]
        text = reply.read().decode()
    assert content_type.startswith("text/plain")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples, name: str, **labels: str) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    assert name in samples, f"{name} missing from {sorted(samples)}"
    return sum(v for lbl, v in samples[name] if all(lbl.get(k) == x for k, x in labels.items()))


async def test_metrics_of_every_service_after_a_session(stack):
    edge_address = stack.url.removeprefix("ws://").split("/", 1)[0]
    scheduler_address = stack.services[0].metrics_address()
    worker_address = stack.workers[0].metrics_address()
    assert scheduler_address and worker_address, "ready lines without metrics="

    client = await WsClient.open(f"{stack.url}?mode=audio")
    created = await client.start()
    session_id = created["session_id"]
    for _ in range(UNITS):
        await client.append(SILENCE)
        await client.until("delta.listen", "delta.audio")
    await client.send({"type": "session.close"})
    closed = await client.until("session.closed")
    assert closed["reason"] == "user_stop"

    edge = await asyncio.to_thread(scrape, edge_address)
    assert total(edge, "omni_edge_sessions_total", reason="user_stop") >= 1
    assert total(edge, "omni_edge_units_forwarded_total", mode="audio") >= UNITS
    assert total(edge, "omni_edge_outputs_total", mode="audio") >= UNITS
    assert total(edge, "omni_edge_queue_wait_seconds_count") >= 1
    assert total(edge, "omni_edge_unit_seconds_count") >= UNITS
    assert "omni_edge_sessions_active" in edge

    worker = await asyncio.to_thread(scrape, worker_address)
    # Units are counted when their results go out: wait for the ended session's last ones.
    assert total(worker, "omni_worker_units_total") + total(
        worker, "omni_worker_units_dropped_total"
    ) == total(edge, "omni_edge_units_forwarded_total")
    assert total(worker, "omni_worker_sessions_ended_total", reason="user_stop") >= 1
    assert total(worker, "omni_worker_unit_stage_seconds_count", stage="wall_clock") >= UNITS
    assert total(worker, "omni_worker_slots") == 2
    assert total(worker, "omni_worker_slots_free") == 2
    assert total(worker, "omni_worker_memory_baseline_bytes", device="cpu") > 0
    for name in (
        "omni_worker_unit_deadline_misses_total",
        "omni_worker_unit_context_tokens_bucket",
        "omni_worker_sessions_active",
        "omni_worker_memory_allocated_bytes",
    ):
        assert name in worker, name

    scheduler = await asyncio.to_thread(scrape, scheduler_address)
    assert total(scheduler, "omni_scheduler_leases_granted_total") >= 1
    assert total(scheduler, "omni_scheduler_leases_returned_total") >= 1
    assert total(scheduler, "omni_scheduler_workers", health="serving") == 1
    assert total(scheduler, "omni_scheduler_worker_slots", worker_id="worker0") == 2
    assert total(scheduler, "omni_scheduler_queue_wait_seconds_count", mode="audio") >= 1
    for name in (
        "omni_scheduler_queue_length",
        "omni_scheduler_leases_lost_total",
        "omni_scheduler_leases_expired_total",
        "omni_scheduler_queue_full_rejections_total",
        "omni_scheduler_worker_slots_free",
    ):
        assert name in scheduler, name

    # Logs are JSON lines; the worker's line about the session's end names it.
    ended = [
        line
        for line in _json_lines(stack.workers[0].log())
        if line["msg"].startswith(f"session {session_id} ended")
    ]
    assert ended, stack.workers[0].log()
    assert ended[0]["session_id"] == session_id
    assert (ended[0]["service"], ended[0]["level"]) == ("worker", "INFO")
    edge_lines = [
        line for line in _json_lines(stack.edge.log()) if f"{session_id} closed" in line["msg"]
    ]
    assert edge_lines and edge_lines[0]["session_id"] == session_id
    granted = [
        line
        for line in _json_lines(stack.services[0].log())
        if line["msg"].startswith("lease ") and session_id in line["msg"]
    ]
    assert granted and granted[0]["session_id"] == session_id


async def test_process_gauges_of_every_service(stack):
    """RSS, open fds and live asyncio tasks on every /metrics, with plausible values."""
    addresses = {
        "edge": stack.url.removeprefix("ws://").split("/", 1)[0],
        "scheduler": stack.services[0].metrics_address(),
        "worker": stack.workers[0].metrics_address(),
    }
    for service, address in addresses.items():
        samples = await asyncio.to_thread(scrape, address)
        rss = total(samples, "process_resident_memory_bytes")
        # A Python service with grpc and numpy loaded: tens of MiB, not bytes or terabytes.
        assert 10 * 2**20 < rss < 4 * 2**30, (service, rss)
        fds = total(samples, "process_open_fds")
        assert 3 < fds < total(samples, "process_max_fds"), (service, fds)
        tasks = total(samples, f"omni_{service}_asyncio_tasks")
        # At least the service's own serving task; a leak would be thousands.
        assert 1 <= tasks < 1000, (service, tasks)
    # The edge times its garbage-collector pauses (its event loop stands still meanwhile).
    edge = await asyncio.to_thread(scrape, addresses["edge"])
    generations = {lbl["generation"] for lbl, _ in edge["omni_edge_gc_pause_seconds_count"]}
    assert generations == {"0", "1", "2"}


def _json_lines(text: str) -> list[dict]:
    """The JSON objects among a service log's lines (the ready line is plain text)."""
    lines = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # the log tail may start mid-line
    return lines
