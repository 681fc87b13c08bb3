"""Sessions as long as people talk: context windows instead of context_full, no duration
limit, and the minute's warning before a limit. Real scheduler, synthetic workers and edge
processes on 127.0.0.1, real clients."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from websockets.exceptions import ConnectionClosed

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc
from omnifabric.worker.engines.synthetic import LISTEN_UNIT_TOKENS, PROMPT_OVERHEAD_TOKENS
from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient
from tests.stack import Stack

#: A context cap small enough that ~40 units fill it (synthetic: 13 tokens a listening unit).
CAP = 512


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A worker with a small context cap whose operator's window is off: sessions close
    with context_full there unless they choose a window."""
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "2", "--compute-ms", "2", "--max-context-tokens", str(CAP))
        s.start_edge()
        yield s
    finally:
        s.stop()


async def run_units(client: WsClient, count: int) -> list[dict]:
    """Units sent as fast as answered; the answers (or the session's end)."""
    answers = []
    for i in range(count):
        await client.append(SPEECH if i % 10 == 3 else SILENCE)
        event = await client.until("delta.listen", "delta.audio", "session.closed")
        answers.append(event)
        if event["type"] == "session.closed":
            break
    return answers


async def open_session(stack, config: dict) -> WsClient:
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.until("session.queue_done", timeout_s=30)
    await client.send(
        {"type": "session.init", "payload": {"system_prompt": "hi", "config": config}}
    )
    return client


async def test_without_a_window_a_full_context_ends_the_session(stack):
    client = await open_session(stack, {})
    await client.until("session.created")
    answers = await run_units(client, 80)
    assert answers[-1]["type"] == "session.closed"
    assert answers[-1]["reason"] == "context_full"
    assert len(answers) < 60


@pytest.mark.parametrize(
    "config",
    [
        {"context_window": "basic", "window_high_tokens": 300, "window_low_tokens": 200},
        {"context_window": "context", "window_units": 12, "window_previous_tokens": 20},
    ],
    ids=["basic", "context"],
)
async def test_a_session_with_a_window_slides_and_never_fills(stack, config):
    client = await open_session(stack, config)
    await client.until("session.created")
    answers = await run_units(client, 120)
    assert all(a["type"] != "session.closed" for a in answers), answers[-1]
    lengths = [a["metrics"]["kv_cache_length"] for a in answers]
    assert max(lengths) < CAP
    if config["context_window"] == "basic":
        assert max(lengths) <= 300 + 20 and min(lengths[60:]) >= 200 - 20
    else:  # 12 units at most, and what was said carried
        assert max(lengths) <= PROMPT_OVERHEAD_TOKENS + 12 * 20 + 20 + 1
    drops = sum(1 for a, b in zip(lengths, lengths[1:], strict=False) if b < a)
    assert drops >= 3  # it slid again and again
    # Usage stays cumulative across slides.
    audio = [a for a in answers if a["kind"] == "audio"]
    assert audio and audio[-1]["usage"]["input_tokens"] > CAP // LISTEN_UNIT_TOKENS
    await client.send({"type": "session.close"})
    await client.until("session.closed")


async def test_a_window_that_cannot_fit_the_context_is_refused_by_name(stack):
    client = await open_session(
        stack, {"context_window": "basic", "window_high_tokens": CAP, "window_low_tokens": 100}
    )
    error = await client.until("error", "session.created")
    assert error["type"] == "error" and "window_high_tokens" in error["error"]["message"]
    # The client's mistake, not the server's: it was worker_connect_failed and close 1013
    # ("try again later"), which the SDK and the browsers retry.
    assert (error["error"]["code"], error["error"]["type"]) == ("invalid_payload", "client_error")
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await client.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A worker whose audio sessions end after 2 s (warned at once: under a minute left),
    and one without a limit."""
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "2", "--compute-ms", "2", "--audio-limit-s", "2")
        s.start_edge()
        yield s
    finally:
        s.stop()


async def test_the_client_is_told_before_the_limit_ends_the_session(limited):
    client = await open_session(limited, {})
    await client.until("session.created")
    expiring = await client.until("session.expiring")
    assert 1 <= expiring["seconds_left"] <= 2 and "seq" not in expiring
    closed = await client.until("session.closed", timeout_s=10)
    assert closed["reason"] == "timeout"
    # The gRPC RealtimeService carries it too.
    async with grpc.aio.insecure_channel(limited.grpc_address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
        kinds = []
        async for response in call:
            kinds.append(response.WhichOneof("kind"))
            if kinds[-1] == "closed":
                break
    assert "expiring" in kinds and kinds.index("expiring") < kinds.index("closed")


@pytest.mark.ci_long  # a session held past a limit's length: ~4 s (tests/conftest.py)
async def test_no_limit_means_no_warning_and_no_timeout(tmp_path):
    s = Stack(tmp_path)
    try:
        s.start_scheduler()
        s.start_worker("--slots", "1", "--compute-ms", "2", "--audio-limit-s", "0")
        s.start_edge()
        client = await open_session(s, {})
        await client.until("session.created")
        answers = await run_units(client, 30)
        assert all(a["type"] != "session.closed" for a in answers)
        assert not [e for e in client.events if e["type"] == "session.expiring"]
        await client.send({"type": "session.close"})
        closed = await client.until("session.closed", timeout_s=scaled(10))
        assert closed["reason"] == "user_stop", json.dumps(closed)
    finally:
        s.stop()


async def test_the_official_sdk_goes_on_past_the_warning(limited):
    """openbmb-realtime, unchanged: session.expiring is an event it does not know (it
    ignores it), the session runs to its limit and ends without an error."""
    sdk = pytest.importorskip("openbmb_realtime")
    base = limited.url.replace("ws://", "http://").removesuffix("/realtime")
    client = sdk.RealtimeClient(api_key="none", base_url=base)
    session = await client.audio.connect(model="minicpm-o-4.5", system_prompt="hi")
    kinds: list[str] = []

    async def feed() -> None:
        for _ in range(6):
            await session.send_audio(SILENCE.tobytes())
            await asyncio.sleep(0.5)

    feeder = asyncio.ensure_future(feed())
    async with asyncio.timeout(scaled(15)):
        async for event in session:
            kinds.append(type(event).__name__)
    feeder.cancel()
    assert "ErrorEvent" not in kinds, kinds
    assert session.state.name.lower() == "closed", (session.state, kinds)


#: RSS growth allowed from the 5th to the 60th minute of one session, per process, MiB: the
#: resume journal, the recorder and every per-session list are bounded (README); what is
#: left is allocator noise (measured: edge +0.0 to +0.9, worker +1.1 to +2.2 MiB an hour).
#: A journal that kept every result whole would add ~6.6 MiB here.
HOUR_GROWTH_MIB = 5.0


@pytest.mark.ci_long  # 3,600 units, ~11 s each (tests/conftest.py)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("record", [False, True], ids=["plain", "recorded"])
def test_an_hour_long_session_never_closes_and_memory_stays_flat(record):
    """3,600 one-second units sent as fast as answered (tools.long_session: a basic window,
    no duration limit): the session runs to its end, and neither the edge's nor the worker's
    RSS grows more than HOUR_GROWTH_MIB after its first five minutes."""
    from omnifabric.tools.long_session import run

    report = run(60, record)
    assert report.outcome.startswith("ran 3600 units, closed"), report.outcome
    growth = report.growth_mib()
    assert growth is not None
    print(f"RSS growth 5 -> 60 min: edge {growth[0]:+.1f} MiB, worker {growth[1]:+.1f} MiB")
    assert growth[0] <= HOUR_GROWTH_MIB and growth[1] <= HOUR_GROWTH_MIB, report.marks
