"""The public edge's limits on real processes (RELIABILITY.md E1, E7, E8, E10, E11)."""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import statistics
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omnifabric.common.close_reasons import SERVER_SHUTDOWN, close_message
from omnifabric.common.stats import percentile
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc
from tests.conftest import scaled
from tests.e2e.wsclient import (
    SILENCE,
    SPEECH,
    RawWs,
    WsClient,
    metric,
    pcm_b64,
    rss_bytes,
    scrape_metrics,
    wait_for,
)
from tests.stack import Stack


def edge_address(stack: Stack) -> str:
    return stack.url.split("://", 1)[1].split("/", 1)[0]


async def edge_metrics(stack: Stack) -> dict:
    return await asyncio.to_thread(scrape_metrics, edge_address(stack))


# ---- E1 -------------------------------------------------------------------------------


async def test_e1_oversized_frame_closes_1009_and_forwards_nothing(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--max-frame-bytes", "100000")
    url = f"{stack.url}?mode=audio"
    client = await WsClient.open(url)
    await client.start()
    # 2 s of speech: a valid unit, but its frame (~170 KB) is over the 100 KB limit.
    big = np.concatenate([SPEECH, SPEECH])
    await client.send({"type": "input.append", "input": {"audio": pcm_b64(big)}})
    with pytest.raises(ConnectionClosed) as info:
        await client.until("response.output.delta", timeout_s=5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    samples = await edge_metrics(stack)
    assert metric(samples, "omni_edge_units_forwarded_total") == 0
    # The counter does move for a unit that fits: the assertion above can fail.
    other = await WsClient.open(url)
    await other.start()
    await other.append(SILENCE)
    await other.until("delta.listen")
    samples = await edge_metrics(stack)
    assert metric(samples, "omni_edge_units_forwarded_total") == 1


# ---- E7 -------------------------------------------------------------------------------

HALF_OPEN = 200
OPEN_TIMEOUT_S = 2.0
MIN_CONNECTS = 20


async def test_e7_half_open_handshakes_dropped_at_open_timeout(stack):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * HALF_OPEN:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * HALF_OPEN), hard))
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--open-timeout", str(OPEN_TIMEOUT_S))
    host, port = edge_address(stack).split(":")
    # Three kinds of slow request: a WebSocket upgrade, a POST (the HTTP path owns the
    # socket after the first bytes), and a few bytes without a line end (still sniffed).
    heads = [
        b"GET /v1/realtime?mode=audio HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n",
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
        b"GE",
    ]
    opened: list[float] = []
    closed: list[float | None] = [None] * HALF_OPEN
    streams = []
    for i in range(HALF_OPEN):
        # Before the connect: the edge's timer cannot start earlier, whereas a time taken
        # after it can be late by any stall of this process (a GC pause in a long run made
        # a socket look 0.18 s short-lived).
        opened.append(time.monotonic())
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(heads[i % 3])
        streams.append((reader, writer))

    async def trickle(i: int) -> None:
        reader, writer = streams[i]
        while True:
            try:
                data = await asyncio.wait_for(reader.read(4096), 0.3)
            except TimeoutError:
                if i % 3 != 2:  # one more header byte, never the blank line
                    writer.write(b"X")
                continue
            except ConnectionError:
                data = b""
            if not data:
                closed[i] = time.monotonic()
                return

    tricklers = [asyncio.create_task(trickle(i)) for i in range(HALF_OPEN)]
    try:
        # Meanwhile real clients connect, one after another, while every half-open socket
        # is certainly still open: none can be closed before opened[0] + the open timeout,
        # and no connect starts later than half of it after opened[0], so even one that
        # stalls for a second is measured against all 200. Each takes a few ms: ~100 or
        # more samples, and MIN_CONNECTS at the least on a slow host (checked below).
        window_end = opened[0] + OPEN_TIMEOUT_S / 2
        connects = []
        while time.monotonic() < window_end:
            assert all(c is None for c in closed), "half-open sockets closed before the timeout"
            t0 = time.perf_counter()
            client = await WsClient.open(f"{stack.url}?mode=audio")
            connects.append((time.perf_counter() - t0) * 1000.0)
            await client.close()
        done, pending = await asyncio.wait(tricklers, timeout=scaled(OPEN_TIMEOUT_S + 5))
        assert not pending, f"{len(pending)} half-open sockets still open"
    finally:
        for task in tricklers:
            task.cancel()
        for _, writer in streams:
            writer.close()
    lived = [c - o for c, o in zip(closed, opened, strict=True) if c is not None]
    assert len(connects) >= MIN_CONNECTS, f"only {len(connects)} connects while all were open"
    p50, p95, p99 = (percentile(connects, q) for q in (50, 95, 99))
    print(
        f"E7: {HALF_OPEN} half-open sockets (opened in {opened[-1] - opened[0]:.2f} s) "
        f"closed after {min(lived):.2f}-{max(lived):.2f} s (open timeout {OPEN_TIMEOUT_S} s); "
        f"{len(connects)} real connects meanwhile: p50 {p50:.1f} ms, p95 {p95:.1f} ms, "
        f"p99 {p99:.1f} ms, max {max(connects):.1f} ms"
    )
    assert min(lived) >= OPEN_TIMEOUT_S - 0.05
    assert max(lived) <= OPEN_TIMEOUT_S + scaled(1.0)
    # The 200 ms bound of RELIABILITY E7, on p95: a starved accept loop slows most connects
    # past it, while one or two scheduling stalls of a loaded 2-core host (which alone made
    # the "p99" of 30 samples, their maximum) do not decide it.
    assert p95 < scaled(200)


# ---- E8 -------------------------------------------------------------------------------

STUCK = 10
PING_S = 1.5


def unit_frames() -> list[bytes]:
    """Speech then silence: the synthetic engine answers the silences with speech audio,
    so the edge has ~100 KB to send per unit."""
    speech = RawWs.frame(json.dumps({"type": "input.append", "input": {"audio": pcm_b64(SPEECH)}}))
    silence = RawWs.frame(
        json.dumps({"type": "input.append", "input": {"audio": pcm_b64(SILENCE)}})
    )
    return [speech, silence, silence, silence]


async def open_stuck(stack: Stack, n: int, rcvbuf: int) -> list[RawWs]:
    """n clients that send session.init and never read again; returns once all are active."""
    host, port = edge_address(stack).split(":")
    clients = []
    for _ in range(n):
        raw = await RawWs.open(host, int(port), "/v1/realtime?mode=audio", rcvbuf=rcvbuf)
        await raw.send({"type": "session.init", "payload": {"system_prompt": "stuck"}})
        clients.append(raw)

    async def all_active() -> bool:
        samples = await edge_metrics(stack)
        return metric(samples, "omni_edge_sessions_active", state="active") == n

    await wait_for(all_active, 10)
    return clients


async def stream_until_closed(raw: RawWs, frames: list[bytes], limit_s: float) -> float | None:
    """Send a unit every 0.1 s until a send fails; the time it failed (None: never)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    i = 0
    while loop.time() < end:
        try:
            await asyncio.wait_for(raw.send_raw(frames[i % len(frames)]), 1.0)
        except (ConnectionError, OSError, TimeoutError):
            return time.monotonic()
        i += 1
        await asyncio.sleep(0.1)
    return None


async def warm_up(stack: Stack) -> None:
    """One ordinary session, so the edge's code paths and channels exist before RSS."""
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    for samples in (SPEECH, SILENCE, SILENCE):
        await client.append(samples)
        await client.until("delta.listen", "delta.audio")
    await client.send({"type": "session.close"})
    await client.until("session.closed")
    await client.close()


@pytest.mark.ci_long  # waits out the keepalive: ~5 s (tests/conftest.py)
async def test_e8_clients_that_stop_reading_are_dropped_by_the_keepalive(stack):
    stack.start_scheduler()
    stack.start_worker("--slots", str(STUCK + 1), "--compute-ms", "5")
    edge = stack.start_edge("--ping-interval", str(PING_S), "--ping-timeout", str(PING_S))
    await warm_up(stack)
    before = rss_bytes(edge.proc.pid)
    clients = await open_stuck(stack, STUCK, rcvbuf=16384)
    peak = before
    sampling = True

    async def sample_rss() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, rss_bytes(edge.proc.pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_rss())
    frames = unit_frames()
    try:
        failed = await asyncio.gather(
            *(stream_until_closed(c, frames, scaled(3 * PING_S + 5)) for c in clients)
        )
    finally:
        sampling = False
        await sampler

    async def none_active() -> bool:
        samples = await edge_metrics(stack)
        return metric(samples, "omni_edge_sessions_active") == 0

    await wait_for(none_active, 5)
    assert all(f is not None for f in failed), "a client that stopped reading stayed connected"
    # From each client's handshake: the edge's keepalive starts with the connection.
    took = [f - c.opened_at for f, c in zip(failed, clients, strict=True) if f is not None]
    # The socket really is closed by the server: reading ends (EOF or reset), no hang.
    for c in clients:
        await c.read_frames(timeout_s=5)
        c.close()
    after = rss_bytes(edge.proc.pid)
    growth = (peak - before) / STUCK / 2**20
    print(
        f"E8 keepalive: {STUCK} stuck clients saw their connection gone {min(took):.2f}-"
        f"{max(took):.2f} s after their handshake (ping interval {PING_S} + timeout {PING_S} "
        f"s; the client notices on its next send); edge RSS "
        f"{before / 2**20:.1f} MiB before, peak {peak / 2**20:.1f}, after {after / 2**20:.1f}: "
        f"{growth:.2f} MiB per client at the peak"
    )
    # The first ping goes at PING_S; its pong is due PING_S later. Up to two sends (one
    # answered by a reset, the next failing) are the client's own detection lag, ~0.15 s
    # on a quiet host; the rest of the 1.2 s is a loaded host's timer and loop lag (the
    # edge's and this process's, with ten clients streaming). A keepalive one ping
    # interval late (3 x PING_S = 4.5 s) is still over it.
    assert max(took) <= 2 * PING_S + scaled(1.2)
    assert growth < 5.0


@pytest.mark.ci_long  # fills a reader's queue until it overflows: ~7 s (tests/conftest.py)
async def test_e8_outbound_queue_overflow_closes_1008_with_a_reason(stack, monkeypatch):
    monkeypatch.setenv("OMNI_EDGE_OUTBOUND_QUEUE_MAX", "16")
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    # Keepalive out of the way: only the outbound bound can end this session.
    stack.start_edge("--ping-interval", "60", "--ping-timeout", "60")
    [raw] = await open_stuck(stack, 1, rcvbuf=4096)
    frames = unit_frames()
    t0 = time.monotonic()

    async def overflowed() -> bool:
        samples = await edge_metrics(stack)
        return metric(samples, "omni_edge_client_errors_total", code="slow_client") >= 1

    streamer = asyncio.create_task(stream_until_closed(raw, frames, scaled(30)))
    try:
        took = await wait_for(overflowed, 30)
    finally:
        streamer.cancel()
        await asyncio.gather(streamer, return_exceptions=True)
    # The client reads again at once: what was already in flight, then the reason.
    events, code = await raw.read_frames(timeout_s=5)
    raw.close()
    errors = [e for e in events if e["type"] == "error"]
    print(
        f"E8 overflow: slow_client after {took:.2f} s of streaming; the client then read "
        f"{len(events)} events and close code {code}"
    )
    assert errors and errors[-1]["error"]["code"] == "slow_client"
    assert code == 1008
    assert time.monotonic() - t0 < 60  # not the keepalive

    async def none_active() -> bool:
        samples = await edge_metrics(stack)
        return metric(samples, "omni_edge_sessions_active") == 0

    await wait_for(none_active, 5)


# ---- E10 ------------------------------------------------------------------------------


async def test_e10_queue_full_closes_1013_within_100ms(stack):
    stack.start_scheduler("--queue-max", "1")
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    holder = await WsClient.open(url)
    await holder.start()
    queued = await WsClient.open(url)
    await queued.until("session.queued")
    # The span E10 names starts once the client is in: from the opening handshake's end,
    # through the scheduler's refusal and error{queue_full}, to the close. The handshake
    # before it (the time to connect at all, E7's) is timed apart and only reported.
    handshakes, to_error, to_close = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        rejected = await WsClient.open(url)
        t_open = time.perf_counter()
        handshakes.append((t_open - t0) * 1000.0)
        err = await rejected.until("error")
        to_error.append((time.perf_counter() - t_open) * 1000.0)
        assert err["error"]["code"] == "queue_full"
        with pytest.raises(ConnectionClosed) as info:
            await rejected.recv()
        to_close.append((time.perf_counter() - t_open) * 1000.0)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    print(
        f"E10: handshake median {statistics.median(handshakes):.1f} ms; then queue_full "
        f"median {statistics.median(to_error):.1f} ms, close 1013 median "
        f"{statistics.median(to_close):.1f} ms, max {max(to_close):.1f} ms"
    )
    assert statistics.median(to_close) < scaled(100)


# ---- E11 ------------------------------------------------------------------------------


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=scaled(5)) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


async def test_e11_sigterm_drains(stack):
    """SIGTERM with sessions whose worker cannot confirm (SIGSTOP): /healthz is 503 at
    once, new sessions get 503, every open session (both dialects, legacy duplex, gRPC)
    gets server_shutdown within the grace, and only then does the edge exit."""
    grace = 2.0
    stack.start_scheduler()
    worker = stack.start_worker("--slots", "4", "--compute-ms", "5")
    edge = stack.start_edge("--grace", str(grace))
    base = stack.url.split("/v1/")[0]
    healthz = base.replace("ws://", "http://") + "/healthz"
    assert await asyncio.to_thread(http_status, healthz) == 200
    current = await WsClient.open(f"{stack.url}?mode=audio")
    await current.start("current")
    first = await WsClient.open(f"{stack.url}?mode=audio")
    await first.start("first")
    legacy = await WsClient.open(f"{base}/ws/duplex/adx_drain")
    await legacy.until("queue_done")
    await legacy.send({"type": "prepare", "system_prompt": "hi"})
    await legacy.until("prepared")
    channel = grpc.aio.insecure_channel(stack.grpc_address)
    call = rt_grpc.RealtimeServiceStub(channel).Connect()
    await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
    while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
        pass
    worker.kill(signal.SIGSTOP)
    try:
        edge.kill(signal.SIGTERM)
        t0 = time.monotonic()
        while await asyncio.to_thread(http_status, healthz) != 503:
            assert time.monotonic() - t0 < scaled(1)
        unhealthy = time.monotonic() - t0
        with pytest.raises(InvalidStatus) as info:
            await WsClient.open(f"{stack.url}?mode=audio")
        assert info.value.response.status_code == 503
        refused = time.monotonic() - t0
        # The drain is still waiting on the sessions at this point.
        assert not any(e["type"] == "session.closed" for e in current.events + first.events)
        assert edge.proc.poll() is None

        async def closed_reason(client: WsClient) -> str:
            return (await client.until("session.closed", timeout_s=grace + 2))["reason"]

        reasons = await asyncio.gather(closed_reason(current), closed_reason(first))
        assert reasons == ["server_shutdown", "server_shutdown"]
        shut = time.monotonic() - t0
        legacy_end = await legacy.until("error", timeout_s=grace + 2)
        assert legacy_end["error"] == close_message(SERVER_SHUTDOWN)
        msg = await asyncio.wait_for(call.read(), scaled(grace + 2))
        assert msg.WhichOneof("kind") == "closed"
        assert msg.closed.reason == common_pb2.CLOSE_REASON_SERVER_SHUTDOWN
        assert msg.closed.message == close_message(SERVER_SHUTDOWN)
        assert await asyncio.to_thread(edge.proc.wait, scaled(10)) == 0
        exited = time.monotonic() - t0
    finally:
        worker.kill(signal.SIGCONT)
        await channel.close()
    print(
        f"E11: /healthz 503 after {unhealthy * 1000:.1f} ms, new session refused at "
        f"{refused * 1000:.0f} ms, session.closed{{server_shutdown}} at {shut:.2f} s, "
        f"edge exited at {exited:.2f} s (grace {grace} s, worker stopped)"
    )
    # "At once": the first poll after the signal, within a loaded host's loop lag.
    assert unhealthy < scaled(0.5)
    # The edge ends the sessions itself at 0.8 x grace (the worker cannot confirm): 1.6 s,
    # ~1.61 s here on a quiet host; the 0.6 s is a loaded host's timer and delivery lag
    # (the signal's, the edge's timer's, the close event's to this process).
    assert shut <= scaled(grace + 0.6)


# ---- chat and gRPC clients: E8 (outbound bound) and E11 (drain) ---------------------------


async def scheduler_leases(stack: Stack) -> int:
    """Leases the scheduler holds on its workers now."""
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

    async with grpc.aio.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        status = await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))
    return sum(len(w.lease_ids) for w in status.workers)


async def edge_status(stack: Stack) -> dict:
    """GET /status on the edge."""

    def get() -> dict:
        url = f"http://{edge_address(stack)}/status"
        with urllib.request.urlopen(url, timeout=scaled(5)) as reply:
            return json.loads(reply.read())

    return await asyncio.to_thread(get)


def long_chat(words: int) -> dict:
    """A chat request the synthetic engine answers with one text and one audio delta (0.25 s
    of 24 kHz float32: ~32 KB of JSON) per two of these words."""
    return {
        "messages": [{"role": "user", "content": " ".join(f"w{i:06d}" for i in range(words))}],
        "streaming": True,
        "generation": {"max_new_tokens": 4096},
        "tts": {"enabled": True},
    }


async def chat_turn(url: str, request: dict) -> tuple[dict, list[dict]]:
    """One mode=chat turn by a client that reads everything: (response.done, deltas)."""
    client = await WsClient.open(url)
    await client.until("session.queue_done")
    await client.send({"type": "session.init", "payload": {}})
    await client.until("session.created")
    await client.send({"type": "input.append", "input": request})
    done = await client.until("response.done", timeout_s=60)
    await client.close()
    return done, [e for e in client.events if e["type"] == "response.output.delta"]


async def test_e8_chat_client_that_stops_reading_gets_slow_client(stack, monkeypatch):
    """A mode=chat and a /ws/chat client that never read, with a streaming reply far larger
    than the socket buffers: slow_client and close 1008 instead of a turn that waits on the
    client (holding its worker slot) until the keepalive; leases, sessions and the edge's
    tasks are all back afterwards."""
    monkeypatch.setenv("OMNI_EDGE_OUTBOUND_QUEUE_MAX", "8")
    words = 1200
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    # Keepalive out of the way: only the outbound bound can end these sessions.
    edge = stack.start_edge("--ping-interval", "60", "--ping-timeout", "60")
    chat_url = f"{stack.url}?mode=chat"
    # Warm-up with the full reply to a client that reads: channels, code paths and the
    # buffers one large reply needs exist before the baseline, so what is measured after
    # it is what each stuck client costs (and this is what they would have had to hold).
    # The reply comes at ~6 MB/s into an outbound queue of 8 events: a reading client
    # that the loaded host stalls long enough to fill the socket buffers gets slow_client
    # too, as it should (seen once in CI); the warm-up then goes again.
    for attempt in (1, 2, 3):
        try:
            done, deltas = await chat_turn(chat_url, long_chat(words))
            break
        except ConnectionClosed as closed:
            if attempt == 3 or closed.rcvd is None or closed.rcvd.reason != "slow_client":
                raise
            print(f"E8 warm-up: the reading client fell behind (attempt {attempt})")

    async def nothing_open() -> bool:
        status = await edge_status(stack)
        return status["edge"]["chat_sessions"] == 0 and status["leases_active"] == 0

    await wait_for(nothing_open, 5)
    samples = await edge_metrics(stack)
    tasks_before = metric(samples, "omni_edge_asyncio_tasks")
    # A warm-up client that fell behind counted a slow_client already: the stuck clients'
    # two come on top (waiting for 2 in all returned at once after two warm-up retries, and
    # the "stuck" clients then read on for seconds: seen in CI, 620 of 1202 deltas).
    slow_before = metric(samples, "omni_edge_client_errors_total", code="slow_client")
    rss_before = rss_bytes(edge.proc.pid)
    host, port = edge_address(stack).split(":")
    realtime = await RawWs.open(host, int(port), "/v1/realtime?mode=chat", rcvbuf=4096)
    await realtime.send({"type": "session.init", "payload": {}})
    await realtime.send({"type": "input.append", "input": long_chat(words)})
    legacy = await RawWs.open(host, int(port), "/ws/chat", rcvbuf=4096)
    await legacy.send(long_chat(words))
    peak = rss_before

    async def overflowed() -> bool:
        nonlocal peak
        peak = max(peak, rss_bytes(edge.proc.pid))
        samples = await edge_metrics(stack)
        slow = metric(samples, "omni_edge_client_errors_total", code="slow_client")
        return slow >= slow_before + 2

    took = await wait_for(overflowed, 30)
    # The clients read again at once: what was already in flight, then the reason.
    read = []
    for raw, last in ((realtime, "response.done"), (legacy, "done")):
        events, code = await raw.read_frames(timeout_s=5)
        raw.close()
        types = [e["type"] for e in events]
        assert types[-1] == "error" and "slow_client" in json.dumps(events[-1]), types[-5:]
        if last == "done":  # /ws/chat: the legacy error is a plain string
            assert isinstance(events[-1]["error"], str), events[-1]
        assert code == 1008
        assert last not in types
        read.append(sum(1 for t in types if t in ("response.output.delta", "chunk")))
    ended = await wait_for(nothing_open, 5)
    status = await edge_status(stack)
    assert status["edge"]["sessions"] == 0

    async def tasks_back() -> bool:
        return metric(await edge_metrics(stack), "omni_edge_asyncio_tasks") <= tasks_before

    await wait_for(tasks_back, 5)
    assert done["reason"] == "turn_end" and done["text"].endswith(f"w{words - 1:06d}")
    reply_bytes = sum(len(json.dumps(e, separators=(",", ":"))) for e in deltas)
    growth = (peak - rss_before) / 2 / 2**20
    print(
        f"E8 chat: slow_client on both after {took:.2f} s; the stuck clients had read "
        f"{read[0]} (mode=chat) and {read[1]} (/ws/chat) of {len(deltas)} deltas "
        f"({reply_bytes / 2**20:.1f} MiB of JSON in the whole reply); leases and sessions "
        f"gone {ended:.2f} s after they read; edge RSS growth at the peak {growth:.2f} MiB "
        "per client"
    )
    # Larger than every buffer on the way (Linux grows a socket's send buffer to 4 MiB).
    assert reply_bytes > 12 * 2**20
    assert max(read) < len(deltas) / 2
    assert growth < 5.0


async def test_e8_grpc_client_that_stops_reading_gets_resource_exhausted(stack, monkeypatch):
    """A RealtimeService client that keeps sending units and never reads: once the edge's
    writes stop (HTTP/2 flow control) and its bounded queue fills, the session ends at once
    (lease back, no session left) and the call ends with RESOURCE_EXHAUSTED slow_client
    after what the client's window already held."""
    monkeypatch.setenv("OMNI_EDGE_OUTBOUND_QUEUE_MAX", "4")
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--ping-interval", "60", "--ping-timeout", "60")
    # Without BDP probing the client's receive window stays at 64 KiB, so the edge's
    # writes stop after about one second of reply audio (with it: megabytes later).
    channel = grpc.aio.insecure_channel(stack.grpc_address, options=[("grpc.http2.bdp_probe", 0)])
    call = rt_grpc.RealtimeServiceStub(channel).Connect()
    await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
    while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
        pass
    # Quarter-second units (16 KB): few are in flight when the edge stops reading them.
    units = [SPEECH[:4000], SILENCE[:4000], SILENCE[:4000], SILENCE[:4000]]
    stop = asyncio.Event()
    sent = 0

    async def stream() -> None:
        nonlocal sent
        while not stop.is_set():
            audio = units[sent % len(units)].astype("<f4").tobytes()
            write = asyncio.shield(
                call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=audio)))
            )
            try:
                await asyncio.wait_for(write, scaled(1))
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the edge no longer reads: nothing more to send
            sent += 1
            await asyncio.sleep(0.05)

    async def overflowed() -> bool:
        samples = await edge_metrics(stack)
        return metric(samples, "omni_edge_client_errors_total", code="slow_client") >= 1

    streamer = asyncio.create_task(stream())
    try:
        took = await wait_for(overflowed, 30)

        # Still not reading: the overflow alone ended the session and returned its lease.
        async def ended() -> bool:
            samples = await edge_metrics(stack)
            return (
                metric(samples, "omni_edge_sessions_active") == 0
                and await scheduler_leases(stack) == 0
            )

        freed = await wait_for(ended, 5)
    finally:
        stop.set()
        await asyncio.wait({streamer}, timeout=scaled(2))
    read = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            msg = await asyncio.wait_for(call.read(), scaled(10))
            assert msg is not grpc.aio.EOF, "the call ended without a status"
            read += 1
    await channel.close()
    print(
        f"E8 gRPC: {sent} units sent; slow_client after {took:.2f} s; lease back "
        f"{freed:.2f} s later with the client still not reading; it then read {read} "
        f"messages and {info.value.code().name}"
    )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("slow_client: ")


@pytest.mark.ci_long  # a drain waited out: ~7 s (tests/conftest.py)
async def test_e11_sigterm_ends_chat_sessions_in_band(stack):
    """SIGTERM with chat clients in every state: an idle mode=chat session and a /ws/chat
    that sent nothing end at once in-band (session.closed{server_shutdown} / error), a turn
    that finishes within the grace still delivers its reply first, one that cannot is cut;
    each then gets close 1001."""
    grace, compute_ms = 3.5, 2000
    stack.start_scheduler()
    # One slot: the second turn waits for the first, so it cannot finish within the grace
    # (2 x 2 s of compute > 0.8 x 3.5 s for the sessions to end), while the first can.
    stack.start_worker("--slots", "1", "--compute-ms", str(compute_ms))
    edge = stack.start_edge("--grace", str(grace))
    base = stack.url.split("/v1/")[0]

    async def chat_session() -> WsClient:
        client = await WsClient.open(f"{stack.url}?mode=chat")
        await client.until("session.queue_done")
        await client.send({"type": "session.init", "payload": {}})
        await client.until("session.created")
        return client

    idle = await chat_session()
    busy = await chat_session()
    silent = await WsClient.open(f"{base}/ws/chat")  # never sends its request
    waiting = await WsClient.open(f"{base}/ws/chat")
    await busy.send(
        {"type": "input.append", "input": {"messages": [{"role": "user", "content": "first"}]}}
    )

    async def turn_running() -> bool:
        return await scheduler_leases(stack) == 1

    await wait_for(turn_running, 10)
    await waiting.send({"messages": [{"role": "user", "content": "second"}]})
    await waiting.until("queued")
    edge.kill(signal.SIGTERM)
    t0 = time.monotonic()

    async def close_code(client: WsClient) -> int | None:
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await client.recv(timeout_s=grace + 2)
        return info.value.rcvd.code if info.value.rcvd else None

    closed = await idle.until("session.closed", timeout_s=grace + 2)
    idle_s = time.monotonic() - t0
    assert closed["reason"] == "server_shutdown" and closed["usage"]["total_tokens"] == 0
    silent_end = await silent.until("error", timeout_s=grace + 2)
    silent_s = time.monotonic() - t0
    assert silent_end["error"] == close_message(SERVER_SHUTDOWN)
    done = await busy.until("response.done", timeout_s=grace + 2)
    assert done["text"] == "You said: first"
    busy_closed = await busy.until("session.closed", timeout_s=grace + 2)
    busy_s = time.monotonic() - t0
    assert busy_closed["reason"] == "server_shutdown"
    assert busy_closed["usage"]["total_tokens"] == done["usage"]["total_tokens"] > 0
    cut = await waiting.until("error", "done", timeout_s=grace + 2)
    cut_s = time.monotonic() - t0
    assert cut == {"type": "error", "error": close_message(SERVER_SHUTDOWN)}
    codes = [await close_code(c) for c in (idle, silent, busy, waiting)]
    assert codes == [1001, 1001, 1001, 1001]
    assert await asyncio.to_thread(edge.proc.wait, scaled(10)) == 0
    exited = time.monotonic() - t0
    print(
        f"E11 chat: idle session.closed{{server_shutdown}} at {idle_s * 1000:.0f} ms, silent "
        f"/ws/chat error at {silent_s * 1000:.0f} ms, the running turn's response.done then "
        f"session.closed at {busy_s:.2f} s, the waiting turn cut at {cut_s:.2f} s, edge "
        f"exited at {exited:.2f} s (grace {grace} s, {compute_ms} ms per turn)"
    )
    assert idle_s < scaled(0.5) and silent_s < scaled(0.5)
    assert cut_s <= scaled(grace)

    async def no_lease() -> bool:
        return await scheduler_leases(stack) == 0

    await wait_for(no_lease, 5)
