"""Multi-host: the scheduler, two workers, the edge and the client each on a host of its own
(network namespaces joined by veth links to a bridge, tests/netns.py). A worker host's link
is cut mid-session (RELIABILITY.md F2) and the scheduler is restarted (F4); the test prints
what it measured (pytest -s shows it). Skips with the reason where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from tests import netns
from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import (
    SILENCE,
    WsClient,
    metric,
    scrape_metrics,
    served_unit,
    wait_for,
)
from tests.stack import Service

HOSTS = ["sched", "w1", "w2", "edge", "client"]
# Every host has its own port space, so each service runs on its documented default port.
SCHEDULER_PORT, SCHEDULER_METRICS_PORT = 50051, 9150
WORKER_PORT, WORKER_METRICS_PORT = 22400, 9160
EDGE_PORT, EDGE_GRPC_PORT = 8006, 8007
#: The edge's resume window here (its default is 30 s): how long the cut worker keeps a
#: session whose stream broke before it frees it.
RESUME_WINDOW_S = 5


class Hosts:
    """The network and the services started on its hosts (killed before it is removed)."""

    def __init__(self, net: netns.Network, log_dir: Path) -> None:
        self.net = net
        self.log_dir = log_dir
        self.services: list[Service] = []

    def start(self, host: str, name: str, module: str, *args: str) -> Service:
        """Launch `python -m module args` inside `host`'s namespace; logs in log_dir/name.log."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [*self.net.exec_prefix(host), sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        service = Service(name, proc, self.log_dir / f"{name}.log")
        threading.Thread(target=service._pump, daemon=True).start()
        self.services.append(service)
        return service

    def scheduler(self, name: str = "scheduler") -> Service:
        """A scheduler on the sched host's address and fixed ports (a restart finds them again)."""
        return self.start(
            "sched", name, "omnifabric.scheduler",
            "--host", self.net.address("sched"), "--port", str(SCHEDULER_PORT),
            "--metrics-port", str(SCHEDULER_METRICS_PORT),
        )  # fmt: skip

    def worker(self, host: str) -> Service:
        """A synthetic-engine worker (2 slots, worker id = host name) on `host`'s address."""
        return self.start(
            host, host, "omnifabric.worker",
            "--host", self.net.address(host), "--port", str(WORKER_PORT),
            "--metrics-port", str(WORKER_METRICS_PORT), "--worker-id", host,
            "--scheduler", f"{self.net.address('sched')}:{SCHEDULER_PORT}",
            "--engine", "synthetic", "--slots", "2", "--compute-ms", "5",
        )  # fmt: skip

    def edge(self) -> Service:
        """An edge on the edge host's address (WebSocket and gRPC ports); a dropped session
        waits RESUME_WINDOW_S for its client's resume."""
        return self.start(
            "edge", "edge", "omnifabric.edge",
            "--host", self.net.address("edge"), "--port", str(EDGE_PORT),
            "--grpc-port", str(EDGE_GRPC_PORT),
            "--scheduler", f"{self.net.address('sched')}:{SCHEDULER_PORT}",
            "--resume-window", str(RESUME_WINDOW_S),
        )  # fmt: skip

    def close(self) -> None:
        """SIGKILL every service, then remove the network (namespaces, links, bridge)."""
        for service in self.services:
            service.kill(signal.SIGKILL)
            service.proc.wait()
        self.net.destroy()


@pytest.fixture
def stack(tmp_path):
    """Hosts on their own network. Named `stack` so that the e2e conftest closes the test's
    clients before this is torn down."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    netns.remove_stale()
    hosts = Hosts(netns.Network(HOSTS), tmp_path)
    try:
        hosts.net.create()
        yield hosts
    finally:
        hosts.close()


def registered(scheduler_metrics: str) -> dict[str, float]:
    """worker id -> free slots, of every worker the scheduler holds ({} while it is down)."""
    try:
        samples = scrape_metrics(scheduler_metrics)
    except OSError:
        return {}
    return {
        labels["worker_id"]: value
        for labels, value in samples.get("omni_scheduler_worker_slots_free", [])
    }


def sessions_on(worker: Service) -> float:
    """Sessions the worker itself has open (its own /metrics, on its host's address)."""
    return metric(scrape_metrics(worker.metrics_address()), "omni_worker_sessions_active")


async def started(url: str) -> WsClient:
    """A new client with its session created and one unit served."""
    client = await WsClient.open(url)
    await client.start()
    await served_unit(client)
    return client


INIT = {"type": "session.init", "payload": {"system_prompt": "hi"}}


async def admitted(url: str, timeout_s: float = 10.0) -> tuple[WsClient, dict, float]:
    """Open clients until the edge takes one in (queued or leased) instead of refusing it
    with service_unavailable, as it does until its channel to a restarted scheduler is
    back; returns that client, its first queue event and the seconds it took."""
    t0 = time.monotonic()
    while True:
        client = await WsClient.open(url)
        first = await client.until("error", "session.queued", "session.queue_done")
        if first["type"] != "error":
            return client, first, time.monotonic() - t0
        assert first["error"]["code"] == "service_unavailable", first
        assert time.monotonic() - t0 < scaled(timeout_s), "the edge refuses every session"
        await client.close()
        await asyncio.sleep(0.05)


async def stream(client: WsClient) -> None:
    """Send a 1 s unit every 0.5 s, as a talking client does, until cancelled or closed."""
    while True:
        try:
            await client.append(SILENCE)
        except ConnectionClosed:
            return
        await asyncio.sleep(0.5)


@pytest.mark.ci_long  # a cut link, a killed scheduler and their recoveries: ~16 s
async def test_sessions_across_hosts_survive_a_cut_link_and_a_scheduler_restart(stack):
    """Each service on its own host address. (a) Sessions from the client host reach the
    workers through the edge host. (b) The link of the serving worker's host is cut
    mid-session: that client gets session.closed{error} within 5 s (F2), the scheduler
    drops the worker within 5 s, the other host's session goes on and a new one goes there.
    (c) The scheduler is SIGKILLed and restarted on its address: the running session goes
    on, the surviving worker registers again by itself with its lease (F4: its leased slot
    is not leased again, so with the cut host away one more client waits). (d) The link
    comes back: the cut worker registers again by itself and serves that waiting client."""
    net = stack.net
    scheduler = stack.scheduler()
    scheduler_metrics = scheduler.wait_ready()[1].removeprefix("metrics=")
    assert scheduler.ready_words[0] == f"{net.address('sched')}:{SCHEDULER_PORT}"
    workers = {host: stack.worker(host) for host in ("w1", "w2")}
    edge = stack.edge()
    for host, worker in workers.items():
        # The address the scheduler hands to edges is the worker host's own.
        assert worker.wait_ready()[:2] == [host, f"{net.address(host)}:{WORKER_PORT}"]
    url = f"{edge.wait_ready()[0]}?mode=audio"
    assert url.startswith(f"ws://{net.address('edge')}:{EDGE_PORT}/")

    with netns.entered(net.ns("client")):
        # (a) Sessions across hosts; the scheduler leases the worker with the most free
        # slots, so the second session lands on the other worker.
        a = await started(url)
        assert a.ws.local_address[0] == net.address("client")
        by_load = {host: sessions_on(w) for host, w in workers.items()}
        assert sorted(by_load.values()) == [0, 1], by_load
        cut = max(by_load, key=by_load.__getitem__)
        other = "w2" if cut == "w1" else "w1"
        b = await started(url)
        assert sessions_on(workers[other]) == 1 and sessions_on(workers[cut]) == 1

        # (b) Cut the serving worker host's link while its client streams.
        feeder = asyncio.create_task(stream(a))
        try:
            await a.until("delta.listen")
            await a.until("delta.listen")
            net.cut(cut)
            t_cut = time.monotonic()

            async def client_closed() -> tuple[dict, float]:
                event = await a.until("session.closed", timeout_s=10)
                return event, time.monotonic() - t_cut

            async def worker_dropped() -> bool:
                return cut not in registered(scheduler_metrics)

            (closed, closed_s), dropped_s = await asyncio.gather(
                client_closed(), wait_for(worker_dropped, 10)
            )
        finally:
            feeder.cancel()
        assert closed["reason"] == "error", closed
        assert closed_s < 5.0 and dropped_s < 5.0, (closed_s, dropped_s)
        # The other host's session was untouched; a new client goes to that host.
        await served_unit(b)
        assert not [ev for ev in b.events if ev["type"] in ("error", "session.closed")]
        c = await started(url)
        assert sessions_on(workers[other]) == 2
        await c.send({"type": "session.close"})
        assert (await c.until("session.closed"))["reason"] == "user_stop"
        print(
            f"\nmulti-host F2: link of {cut} cut; its client closed with error after "
            f"{closed_s:.2f} s, the scheduler dropped {cut} after {dropped_s:.2f} s"
        )

        # (c) Kill the scheduler; its host's address and port come back with a new one.
        async def c_returned() -> bool:
            return registered(scheduler_metrics).get(other) == 1

        await wait_for(c_returned, 5)  # only b's lease is left when the scheduler dies
        scheduler.kill(signal.SIGKILL)
        scheduler.proc.wait(scaled(5))
        t_kill = time.monotonic()
        await served_unit(b)  # running sessions go on without the scheduler
        restarted = stack.scheduler("scheduler-restarted")
        restarted.wait_ready()
        t_ready = time.monotonic()

        async def other_back() -> bool:
            return other in registered(scheduler_metrics)

        rereg_s = await wait_for(other_back, 10)
        # b's lease came back with its worker: one slot free, never two.
        assert registered(scheduler_metrics) == {other: 1}
        await served_unit(b)
        d, first, _ = await admitted(url)
        admitted_s = time.monotonic() - t_ready
        assert first["type"] == "session.queue_done", first
        await d.send(INIT)
        await d.until("session.created")
        await served_unit(d)
        assert sessions_on(workers[other]) == 2
        assert registered(scheduler_metrics) == {other: 0}
        # With the cut host away and the other full, one more client waits.
        e, first, _ = await admitted(url)
        assert first["type"] == "session.queued", first
        print(
            f"multi-host F4: scheduler down {t_ready - t_kill:.2f} s (kill to the new one's "
            f"ready line); {other} registered again {rereg_s:.2f} s and the edge took a new "
            f"session {admitted_s:.2f} s after that line"
        )

        # (d) The cut host comes back: its worker registers by itself and takes the
        # waiting client.
        net.restore(cut)
        t_restore = time.monotonic()
        await e.until("session.queue_done", timeout_s=30)
        back_s = time.monotonic() - t_restore
        assert cut in registered(scheduler_metrics)
        # The edge forgot its channel to the cut host when a's lease was lost (and retries
        # a start that fails in the transport on a fresh one): e starts at the first try.
        await e.send(INIT)
        await e.until("session.created")
        await served_unit(e)
        assert sessions_on(workers[cut]) >= 1

        # The session the cut worker held for a: its stream broke (the edge's reset once the
        # link is back, or the worker's keepalive during the cut), so it waited for a resume
        # (the edge's resume window; a's client was told `error` and asks for none), then
        # the worker freed it.
        async def stale_freed() -> bool:
            return sessions_on(workers[cut]) == 1

        await wait_for(stale_freed, 30, interval_s=0.2)
        freed_s = time.monotonic() - t_restore

        # b and d hold the other worker, e (or the client that retried for it) the cut one.
        async def leases_settled() -> bool:
            return registered(scheduler_metrics) == {other: 0, cut: 1}

        await wait_for(leases_settled, 10)
        await served_unit(b)
        await served_unit(d)
        print(
            f"multi-host: link of {cut} restored; it registered again and took the waiting "
            f"client after {back_s:.2f} s; a's stale session freed on it "
            f"{freed_s:.2f} s after the restore"
        )
