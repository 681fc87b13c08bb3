"""Security of the public edge on real processes: per-key session limits, gRPC
RealtimeService authentication, and TLS (wss:// and gRPC over TLS)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
import wave

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omnifabric.edge.app import EdgeApp
from omnifabric.edge.config import EdgeConfig, hash_key
from omnifabric.edge.metrics import EdgeMetrics
from omnifabric.edge.transports.grpc import RealtimeServicer
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc
from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import SILENCE, WsClient, post_json, scrape_metrics
from tests.stack import Stack

PCM = SILENCE.astype("<f4").tobytes()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def refused(url: str, key: str) -> tuple[int, str]:
    """Open a connection that must be refused before the upgrade: (status, body)."""
    with pytest.raises(InvalidStatus) as info:
        await WsClient.open(url, additional_headers=bearer(key))
    response = info.value.response
    return response.status_code, response.body.decode()


async def grpc_session(address: str, metadata=None, credentials=None) -> rt_pb.ConnectResponse:
    """Open a RealtimeService session, run one unit, close it; returns the closed message.
    Raises grpc.aio.AioRpcError when the edge refuses the call."""
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials)
    async with channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect(metadata=metadata)
        await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
        while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
            pass
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=PCM)))
        out = await asyncio.wait_for(call.read(), scaled(10))
        assert out.WhichOneof("kind") == "output" and out.output.seq == 1
        await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest(reason="done")))
        closed = await asyncio.wait_for(call.read(), scaled(10))
        assert closed.WhichOneof("kind") == "closed"
        return closed


async def grpc_refusal(
    address: str, metadata=None, send_init: bool = False
) -> tuple[grpc.StatusCode, str]:
    """Open a RealtimeService call the edge must refuse: (status code, details).

    Refusals decided from the metadata alone are read without writing anything: with
    grpcio's asyncio client a write that races the server's early status replaces that
    status with INTERNAL "Internal error from Core" (grpc/grpc#36066). `send_init` writes
    the init first, for refusals the edge decides after reading it; a refusal that came
    before the write (decided from the metadata after all) is what the write raises.
    """
    async with grpc.aio.insecure_channel(address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect(metadata=metadata)
        if send_init:
            init = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)
            try:
                await call.write(rt_pb.ConnectRequest(init=init))
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or ""
        code = await asyncio.wait_for(call.code(), scaled(10))
        return code, await call.details()


# ---- per-key session limits ------------------------------------------------------------


async def test_per_key_session_limit_across_endpoints(stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team\nsk-team-alpha max_sessions=2\nsk-solo-beta\n")
    stack.start_scheduler()
    stack.start_worker("--slots", "4", "--compute-ms", "5")
    stack.start_edge("--api-keys-file", str(keys), "--max-sessions-per-key", "1")
    base = stack.url.split("/v1/")[0]
    audio = f"{stack.url}?mode=audio"
    # The team key (limit 2 from its line): one realtime and one legacy duplex session.
    a = await WsClient.open(audio, additional_headers=bearer("sk-team-alpha"))
    await a.start()
    legacy = f"{base}/ws/duplex/adx_keyed"
    b = await WsClient.open(legacy, additional_headers=bearer("sk-team-alpha"))
    await b.until("queue_done")
    # A third one, on any endpoint, is refused before the upgrade with a reason.
    for url in (audio, f"{stack.url}?mode=chat", f"{base}/ws/chat"):
        status, body = await refused(url, "sk-team-alpha")
        assert status == 429 and "limit" in body
    # ... and so is a gRPC RealtimeService session with that key.
    code, _ = await grpc_refusal(stack.grpc_address, (("authorization", "Bearer sk-team-alpha"),))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The other key has the edge-wide limit (1), counted on its own.
    solo = await WsClient.open(audio, additional_headers=bearer("sk-solo-beta"))
    await solo.until("session.queue_done")
    status, _ = await refused(f"{stack.url}?mode=chat", "sk-solo-beta")
    assert status == 429
    # A slot comes back when its connection ends.
    await a.close()
    deadline = time.monotonic() + scaled(2)
    while True:
        try:
            c = await WsClient.open(audio, additional_headers=bearer("sk-team-alpha"))
            break
        except InvalidStatus as exc:
            assert exc.response.status_code == 429
            assert time.monotonic() < deadline, "the closed session's slot never came back"
            await asyncio.sleep(0.05)
    await c.start()
    await c.close()
    await b.close()
    # With both closed, the gRPC surface takes the key again (and counts it too).
    closed = await grpc_session(stack.grpc_address, (("authorization", "Bearer sk-team-alpha"),))
    assert closed.closed.reason == common_pb2.CLOSE_REASON_USER_STOP
    log = stack.edge.log_path.read_text()
    for key in ("sk-team-alpha", "sk-solo-beta"):
        assert key not in log
    assert f"sha256:{hash_key('sk-team-alpha')[:8]}" in log  # a digest prefix at most


async def test_a_keys_session_limit_holds_across_edges(stack, tmp_path):
    """Two edges on one scheduler (two hosts, or two processes of `edge --processes`): a
    key with max_sessions=1 holding a session on one is refused on the other, on every
    surface, with too_many_sessions; another key is not; once the first session ends the
    key is taken on either."""
    keys = tmp_path / "keys"
    keys.write_text("sk-fleet-zeta max_sessions=1\nsk-other-eta\n")
    scheduler = stack.start_scheduler()
    stack.start_worker("--slots", "4", "--compute-ms", "400")
    stack.start_edge("--api-keys-file", str(keys))
    first = stack.url
    stack.start_edge("--api-keys-file", str(keys), name="edge2")
    second, second_grpc = stack.url, stack.grpc_address
    holder = await WsClient.open(f"{first}?mode=audio", additional_headers=bearer("sk-fleet-zeta"))
    await holder.start()
    # The second edge holds nothing of this key itself: the scheduler refuses it.
    other = await WsClient.open(f"{second}?mode=audio", additional_headers=bearer("sk-fleet-zeta"))
    error = await other.until("error")
    assert error["error"]["code"] == "too_many_sessions", error
    assert "limit is 1" in error["error"]["message"]
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await other.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    # Each refused attempt holds the second edge's own count until its connection has
    # ended there (just after the close): the next attempt waits for that, so what refuses
    # it is the scheduler's count, never the edge's (their messages differ).
    deadline = time.monotonic() + scaled(5)

    async def released() -> None:
        assert time.monotonic() < deadline, "the second edge kept a refused session's count"
        await asyncio.sleep(0.05)

    legacy = second.split("/v1/")[0] + "/ws/half_duplex/hd_fleet"
    while True:
        try:
            call = await WsClient.open(legacy, additional_headers=bearer("sk-fleet-zeta"))
            break
        except InvalidStatus as exc:
            assert exc.response.status_code == 429
            await released()
    refusal = await call.until("error")
    assert "across the fabric" in refusal["error"], refusal
    while True:
        code, details = await grpc_refusal(
            second_grpc, (("authorization", "Bearer sk-fleet-zeta"),), send_init=True
        )
        if code == grpc.StatusCode.INTERNAL and details == "Internal error from Core":
            await released()  # the write raced the edge's own early refusal (grpc/grpc#36066)
            continue
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        if "too_many_sessions" in details:
            break
        await released()
    assert "across the fabric" in details
    api = second.split("/v1/")[0].replace("ws://", "http://") + "/api/chat"
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tts": {"enabled": False}})
    while True:
        status, answer = await asyncio.to_thread(
            post_json, api, chat.encode(), bearer("sk-fleet-zeta")
        )
        assert status == 429 and answer["error"] == "too_many_sessions", answer
        if "across the fabric" in answer["message"]:
            break
        await released()
    # Another key is not held to it.
    free = await WsClient.open(f"{second}?mode=audio", additional_headers=bearer("sk-other-eta"))
    await free.start()
    await free.close()
    # The holder ends: the key is taken on the other edge.
    await holder.close()
    deadline = time.monotonic() + scaled(5)
    while True:
        # Until the scheduler has the holder's lease back, an attempt is refused (and, for
        # as long as its own connection takes to end, holds the second edge's count).
        assert time.monotonic() < deadline, "the ended session's lease never came back"
        try:
            again = await WsClient.open(
                f"{second}?mode=audio", additional_headers=bearer("sk-fleet-zeta")
            )
        except InvalidStatus as exc:
            assert exc.response.status_code == 429
            await asyncio.sleep(0.05)
            continue
        event = await again.until("session.queue_done", "error")
        if event["type"] == "session.queue_done":
            break
        assert event["error"]["code"] == "too_many_sessions"
        await asyncio.sleep(0.05)
    await again.send({"type": "session.init", "payload": {}})
    await again.until("session.created")
    await again.close()
    rejections = scrape_metrics(scheduler.metrics_address())
    assert rejections["omni_scheduler_key_limit_rejections_total"][0][1] >= 4


def test_key_file_errors_name_the_line_not_the_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-fine\nsk-secret-gamma max_sessions=lots\n")
    run = subprocess.run(
        [sys.executable, "-m", "omnifabric.edge", "--api-keys-file", str(keys), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert run.returncode == 2
    assert "line 2" in run.stderr and "max_sessions" in run.stderr
    assert "sk-secret-gamma" not in run.stderr


# ---- gRPC RealtimeService authentication (G2) -----------------------------------------


async def test_grpc_realtime_requires_a_bearer_key(stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-grpc-delta\n")
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--api-keys-file", str(keys))
    for metadata in (
        None,
        (("authorization", "Bearer sk-wrong"),),
        (("authorization", "Basic sk-grpc-delta"),),
    ):
        code, details = await grpc_refusal(stack.grpc_address, metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert details == "missing or invalid API key"
    closed = await grpc_session(stack.grpc_address, (("authorization", "Bearer sk-grpc-delta"),))
    assert closed.closed.reason_text == "done"
    assert "sk-grpc-delta" not in stack.edge.log() and "sk-wrong" not in stack.edge.log()


async def test_grpc_bad_voice_is_invalid_argument(stack):
    """A reference voice WAV with a 0 Hz rate: INVALID_ARGUMENT naming the field and the
    rate, no exception text, and the edge keeps serving."""
    stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    stack.start_edge()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.zeros(1600, "<i2").tobytes())
    voice = bytearray(buf.getvalue())
    voice[24:28] = (0).to_bytes(4, "little")  # the sample rate field
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        init = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, ref_audio=bytes(voice))
        await call.write(rt_pb.ConnectRequest(init=init))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), scaled(10))
    code, details = info.value.code(), info.value.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "ref_audio" in details and "0 Hz" in details, details
    assert "Error" not in details and "Traceback" not in details
    # The edge keeps serving.
    closed = await grpc_session(stack.grpc_address)
    assert closed.closed.reason == common_pb2.CLOSE_REASON_USER_STOP


async def test_grpc_internal_error_is_generic():
    """A servicer whose fabric is missing fails inside the session: INTERNAL, 'internal
    error', and nothing about the exception (real gRPC server and generated stub)."""
    config = EdgeConfig()
    app = EdgeApp(config, None, EdgeMetrics())  # type: ignore[arg-type]
    server = grpc.aio.server()
    rt_grpc.add_RealtimeServiceServicer_to_server(
        RealtimeServicer(app),
        server,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        code, details = await grpc_refusal(f"127.0.0.1:{port}", send_init=True)
    finally:
        await server.stop(None)
    assert code == grpc.StatusCode.INTERNAL
    assert details == "internal error"


# ---- TLS ------------------------------------------------------------------------------


@pytest.fixture
def cert_pair(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=scaled(30),
    )
    return cert, key


def https_get(url: str, context: ssl.SSLContext) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=scaled(10), context=context) as reply:
        return reply.status, reply.read().decode()


def https_post(url: str, body: bytes, context: ssl.SSLContext) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=scaled(60), context=context) as reply:
        return reply.status, json.loads(reply.read())


async def test_tls_on_websocket_http_and_grpc(stack, cert_pair):
    cert, key = cert_pair
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--tls-cert", str(cert), "--tls-key", str(key))
    assert stack.url.startswith("wss://127.0.0.1:")
    context = ssl.create_default_context(cafile=str(cert))
    client = await WsClient.open(f"{stack.url}?mode=audio", ssl=context)
    await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen")
    await client.send({"type": "session.close"})
    assert (await client.until("session.closed"))["reason"] == "user_stop"
    # Plain ws:// to the TLS port does not get a WebSocket.
    with pytest.raises(Exception) as info:  # noqa: B017 - any failure to open will do
        await WsClient.open(f"{stack.url.replace('wss://', 'ws://')}?mode=audio", open_timeout=5)
    assert not isinstance(info.value, AssertionError)
    # The HTTP surfaces on the same port, over TLS (the POST sniffing included).
    https = stack.url.replace("wss://", "https://").split("/v1/")[0]
    assert await asyncio.to_thread(https_get, f"{https}/healthz", context) == (
        200,
        '{"status":"ok"}',
    )
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, answer = await asyncio.to_thread(https_post, f"{https}/api/chat", body, context)
    assert status == 200 and answer["text"] == "You said: hi"
    # gRPC on the edge's port: TLS with the certificate as root works, plaintext does not.
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    closed = await grpc_session(stack.grpc_address, credentials=credentials)
    assert closed.closed.reason == common_pb2.CLOSE_REASON_USER_STOP
    async with grpc.aio.secure_channel(stack.grpc_address, credentials) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=scaled(5)
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as rpc:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=scaled(2)
            )
        assert rpc.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )


@pytest.mark.parametrize(
    "case", ["cert only", "key only", "missing file", "not a certificate", "key mismatch"]
)
def test_tls_setup_errors_are_clear(tmp_path, cert_pair, case):
    cert, key = cert_pair
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    other_key = tmp_path / "other.pem"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"],
        check=True,
        stdout=other_key.open("wb"),
        timeout=scaled(30),
    )
    args, expect = {
        "cert only": (["--tls-cert", str(cert)], "both"),
        "key only": (["--tls-key", str(key)], "both"),
        "missing file": (
            ["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(key)],
            "cannot be read",
        ),
        "not a certificate": (["--tls-cert", str(junk), "--tls-key", str(key)], "not a valid"),
        "key mismatch": (["--tls-cert", str(cert), "--tls-key", str(other_key)], "not a valid"),
    }[case]
    run = subprocess.run(
        [sys.executable, "-m", "omnifabric.edge", "--port", "0", "--grpc-port", "-1", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert run.returncode == 2, run.stderr
    assert expect in run.stderr and "Traceback" not in run.stderr


async def scheduler_leases(stack: Stack) -> int:
    """Leases the scheduler holds on its workers now."""
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

    async with grpc.aio.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        status = await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))
    return sum(len(w.lease_ids) for w in status.workers)


@pytest.mark.ci_long  # chat requests held to a key's limit: ~5 s (tests/conftest.py)
async def test_post_api_chat_counts_against_the_key_session_limit(stack, tmp_path):
    """POST /api/chat holds one of its key's sessions while its turn runs: over the limit
    it gets 429 (as the WebSocket endpoints do), and while it runs the key's other
    requests are refused; the slot comes back when the answer is sent."""
    from tests.e2e.wsclient import post_json

    keys = tmp_path / "keys"
    keys.write_text("sk-post-epsilon max_sessions=1\n")
    stack.start_scheduler()
    # Each chat turn computes for 1.5 s: long enough to look at the key while it runs.
    stack.start_worker("--slots", "2", "--compute-ms", "1500")
    stack.start_edge("--api-keys-file", str(keys))
    base = stack.url.split("/v1/")[0]
    api = base.replace("ws://", "http://") + "/api/chat"
    chat = f"{stack.url}?mode=chat"
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hello"}], "tts": {"enabled": False}}
    ).encode()
    key = bearer("sk-post-epsilon")

    def post(headers: dict[str, str] | None = None) -> tuple[int, dict]:
        return post_json(api, body, headers)

    # No key, or a wrong one: 401 as before.
    assert (await asyncio.to_thread(post))[0] == 401
    assert (await asyncio.to_thread(post, bearer("sk-wrong")))[0] == 401
    # A WebSocket session holds the key's only slot: the POST is refused with a reason.
    holder = await WsClient.open(chat, additional_headers=key)
    await holder.until("session.queue_done")
    status, answer = await asyncio.to_thread(post, key)
    assert status == 429, answer
    assert answer["success"] is False and answer["error"] == "too_many_sessions"
    assert "limit" in answer["message"]
    await holder.close()
    # While a POST's turn runs (its worker lease is out), the key is at its limit.
    deadline = time.monotonic() + scaled(5)
    while True:
        running = asyncio.ensure_future(asyncio.to_thread(post, key))
        while not running.done() and await scheduler_leases(stack) == 0:
            await asyncio.sleep(0.02)
        if not running.done():
            break
        # The holder's slot was not back yet when this POST came: it was refused.
        assert running.result()[0] == 429 and time.monotonic() < deadline
    status, body_text = await refused(chat, "sk-post-epsilon")
    assert status == 429 and "limit" in body_text
    assert (await asyncio.to_thread(post, key))[0] == 429
    assert not running.done(), "the turn ended before the checks: they proved nothing"
    status, answer = await running
    assert status == 200 and answer["text"] == "You said: hello"
    # Its slot is back once the answer is out.
    again = await WsClient.open(chat, additional_headers=key)
    await again.until("session.queue_done")
    await again.close()
    assert "sk-post-epsilon" not in stack.edge.log()


# ---- browser keys: `bearer.<key>` subprotocol, pages without a key --------------------


async def test_browser_key_as_bearer_subprotocol(stack, tmp_path):
    """Browsers cannot set Authorization on a WebSocket: a `bearer.<key>` subprotocol
    counts as the header does (401 unknown, per-key limit), only map.realtime is selected
    (the key is never echoed), and the web client's pages load without a key while
    /status still needs one."""
    import http.client

    keys = tmp_path / "keys"
    keys.write_text("sk-browser-zeta max_sessions=1\n")
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--api-keys-file", str(keys))
    audio = f"{stack.url}?mode=audio"
    offer = ["map.realtime", "bearer.sk-browser-zeta"]
    client = await WsClient.open(audio, subprotocols=offer)
    assert client.ws.subprotocol == "map.realtime"
    assert client.ws.response.headers["Sec-WebSocket-Protocol"] == "map.realtime"
    await client.start()
    await client.append(SILENCE)
    # A unit goes through: the session runs on the subprotocol key.
    await client.until("delta.listen", "delta.text", "delta.audio")
    # The subprotocol key holds the key's only session, as a header key would.
    for kwargs in ({"subprotocols": offer}, {"additional_headers": bearer("sk-browser-zeta")}):
        with pytest.raises(InvalidStatus) as info:
            await WsClient.open(audio, **kwargs)
        assert info.value.response.status_code == 429
    # Unknown key, or none: refused before the upgrade.
    for protocols in (["map.realtime", "bearer.sk-wrong"], ["map.realtime"]):
        with pytest.raises(InvalidStatus) as info:
            await WsClient.open(audio, subprotocols=protocols)
        assert info.value.response.status_code == 401
    # A key without map.realtime would get no subprotocol back, which browsers reject
    # without a word: the edge says why instead.
    with pytest.raises(InvalidStatus) as info:
        await WsClient.open(audio, subprotocols=["bearer.sk-browser-zeta"])
    assert info.value.response.status_code == 400
    assert b"map.realtime" in info.value.response.body
    await client.close()

    host, port = stack.url.split("//")[1].split("/")[0].rsplit(":", 1)

    def get(path: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=scaled(10))
        try:
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type") or "", resp.read()
        finally:
            conn.close()

    status, ctype, body = await asyncio.to_thread(get, "/admin")
    assert status == 200 and ctype.startswith("text/html") and b"admin.js" in body
    status, ctype, _ = await asyncio.to_thread(get, "/static/js/admin.js")
    assert status == 200 and ctype.startswith("text/javascript")
    assert (await asyncio.to_thread(get, "/status"))[0] == 401
    assert (await asyncio.to_thread(get, "/status", bearer("sk-browser-zeta")))[0] == 200
    assert "sk-browser-zeta" not in stack.edge.log_path.read_text()
