"""A scheduler that was itself stalled does not blame its workers (issue 55): real processes
(a scheduler, two synthetic workers, an edge), the scheduler paused with SIGSTOP for 5 s
under running sessions, then resumed. No worker is declared lost, no lease and no session
ends, the sessions are served throughout (they talk to their workers directly), and a new
caller is served after. Prints what it measured (pytest -s shows it)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import scaled
from tests.e2e.wsclient import WsClient, metric, scrape_metrics, served_unit

#: How long the scheduler is paused: past its worker timeout (3 s) by two report intervals.
STALL_S = 5.0
#: After the resume: the worker timeout and the lost grace, had they been judged wrongly.
AFTER_S = 4.5


async def status(address: str) -> scheduler_pb.GetStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        return await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))


def leases_by_worker(snapshot: scheduler_pb.GetStatusResponse) -> dict[str, set[str]]:
    return {w.worker_id: set(w.lease_ids) for w in snapshot.workers}


async def keep_serving(clients: list[WsClient], until: asyncio.Event) -> int:
    """One unit per client in turn until `until` is set; returns the units served."""
    served = 0
    while not until.is_set():
        for client in clients:
            await served_unit(client)
            served += 1
        await asyncio.sleep(0.2)
    return served


@pytest.mark.ci_long  # a 5 s pause under sessions, and the recovery: ~11 s
async def test_paused_scheduler_declares_no_worker_lost(stack):
    scheduler = stack.start_scheduler()
    for name in ("wa", "wb"):
        stack.start_worker("--slots", "2", "--compute-ms", "5", name=name)
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    clients = []
    for _ in range(3):
        client = await WsClient.open(url)
        await client.start()
        clients.append(client)
    before = leases_by_worker(await status(stack.scheduler_address))
    assert sum(len(ids) for ids in before.values()) == 3, before

    done = asyncio.Event()
    feeding = asyncio.ensure_future(keep_serving(clients, done))
    scheduler.kill(signal.SIGSTOP)
    try:
        await asyncio.sleep(STALL_S)
    finally:
        scheduler.kill(signal.SIGCONT)
    resumed = time.monotonic()
    await asyncio.sleep(AFTER_S)
    done.set()
    served = await asyncio.wait_for(feeding, scaled(10))

    after = leases_by_worker(await status(stack.scheduler_address))
    assert after == before, (before, after)
    samples = await asyncio.to_thread(scrape_metrics, scheduler.metrics_address())
    assert metric(samples, "omni_scheduler_leases_lost_total") == 0
    assert metric(samples, "omni_scheduler_workers_lost_total") == 0
    stalled_s = metric(samples, "omni_scheduler_stalled_seconds_total")
    assert stalled_s > STALL_S - 1.0  # the scheduler knows it was not listening
    log = scheduler.log_path.read_text()
    assert "treating it as hung" not in log and " lost" not in log, log[-3000:]
    for client in clients:
        assert not [e for e in client.events if e["type"] in ("error", "session.closed")]

    # A new caller is granted the free slot and served.
    t0 = time.monotonic()
    newcomer = await WsClient.open(url)
    await newcomer.start()
    await served_unit(newcomer)
    took = time.monotonic() - t0
    print(
        f"scheduler paused {STALL_S:.0f} s (it counted {stalled_s:.2f} s stalled): {served} "
        f"units served meanwhile and after, no worker or lease lost "
        f"{time.monotonic() - resumed:.1f} s after the resume; a new caller served its "
        f"first unit in {took:.2f} s"
    )
