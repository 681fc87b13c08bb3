"""`omnifabric edge --processes N`: N edge processes share one WebSocket and one gRPC port
(SO_REUSEPORT), drain together, are started again when one dies, and die with their
supervisor. Real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.common import grpc_io
from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, WsClient, wait_for
from tests.stack import Stack, start_service


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    s.start_scheduler()
    s.start_worker("--slots", "8", "--compute-ms", "5")
    yield s
    s.stop()


def status(url: str) -> dict:
    """GET /status on a new connection (each may land on another process)."""
    host_port = url.split("/")[2]
    with urllib.request.urlopen(f"http://{host_port}/status", timeout=scaled(5)) as reply:
        return json.loads(reply.read())


async def pids_answering(url: str, want: int, tries: int = 60) -> set[int]:
    """The edge pids seen over up to `tries` connections, stopping at `want` distinct."""
    seen: set[int] = set()
    for _ in range(tries):
        seen.add((await asyncio.to_thread(status, url))["edge"]["pid"])
        if len(seen) >= want:
            break
    return seen


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Not yet reaped: a killed multi-threaded process shows as a zombie while its other
    threads still hold its sockets, so only a reaped one is surely gone."""
    return os.path.exists(f"/proc/{pid}")


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=scaled(5))
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def port_free(port: int) -> bool:
    """Nothing listens on it (connections the edge closed may linger in TIME_WAIT)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_processes_share_the_ports_and_drain_together(stack):
    supervisor = stack.start_edge("--processes", "2")
    assert stack.edge.ready_words[2] == "processes=2"
    pids = await pids_answering(stack.url, 2)
    assert len(pids) == 2, pids  # the kernel spread the connections over both children
    assert all(parent_of(pid) == supervisor.proc.pid for pid in pids)
    # Each child chose gRPC's I/O layer before loading grpc (common/grpc_io.py).
    io = (await asyncio.to_thread(status, stack.url))["edge"]["grpc_io"]
    assert io == {"experiments": grpc_io.IOMGR_TCP, "chosen_before_grpc": True}
    assert await asyncio.to_thread(grpc_serving, stack.grpc_address)
    clients = []
    for _ in range(6):
        client = await WsClient.open(f"{stack.url}?mode=audio")
        await client.start()
        await client.append(SILENCE)
        await client.until("delta.listen", "delta.audio")
        clients.append(client)
    supervisor.kill(signal.SIGTERM)
    for client in clients:
        closed = await client.until("session.closed", timeout_s=10)
        assert closed["reason"] == "server_shutdown"
    assert await asyncio.to_thread(supervisor.proc.wait, scaled(20)) == 0
    await wait_for(lambda: asyncio.sleep(0, not any(map(alive, pids))), 10)
    assert port_free(int(stack.url.split("/")[2].rsplit(":", 1)[1]))


async def test_a_killed_process_is_started_again(stack):
    supervisor = stack.start_edge("--processes", "2")
    pids = await pids_answering(stack.url, 2)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    # Once it is gone (connections still in its accept queue as it dies are reset: the
    # kernel does not move them), the other process serves every new connection.
    await wait_for(lambda: asyncio.sleep(0, not alive(victim)), 5)
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen", "delta.audio")

    async def replaced() -> bool:
        children = await pids_answering(stack.url, 2, tries=10)
        return len(children - pids) == 1 and victim not in children

    await wait_for(replaced, 20, interval_s=0.5)
    log = supervisor.log_path.read_text()
    assert "omnifabric edge: edge-" in log and "(-9); starting it again in 1 s" in log
    assert supervisor.proc.poll() is None


async def test_children_end_with_a_killed_supervisor(stack):
    supervisor = stack.start_edge("--processes", "2")
    pids = await pids_answering(stack.url, 2)
    port = int(stack.url.split("/")[2].rsplit(":", 1)[1])
    supervisor.kill(signal.SIGKILL)
    supervisor.proc.wait()
    # The kernel's parent-death signal makes each child drain and exit: the port is free.
    await wait_for(lambda: asyncio.sleep(0, not any(map(alive, pids))), 20)
    assert port_free(port)


async def test_a_lone_edge_refuses_a_taken_port(stack, tmp_path):
    stack.start_edge()
    port = stack.url.split("/")[2].rsplit(":", 1)[1]
    grpc_port = stack.grpc_address.rsplit(":", 1)[1]
    taken = (["--port", port, "--grpc-port", "0"], ["--port", "0", "--grpc-port", grpc_port])
    for i, args in enumerate(taken):
        args = [*args, "--scheduler", stack.scheduler_address]
        second = start_service(f"second-edge{i}", "omnifabric.edge", args, tmp_path)
        code = await asyncio.to_thread(second.proc.wait, scaled(30))
        assert code != 0, args
        assert "in use" in second.log().lower() or "bind" in second.log().lower(), second.log()
