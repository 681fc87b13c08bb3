"""Resumable sessions through real processes: a scheduler, one worker, two edges. A
dropped connection (or a lost edge) leaves the session on its worker for the resume
window; the client resumes it on either edge with its token and the last seq it got,
misses nothing and gets nothing twice; the model's context goes on."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient, pcm_b64
from tests.stack import Stack

WINDOW_S = 4


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path)
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--resume-window", str(WINDOW_S), name="edge1")
    stack.url1 = stack.url
    stack.start_edge("--resume-window", str(WINDOW_S), name="edge2")
    yield stack
    stack.stop()


def seqs(events: list[dict]) -> list[int]:
    return [e["seq"] for e in events if "seq" in e]


def drop(client: WsClient) -> None:
    """Lose the connection without a close frame (a network that went away)."""
    client.ws.transport.abort()


async def unit(client: WsClient, samples) -> dict:
    """One unit, and the first event of its answer (units sent faster than the worker
    answers replace each other)."""
    await client.append(samples)
    return await client.until("response.output.delta")


async def speak(client: WsClient, n_speech: int = 2) -> None:
    for samples in [SPEECH] * n_speech + [SILENCE]:
        await unit(client, samples)


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
    await speak(b)
    second = await b.until("delta.text", timeout_s=20)
    text = "".join(e.get("text", "") for e in [*got_a, *b.events] if e.get("kind") == "text")
    assert "reply 1" in text and "reply 2" in second["text"]
    await b.send({"type": "session.close"})
    closed = await b.until("session.closed")
    everything = seqs(got_a) + seqs(b.events)
    assert everything == list(range(1, closed["seq"] + 1))  # no gap, nothing twice
    await b.close()
