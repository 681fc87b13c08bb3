"""Queueing, limits and faults across real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omnifabric.common.close_reasons import INFERENCE_ERROR, SERVER_SHUTDOWN, close_message
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient, wait_for
from tests.e2e.wsclient import post_json as _post
from tests.stack import read_until_line, start_serve, stop_serve


async def scheduler_status(address: str) -> scheduler_pb.GetStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        return await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))


async def test_queue_positions_eta_then_served(stack):
    stack.start_scheduler("--queue-update-interval", "0.5")
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    holder = await WsClient.open(url)
    await holder.start()
    waiting = [await WsClient.open(url) for _ in range(3)]
    firsts = [await w.until("session.queued") for w in waiting]
    assert [f["position"] for f in firsts] == [1, 2, 3]
    assert all(
        f["estimated_wait_s"] > 0 and f["ticket_id"] and f["queue_length"] >= 1 for f in firsts
    )
    # Periodic updates arrive while nothing moves (interval 0.5 s).
    update = await waiting[2].until("session.queue_update", timeout_s=3)
    assert update["position"] == 3
    await holder.send({"type": "session.close"})
    await holder.until("session.closed")
    created = await waiting[0].start()
    assert created["type"] == "session.created"
    moved = await waiting[2].until("session.queue_update")
    assert moved["position"] == 2
    positions = [e["position"] for e in waiting[2].events if e["type"].startswith("session.queue")]
    assert positions == sorted(positions, reverse=True)
    for client in waiting:
        await client.close()


async def test_service_unavailable_without_workers(stack):
    stack.start_scheduler()
    stack.start_edge()
    client = await WsClient.open(f"{stack.url}?mode=audio")
    err = await client.until("error")
    assert err["error"]["code"] == "service_unavailable"
    with pytest.raises(ConnectionClosed) as info:
        await client.recv()
    assert info.value.rcvd.code == 1013


async def test_api_key_401_before_upgrade(stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-good-one\n")
    stack.start_scheduler()
    stack.start_worker("--slots", "1")
    stack.start_edge("--api-keys-file", str(keys))
    url = f"{stack.url}?mode=audio"
    for headers in (
        None,
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": "Basic sk-good-one"},
    ):
        with pytest.raises(InvalidStatus) as info:
            await WsClient.open(url, additional_headers=headers)
        assert info.value.response.status_code == 401
    client = await WsClient.open(url, additional_headers={"Authorization": "Bearer sk-good-one"})
    await client.start()
    await client.close()
    # POST /api/chat on the same port checks the same keys.
    api = stack.url.replace("ws://", "http://").replace("/v1/realtime", "/api/chat")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _ = await asyncio.to_thread(_post, api, body)
    assert status == 401
    status, answer = await asyncio.to_thread(
        _post, api, body, {"Authorization": "Bearer sk-good-one"}
    )
    assert status == 200 and answer["text"] == "You said: hi"
    assert "sk-good-one" not in stack.edge.log() and "sk-wrong" not in stack.edge.log()


async def test_worker_killed_mid_session(stack):
    stack.start_scheduler()
    first = stack.start_worker("--slots", "1", "--compute-ms", "5", name="wa")
    stack.start_worker("--slots", "1", "--compute-ms", "5", name="wb")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    a = await WsClient.open(url)
    await a.start()
    b = await WsClient.open(url)
    await b.start()
    status = await scheduler_status(stack.scheduler_address)
    victim_name = first.name
    assert {w.worker_id for w in status.workers} == {"wa", "wb"}
    for client in (a, b):
        await client.append(SILENCE)
        await client.until("delta.listen")
    # Which client is on the victim: the scheduler knows.
    on_victim = {lid for w in status.workers if w.worker_id == victim_name for lid in w.lease_ids}
    assert len(on_victim) == 1
    first.kill(signal.SIGKILL)
    t0 = time.monotonic()
    closed_clients = []

    async def closed_within(client):
        try:
            event = await client.until("session.closed", timeout_s=2)
            closed_clients.append((client, event, time.monotonic() - t0))
        except (TimeoutError, ConnectionClosed):
            pass

    await asyncio.gather(closed_within(a), closed_within(b))
    assert len(closed_clients) == 1, "exactly the victim's client is closed"
    survivor = b if closed_clients[0][0] is a else a
    _, event, took = closed_clients[0]
    assert event["reason"] == "error" and took < 2.0
    # The other session is untouched.
    await survivor.append(SPEECH)
    await survivor.until("delta.listen", "delta.audio")
    # The next client is served by the surviving worker once its slot frees.
    await survivor.send({"type": "session.close"})
    await survivor.until("session.closed")
    nxt = await WsClient.open(url)
    await nxt.start()
    await nxt.append(SILENCE)
    await nxt.until("delta.listen")
    status = await scheduler_status(stack.scheduler_address)
    assert [w.worker_id for w in status.workers] == ["wb"]


@pytest.mark.parametrize("window_s", [0, 2])
async def test_edge_killed_returns_lease(stack, window_s):
    """A killed edge's sessions: back at once without a resume window; with one, held for
    a resume on another edge (the slot stays taken), then freed when it passes."""
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    edge = stack.start_edge("--resume-window", str(window_s))
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen")
    status = await scheduler_status(stack.scheduler_address)
    assert status.leases_active == 1 and status.workers[0].slots_free == 0
    edge.kill(signal.SIGKILL)
    t0 = time.monotonic()

    async def lease_back():
        s = await scheduler_status(stack.scheduler_address)
        return s.workers[0].slots_free == 1

    if window_s:
        await asyncio.sleep(window_s / 2)
        assert not await lease_back()  # waiting for a resume
    took = await wait_for(lease_back, window_s + 2.0)
    assert time.monotonic() - t0 < window_s + 2.0, took
    s = await scheduler_status(stack.scheduler_address)
    assert s.leases_active == 0


def test_serve_then_probe(tmp_path):
    """`omnifabric serve --engine synthetic` (its edge as two processes) then `omnifabric
    probe` prints the exchange; Ctrl-C stops everything (the edge's port is free)."""
    import wave

    import numpy as np

    wav = tmp_path / "in.wav"
    audio = np.concatenate(
        [np.zeros(3 * 16000), 0.3 * np.sin(np.arange(32000) / 5), np.zeros(16000)]
    )
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    serve = start_serve("--engine", "synthetic", "--workers", "2", "--edge-processes", "2")
    try:
        url = read_until_line(serve, "omnifabric ready: ").split()[-1]
        web = serve.stdout.readline()
        assert web.startswith("omnifabric web client: http://"), web
        import urllib.request

        with urllib.request.urlopen(web.split()[-1], timeout=scaled(10)) as page:
            assert page.status == 200 and b"/audio" in page.read()
        out = tmp_path / "out.wav"
        probe = subprocess.run(
            [
                sys.executable,
                "-m",
                "omnifabric.tools.cli",
                "probe",
                "--url",
                url,
                "--mode",
                "audio",
                "--input",
                str(wav),
                "--output",
                str(out),
                "--fast",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "listen" in probe.stdout and "text" in probe.stdout
        assert "lost 0" in probe.stdout
        with wave.open(str(out)) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 24000
    finally:
        rest = stop_serve(serve, scaled(30))
    assert serve.returncode == 0, rest
    assert "omnifabric stopped" in rest
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(url.split("/")[2].rsplit(":", 1)[1])))  # nothing listens


async def test_inference_error_then_closed_and_worker_keeps_serving(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5", "--fail-unit", "2")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    client = await WsClient.open(url)
    await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen")
    await client.append(SILENCE)
    err = await client.until("error")
    assert err["error"] == {
        "code": "inference_error",
        "message": close_message(INFERENCE_ERROR),
        "type": "server_error",
    }
    closed = await client.until("session.closed")
    assert closed["reason"] == "error" and closed["message"] == close_message(INFERENCE_ERROR)
    # The worker stays healthy: the next session is served (and fails at its unit 2 again).
    again = await WsClient.open(url)
    await again.start()
    await again.append(SILENCE)
    assert (await again.until("delta.listen"))["metrics"]["seq"] == 1


async def test_duration_limit_closes_with_timeout(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5", "--audio-limit-s", "1.5")
    stack.start_edge()
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    t0 = time.monotonic()
    await client.append(SILENCE)
    closed = await client.until("session.closed", timeout_s=5)
    assert closed["reason"] == "timeout"
    assert 1.0 < time.monotonic() - t0 < scaled(3.0)
    assert sum(e["type"] == "session.closed" for e in client.events) == 1


async def test_edge_sigterm_closes_sessions_with_server_shutdown(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    edge = stack.start_edge()
    current = await WsClient.open(f"{stack.url}?mode=audio")
    await current.start("current")
    first = await WsClient.open(f"{stack.url}?mode=audio")
    await first.start("first")
    edge.kill(signal.SIGTERM)
    for client in (current, first):
        closed = await client.until("session.closed", timeout_s=5)
        assert closed["reason"] == "server_shutdown"
        # Worded as what happened (issue 36), not as a close of the client's.
        assert closed["message"] == close_message(SERVER_SHUTDOWN)
        assert "shutting down" in closed["message"] and "client" not in closed["message"]
    assert edge.proc.wait(timeout=scaled(10)) == 0


@pytest.mark.ci_long  # waits out the hang's detection: ~8 s (tests/conftest.py)
async def test_hung_worker_detected_within_5s(stack):
    """F2: SIGSTOP a worker mid-session: the scheduler drops the worker (it stops
    reporting) and its client is closed with error within 5 s (the lease ends; the edge's
    unit watchdog would only come at 6 s), and the next client is served by the other
    worker."""
    stack.start_scheduler()
    victim = stack.start_worker("--slots", "1", "--compute-ms", "5", name="hung")
    stack.start_worker("--slots", "1", "--compute-ms", "5", name="healthy")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    # Fill both slots, then find the session on the victim.
    a, b = await WsClient.open(url), await WsClient.open(url)
    await a.start()
    await b.start()
    status = await scheduler_status(stack.scheduler_address)
    hung_leases = {lid for w in status.workers if w.worker_id == "hung" for lid in w.lease_ids}
    assert len(hung_leases) == 1
    victim.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        closed = {}

        async def feed(client, name):
            # A client keeps streaming 1 unit per 0.5 s until its session ends (~7 s).
            for _ in range(12):
                try:
                    await client.append(SILENCE)
                    event = await client.until("delta.listen", "session.closed", timeout_s=1.5)
                except (TimeoutError, ConnectionClosed):
                    continue
                if event["type"] == "session.closed":
                    closed[name] = (event, time.monotonic() - t0)
                    return
                await asyncio.sleep(0.5)

        drop_time = []

        async def watch_drop():
            async def dropped():
                s = await scheduler_status(stack.scheduler_address)
                return "hung" not in {w.worker_id for w in s.workers}

            await wait_for(dropped, 8.0)
            drop_time.append(time.monotonic() - t0)

        await asyncio.gather(feed(a, "a"), feed(b, "b"), watch_drop())
        assert len(closed) == 1, closed  # only the hung worker's client
        [(event, took)] = closed.values()
        assert event["reason"] == "error" and took < 5.0, took
        print(
            f"hung worker: client closed after {took:.2f}s, dropped by the scheduler "
            f"after {drop_time[0]:.2f}s"
        )
        assert drop_time[0] < 5.0
        # The next client is served by the healthy worker once the survivor's client leaves.
        survivor = b if "a" in closed else a
        await survivor.send({"type": "session.close"})
        await survivor.until("session.closed")
        nxt = await WsClient.open(url)
        await nxt.start()
        await nxt.append(SILENCE)
        await nxt.until("delta.listen")
    finally:
        victim.kill(signal.SIGCONT)
        victim.kill(signal.SIGKILL)


@pytest.mark.ci_long  # waits out a slow unit's deadline: ~8 s (tests/conftest.py)
async def test_a_slow_unit_is_judged_by_its_worker_not_the_edge(stack, monkeypatch):
    """The edge's unit watchdog never ends a session before the worker's own engine
    timeout could: the worker says its timeout in SessionStarted, and the edge waits past
    it. Here units take 1.5 s on a worker that allows 3 s, behind an edge told to give up
    after 0.5 s: every unit is answered and the session stays open."""
    monkeypatch.setenv("OMNI_EDGE_UNIT_TIMEOUT_S", "0.5")
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "1500", "--unit-timeout", "3")
    stack.start_edge()
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        await client.append(SILENCE)
        event = await client.until("delta.listen", "session.closed", timeout_s=10)
        took.append(time.monotonic() - t0)
        assert event["type"] != "session.closed", event
    print(f"slow units answered after {', '.join(f'{t:.2f}' for t in took)} s (edge 0.5 s)")
    assert min(took) > 1.0  # the units really outlasted the edge's own setting
    await client.send({"type": "session.close"})
    closed = await client.until("session.closed")
    assert closed["reason"] != "error", closed


async def test_origin_allow_list(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    stack.start_edge("--allowed-origin", "https://app.example")
    url = f"{stack.url}?mode=audio"
    with pytest.raises(InvalidStatus) as info:
        await WsClient.open(url, origin="https://evil.example")
    assert info.value.response.status_code == 403
    browser = await WsClient.open(url, origin="https://app.example")
    await browser.until("session.queue_done")
    await browser.close()
    script = await WsClient.open(url)  # no Origin header: SDKs and scripts
    await script.until("session.queue_done")
