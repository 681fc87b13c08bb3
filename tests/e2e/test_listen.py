"""The fabric's servers on an IPv6 address, and a port in use said in one line (common.listen)."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from urllib.parse import urlsplit

import grpc
import pytest

from tests.conftest import ROOT, needs_ipv6, scaled
from tests.e2e.wsclient import SILENCE, WsClient
from tests.stack import read_until_line, start_serve, stop_serve


@needs_ipv6
async def test_a_fabric_on_ipv6_loopback_serves_a_session(stack):
    # Each server listens on ::1 and says where in a dialable form ("[::1]:port").
    stack.start_scheduler("--host", "::1")
    assert stack.scheduler_address.startswith("[::1]:")
    worker = stack.start_worker("--host", "::1", "--slots", "1", "--compute-ms", "5")
    assert worker.ready_words[1].startswith("[::1]:")  # its advertised address
    stack.start_edge("--host", "::1")
    assert stack.url.startswith("ws://[::1]:") and stack.grpc_address.startswith("[::1]:")
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    await client.append(SILENCE)
    assert (await client.until("delta.listen"))["metrics"]["seq"] == 1
    await client.close()


@needs_ipv6
@pytest.mark.parametrize("edge_processes", ["1", "2"])
async def test_serve_on_the_ipv6_wildcard_answers_both_families_where_it_says(edge_processes):
    # "::" is every interface, IPv4 too, on the edge's WebSocket port as on gRPC's (asyncio
    # alone binds it IPv6 only), and the web client's line names a loopback that answers.
    serve = start_serve("--engine", "synthetic", "--host", "::", "--edge-processes", edge_processes)
    try:
        url = read_until_line(serve, "omnifabric ready: ").split()[-1]
        web = serve.stdout.readline().split()[-1]
        port = urlsplit(url).port
        assert web == f"http://[::1]:{port}/"
        for page in (web, f"http://127.0.0.1:{port}/"):
            with urllib.request.urlopen(page, timeout=scaled(10)) as answer:
                assert answer.status == 200 and b"/audio" in answer.read()
        client = await WsClient.open(f"ws://127.0.0.1:{port}/v1/realtime?mode=audio")
        await client.start()
        await client.append(SILENCE)
        assert (await client.until("delta.listen"))["metrics"]["seq"] == 1
        await client.close()
        # The RealtimeService's address, said once the stack is up, answers.
        grpc_address = read_until_line(serve, "omnifabric grpc: ").split()[-1]
        assert grpc_address.startswith("[::1]:")
        with grpc.insecure_channel(grpc_address) as channel:
            grpc.channel_ready_future(channel).result(timeout=scaled(10))
    finally:
        stop_serve(serve, scaled(60))


@pytest.mark.parametrize(
    ("processes", "taken_flag"),
    [("1", "--port"), ("1", "--grpc-port"), ("2", "--grpc-port")],  # 2: a supervisor reserves
)
def test_an_edge_whose_port_is_in_use_says_so_in_one_line(processes, taken_flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--grpc-port": "0", taken_flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "omnifabric.edge", *(w for kv in ports.items() for w in kv)]
            + ["--scheduler", "127.0.0.1:1", "--processes", processes],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("omnifabric edge:")]
    assert len(said) == 1 and said[0].startswith(
        f"omnifabric edge: cannot listen on 127.0.0.1:{port}: "
    )
    assert "in use" in said[0]
    assert "Traceback" not in done.stderr + done.stdout
