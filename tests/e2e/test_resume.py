"""Resumable sessions through real processes: a scheduler, one worker, two edges. A
dropped connection (or a lost edge) leaves the session on its worker for the resume
window; the client resumes it on either edge with its token and the last seq it got,
misses nothing and gets nothing twice; the model's context goes on."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient, metric, scrape_metrics, wait_for
from tests.stack import Stack

WINDOW_S = 4


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path)
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--resume-window", str(WINDOW_S), name="edge1")
    stack.url1, stack.grpc1 = stack.url, stack.grpc_address
    stack.start_edge("--resume-window", str(WINDOW_S), name="edge2")
    yield stack
    stack.stop()


def seqs(events: list[dict]) -> list[int]:
    return [e["seq"] for e in events if "seq" in e]


def drop(client: WsClient) -> None:
    """Lose the connection without a close frame (a network that went away)."""
    client.ws.transport.abort()


async def unit(client: WsClient, samples) -> dict:
    """One unit, and the first event of its own answer. The deltas still coming for
    earlier units (a speaking unit's text and audio) are read past: returning at the
    first of them let the client run ahead of the worker, whose newest-wins mailbox then
    dropped units the test counted on (CI under load lost a reply that way)."""
    answered = {e.get("input_id") for e in client.events}
    await client.append(samples)
    while True:
        event = await client.until("response.output.delta")
        if event.get("input_id") not in answered:
            return event


async def speak(client: WsClient, n_speech: int = 2) -> dict:
    """Speech, then silence until the model replies: the reply's first text delta."""
    for _ in range(n_speech):
        await unit(client, SPEECH)
    for _ in range(3):
        event = await unit(client, SILENCE)
        if event["kind"] == "text":
            return event
    raise AssertionError(f"no reply after {n_speech} units of speech: {event}")


async def test_drop_mid_reply_and_resume_on_the_other_edge(stack):
    a = await WsClient.open(f"{stack.url1}?mode=audio")
    created = await a.start()
    token, window = created["resume_token"], created["resume_window_s"]
    assert len(token) >= 40 and window == WINDOW_S and created["seq"] == 1
    await speak(a)
    while True:  # until the model is replying
        event = await unit(a, SILENCE)
        if event["kind"] != "listen":
            break
    await a.append(SILENCE)  # its answer is on the way when the connection drops
    got_a = list(a.events)
    drop(a)
    # Meanwhile the worker goes on with what it had; the client comes back elsewhere.
    last = max(seqs(got_a))
    b = await WsClient.open(f"{stack.url}?mode=audio&resume_token={token}&last_seq={last}")
    resumed = await b.recv()
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["session_id"] == created["session_id"] and resumed["last_seq"] == last
    replayed = [await b.recv() for _ in range(resumed["replayed"])]
    assert replayed  # the answer to the unit sent just before the drop
    assert seqs(replayed) == list(range(last + 1, last + 1 + len(replayed)))
    # The session goes on: the turn ends, a second question gets the second reply.
    for _ in range(4):
        await unit(b, SILENCE)
    second = await speak(b)
    text = "".join(e.get("text", "") for e in [*got_a, *b.events] if e.get("kind") == "text")
    assert "reply 1" in text and "reply 2" in second["text"]
    await b.send({"type": "session.close"})
    closed = await b.until("session.closed")
    everything = seqs(got_a) + seqs(b.events)
    assert everything == list(range(1, closed["seq"] + 1))  # no gap, nothing twice
    await b.close()


def status(url: str) -> dict:
    from tests.e2e.test_default_voice import http_url
    from tests.edge.test_voices import request

    code, body = request(http_url(url, "/status"), "GET")
    assert code == 200, body
    return body


async def status_where(url: str, holds: Callable[[dict], bool], timeout_s: float) -> dict:
    """The edge's /status once `holds` is true of it (polled); AssertionError with the last
    one after timeout_s (scaled)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while not holds(body := await asyncio.to_thread(status, url)):
        assert loop.time() < deadline, f"not within {scaled(timeout_s)} s: {body}"
        await asyncio.sleep(0.05)
    return body


async def refused(url: str) -> tuple[dict, int]:
    """The error event and the close code a refused resume ends with."""
    async with connect(url, open_timeout=scaled(10)) as ws:
        error = json.loads(await asyncio.wait_for(ws.recv(), scaled(10)))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), scaled(10))
        return error, ws.close_code


async def test_the_edge_is_killed_and_the_session_goes_on_elsewhere(stack):
    a = await WsClient.open(f"{stack.url1}?mode=audio")
    created = await a.start()
    await speak(a)
    await unit(a, SILENCE)
    edge1 = next(s for s in stack.services if s.name == "edge1")
    edge1.kill(signal.SIGKILL)
    edge1.proc.wait()
    last = max(seqs(a.events))
    url = f"{stack.url}?mode=audio&resume_token={created['resume_token']}&last_seq={last}"
    b = await WsClient.open(url)
    resumed = await b.until("session.resumed")
    replayed = [await b.recv() for _ in range(resumed["replayed"])]
    assert seqs(replayed) == list(range(last + 1, last + 1 + len(replayed)))
    for _ in range(4):
        await unit(b, SILENCE)
    assert "reply 2" in (await speak(b))["text"]
    await b.send({"type": "session.close"})
    closed = await b.until("session.closed")
    assert seqs(a.events) + seqs(b.events) == list(range(1, closed["seq"] + 1))
    text = "".join(e.get("text", "") for e in [*a.events, *b.events] if e.get("kind") == "text")
    assert "reply 1" in text and "reply 2" in text


async def test_refusals_expiry_and_superseding(stack):
    # A resume while the first connection still holds the session supersedes it.
    a = await WsClient.open(f"{stack.url1}?mode=audio")
    created = await a.start()
    token = created["resume_token"]
    await unit(a, SILENCE)
    b = await WsClient.open(f"{stack.url}?mode=audio&resume_token={token}&last_seq=2")
    resumed = await b.until("session.resumed")
    assert resumed["replayed"] == 0
    gone = await a.until("session.closed")
    assert gone["reason"] == "superseded"
    event = await unit(b, SILENCE)
    assert event["seq"] == 3
    # Forged, malformed and expired tokens; a session closed on purpose cannot come back.
    error, code = await refused(f"{stack.url}?mode=audio&resume_token=forged&last_seq=0")
    assert error["error"]["code"] == "resume_unknown" and code == 1008
    error, code = await refused(f"{stack.url}?mode=audio&resume_token={token}&last_seq=x")
    assert error["error"]["code"] == "invalid_payload" and code == 1008
    dropped = time.monotonic()
    drop(b)
    # Held for the resume once the edge has noticed the lost connection: the lease detached,
    # its slot still taken (polled well inside the window, which starts after the drop).
    held = await status_where(stack.url, lambda s: s["leases_detached"] != 0, WINDOW_S / 2)
    assert held["slots"]["free"] == 1 and held["leases_detached"] == 1  # held for the resume
    # The window passes: the worker lets the session go and the scheduler frees the slot.
    # Polled; not before the window (counted from after the drop) has passed.
    freed = await status_where(stack.url, lambda s: s["slots"]["free"] == 2, WINDOW_S + 5)
    held_s = time.monotonic() - dropped
    assert freed["slots"]["free"] == 2 and freed["leases_detached"] == 0  # the window passed
    assert held_s >= WINDOW_S - 0.5, f"freed {held_s:.2f} s after the drop"
    error, code = await refused(f"{stack.url1}?mode=audio&resume_token={token}&last_seq=3")
    assert error["error"]["code"] == "resume_expired" and code == 1008
    c = await WsClient.open(f"{stack.url}?mode=audio")
    token = (await c.start())["resume_token"]
    await c.send({"type": "session.close"})
    await c.until("session.closed")
    error, _ = await refused(f"{stack.url}?mode=audio&resume_token={token}&last_seq=1")
    assert error["error"]["code"] == "resume_unknown"
    # A client that closes its WebSocket (a close frame) without session.close has left:
    # its slot comes back at once.
    d = await WsClient.open(f"{stack.url}?mode=audio")
    await d.start()
    closed_at = time.monotonic()
    await d.close()
    await status_where(stack.url, lambda s: s["slots"]["free"] == 2, WINDOW_S / 2)
    back_s = time.monotonic() - closed_at
    # Not kept for a resume, which would hold it for the window.
    assert back_s < WINDOW_S - 1, f"slot back {back_s:.2f} s after the close"
    print(
        f"resume: slot held {held_s:.2f} s after a drop (window {WINDOW_S} s), back "
        f"{back_s:.2f} s after a close frame"
    )


async def test_a_token_is_bound_to_its_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-one\nkey-two\n")
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "1", "--compute-ms", "5")
        stack.start_edge("--api-keys-file", str(keys), "--resume-window", "5")
        one = {"Authorization": "Bearer key-one"}
        two = {"Authorization": "Bearer key-two"}
        a = await WsClient.open(f"{stack.url}?mode=audio", additional_headers=one)
        token = (await a.start())["resume_token"]
        drop(a)
        url = f"{stack.url}?mode=audio&resume_token={token}&last_seq=1"
        async with connect(url, additional_headers=two, open_timeout=scaled(10)) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), scaled(10)))
        assert error["error"]["code"] == "resume_forbidden"
        b = await WsClient.open(url, additional_headers=one)
        assert (await b.until("session.resumed"))["replayed"] == 0
        await b.send({"type": "session.close"})
        await b.until("session.closed")
    finally:
        stack.stop()


async def test_the_client_resumes_by_itself_and_resends_what_was_lost(stack):
    from omnifabric.tools.client import run_session

    units = [SPEECH, SPEECH, SILENCE, SILENCE, SILENCE, SPEECH, SILENCE, SILENCE, SILENCE]
    report = await run_session(f"{stack.url}?mode=audio", units, pace_s=0, drop_after=4)
    assert report.error is None and report.closed_reason == "user_stop"
    assert len(report.resumes_s) == 1 and report.resumes_s[0] < 2
    assert report.seq_faults() == (0, 0)  # no event missed, none twice
    assert report.lost_units() == [] and sorted(report.units) == list(range(1, 10))
    text = "".join(u.text for u in report.units.values())
    assert "reply 1" in text


async def test_a_grpc_call_resumes_on_the_other_edge(stack):
    import grpc

    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
    from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

    def append(samples) -> rt_pb.ConnectRequest:
        return rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=samples.astype("<f4").tobytes()))

    async def read(call) -> rt_pb.ConnectResponse:
        return await asyncio.wait_for(call.read(), scaled(10))

    first = grpc.aio.insecure_channel(stack.grpc1)
    call = rt_grpc.RealtimeServiceStub(first).Connect()
    await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
    while (response := await read(call)).WhichOneof("kind") != "created":
        assert response.event_seq == 0  # queue events are not numbered
    created = response.created
    assert response.event_seq == 1 and created.resume_token and created.resume_window_s == 4
    got = [1]
    for samples in (SPEECH, SPEECH, SILENCE):
        await call.write(append(samples))
        got.append((await read(call)).event_seq)
    call.cancel()  # the call is lost: the session waits for a resume
    await first.close()

    second = grpc.aio.insecure_channel(stack.grpc_address)
    call = rt_grpc.RealtimeServiceStub(second).Connect()
    resume = rt_pb.SessionResumeRequest(
        mode=common_pb2.MODE_AUDIO, resume_token=created.resume_token, last_seq=got[-1] - 1
    )
    await call.write(rt_pb.ConnectRequest(resume=resume))
    resumed = (await read(call)).resumed
    assert resumed.session_id == created.session_id and resumed.replayed == 1
    assert resumed.last_input_seq == 3
    replayed = await read(call)
    assert replayed.event_seq == got[-1] and replayed.output.seq == 3  # sent again
    await call.write(append(SILENCE))
    live = await read(call)
    assert live.event_seq == got[-1] + 1 and live.output.seq == 4
    await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest()))
    while (response := await read(call)).WhichOneof("kind") != "closed":
        pass
    await second.close()

    # A forged token ends the call with NOT_FOUND.
    third = grpc.aio.insecure_channel(stack.grpc_address)
    call = rt_grpc.RealtimeServiceStub(third).Connect()
    forged = rt_pb.SessionResumeRequest(mode=common_pb2.MODE_AUDIO, resume_token="forged")
    await call.write(rt_pb.ConnectRequest(resume=forged))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read(call)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "resume_unknown" in info.value.details()
    await third.close()


async def test_a_grpc_call_cancelled_while_answers_wait_is_kept(stack):
    """A call cancelled while the edge is writing it an answer (the client reads nothing,
    so the answers wait on gRPC's flow control) leaves the session resumable: gRPC then
    closes the edge's response generator at its yield instead of cancelling it."""
    import grpc

    from omnifabric.omni.realtime.v1 import common_pb2
    from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
    from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

    first = grpc.aio.insecure_channel(stack.grpc1)
    call = rt_grpc.RealtimeServiceStub(first).Connect()
    await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
    while (response := await asyncio.wait_for(call.read(), scaled(10))).WhichOneof(
        "kind"
    ) != "created":
        pass
    created = response.created
    audio = SPEECH.astype("<f4").tobytes()
    worker_metrics = stack.workers[0].metrics_address()

    def answered(n: int) -> Callable:
        async def check() -> bool:
            samples = await asyncio.to_thread(scrape_metrics, worker_metrics)
            return metric(samples, "omni_worker_units_total") >= n

        return check

    for n in range(1, 7):  # ~100 KB of answer audio each: more than the call's window
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=audio)))
        # Answered by the worker before the next is sent (a unit still waiting would be
        # replaced by the newer one); the client reads nothing, so the answers wait at the
        # edge.
        await wait_for(answered(n), 10)
    call.cancel()
    await first.close()

    second = grpc.aio.insecure_channel(stack.grpc_address)
    call = rt_grpc.RealtimeServiceStub(second).Connect()
    resume = rt_pb.SessionResumeRequest(
        mode=common_pb2.MODE_AUDIO, resume_token=created.resume_token, last_seq=1
    )
    await call.write(rt_pb.ConnectRequest(resume=resume))
    resumed = (await asyncio.wait_for(call.read(), scaled(10))).resumed
    assert resumed.session_id == created.session_id and resumed.last_input_seq == 6
    assert resumed.replayed == 6
    got = [await asyncio.wait_for(call.read(), scaled(10)) for _ in range(6)]
    assert [(r.event_seq, r.output.seq) for r in got] == [(n + 1, n) for n in range(1, 7)]
    await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest()))
    await second.close()
