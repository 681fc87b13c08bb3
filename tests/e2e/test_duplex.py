"""End to end: real scheduler, worker and edge processes on 127.0.0.1, real clients."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.request

import grpc
import pytest
from PIL import Image
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc
from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH, WsClient
from tests.stack import Stack, start_service

# Units: startup protection (3 listen), speech, then silence for the reply.
SCRIPT = [SILENCE] * 3 + [SPEECH] * 2 + [SILENCE] * 7


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "2", "--compute-ms", "20")
        s.start_edge()
        yield s
    finally:
        s.stop()


def url(stack: Stack, mode: str = "audio", **query: str) -> str:
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{stack.url}?mode={mode}{extra}"


async def run_script(client: WsClient, dialect: str, units=SCRIPT, frames=None) -> list[dict]:
    """Send the units at 50 ms spacing; collect one outcome per unit."""
    outcomes = []
    for i, unit in enumerate(units):
        extra = {"video_frames": frames} if frames else {}
        await client.append(unit, dialect, **extra)
        if dialect == "first":
            event = await client.until("response.listen", "response.output_audio.delta")
            outcomes.append(event)
        else:
            event = await client.until("delta.listen", "delta.audio")
            outcomes.append(event)
            if event["kind"] == "audio" and event["metrics"]["seq"] == i + 1:
                pass
    return outcomes


async def test_audio_current_dialect(stack):
    client = await WsClient.open(url(stack, model="minicpmo-4.5"), subprotocols=["map.realtime"])
    assert client.ws.subprotocol == "map.realtime"
    created = await client.start("current")
    assert created["mode"] == "full_duplex" and created["session_id"].startswith("rt_")
    assert client.events[0]["type"] == "session.queue_done"
    kinds = []
    for unit in SCRIPT:
        await client.append(unit)
        event = await client.until("delta.listen", "delta.audio")
        kinds.append(event["kind"])
        if event["kind"] == "audio":
            assert event["usage"]["input_tokens_details"]["audio_tokens"] > 0
            assert len(base64.b64decode(event["audio"])) % 4 == 0
    assert kinds[:5] == ["listen"] * 5
    assert "audio" in kinds
    texts = [e for e in client.events if e.get("kind") == "text"]
    assert texts and all(isinstance(e["text"], str) and e["text"] for e in texts)
    # The turn's last audio delta is followed by a listen delta (turn boundary).
    listen_after_audio = [
        i
        for i, e in enumerate(client.events[:-1])
        if e.get("kind") == "audio" and client.events[i + 1].get("kind") == "listen"
    ]
    assert listen_after_audio
    assert all(
        e["metrics"]["kv_cache_length"] > 0 for e in client.events if e.get("kind") == "listen"
    )
    await client.send({"type": "session.close", "reason": "user_stop"})
    closed = await client.until("session.closed")
    assert closed["reason"] == "user_stop"
    assert closed["usage"]["total_tokens"] > 0


async def test_audio_first_dialect_without_subprotocol(stack):
    client = await WsClient.open(url(stack))
    assert client.ws.subprotocol is None
    created = await client.start("first")
    assert "prompt_length" in created and created["prompt_length"] > 0
    outcomes = await run_script(client, "first")
    types = [e["type"] for e in outcomes]
    assert types[:5] == ["response.listen"] * 5
    speak = [e for e in outcomes if e["type"] == "response.output_audio.delta"]
    assert speak and speak[-1]["end_of_turn"] is True
    assert all(isinstance(e["text"], str) and "kv_cache_length" in e for e in speak)
    assert len(base64.b64decode(speak[1]["audio"])) == 24000 * 4  # middle chunk: 1 s
    await client.send({"type": "session.close"})
    closed = await client.until("session.closed")
    assert closed["reason"] == "stopped"


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 120, 200)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("dialect", ["current", "first"])
async def test_video_flow_and_broken_jpeg(stack, dialect):
    client = await WsClient.open(url(stack, "video"))
    await client.start(dialect)
    raw = _jpeg()
    frame = base64.b64encode(raw).decode()
    broken = base64.b64encode(raw[: len(raw) // 2]).decode()
    outcomes = await run_script(client, dialect, frames=[frame])
    assert any(
        e.get("kind") == "audio" or e["type"] == "response.output_audio.delta" for e in outcomes
    )
    speak = [e for e in outcomes if "usage" in e]
    assert speak[-1]["usage"]["input_tokens_details"]["vision_tokens"] > 0
    await client.append(SILENCE, dialect, video_frames=[broken])
    err = await client.until("error")
    assert err["error"]["code"] == "invalid_payload"
    assert err["error"]["message"] == "video_frames[0] is a broken JPEG image"
    # The session stays usable after a client error.
    await client.append(SILENCE, dialect, video_frames=[frame])
    await client.until(
        "delta.listen", "delta.audio", "response.listen", "response.output_audio.delta"
    )
    await client.send({"type": "session.close"})
    closed = await client.until("session.closed")
    assert closed["reason"] == ("user_stop" if dialect == "current" else "stopped")


async def test_client_errors_keep_session_usable(stack):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    await client.append(SILENCE)
    assert (await client.until("error"))["error"]["code"] == "not_ready"
    await client.send({"type": "session.init", "payload": {"system_prompt": "x"}})
    await client.until("session.created")
    await client.send({"type": "session.init", "payload": {}})
    assert (await client.until("error"))["error"]["code"] == "invalid_event"
    await client.send({"type": "no.such.event"})
    assert (await client.until("error"))["error"]["code"] == "unknown_event"
    await client.send({"type": "input.append", "input": {}})
    assert (await client.until("error"))["error"]["code"] == "missing_field"
    await client.send({"type": "input.append", "input": {"audio": "%%%"}})
    err = await client.until("error")
    assert err["error"] == {
        "code": "invalid_payload",
        "message": "audio base64 decode failed",
        "type": "client_error",
    }
    await client.append(SILENCE)
    event = await client.until("delta.listen", "delta.audio")
    assert event["metrics"]["seq"] == 1  # none of the bad units reached the worker
    await client.send({"type": "session.close"})
    await client.until("session.closed")


#: What the edge says to a max_slice_nums of 5: the range is the worker's own (its engine's
#: limits, from its registration, handed to the edge with the lease).
SLICES_REFUSED = "max_slice_nums: 5; this server takes 1 to 2"


@pytest.mark.parametrize("dialect", ["current", "first"])
async def test_slices_outside_the_workers_range_are_refused_and_init_can_be_retried(stack, dialect):
    """Issue 17, defect 3: a max_slice_nums the worker does not take gets an immediate
    `invalid_payload` naming the range (not worker_connect_failed and close 1013), the
    connection stays open and a corrected init starts the session; a unit's own
    max_slice_nums outside the range is refused the same way and never reaches the worker."""
    client = await WsClient.open(url(stack, "video"))
    await client.until("session.queue_done", timeout_s=30)

    def init(slices: int) -> dict:
        if dialect == "first":
            return {
                "type": "session.update",
                "session": {"instructions": "hi", "max_slice_nums": slices},
            }
        return {
            "type": "session.init",
            "payload": {"system_prompt": "hi", "max_slice_nums": slices},
        }

    await client.send(init(5))
    err = await client.until("error", "session.created", "session.closed")
    assert err == {
        "type": "error",
        "error": {"code": "invalid_payload", "message": SLICES_REFUSED, "type": "client_error"},
    }
    await client.send(init(2))
    await client.until("session.created")
    await client.append(SILENCE, dialect, max_slice_nums=5)
    err = await client.until("error")
    assert err["error"]["code"] == "invalid_payload"
    assert err["error"]["message"] == SLICES_REFUSED
    await client.append(SILENCE, dialect, max_slice_nums=1)
    event = await client.until(
        "delta.listen", "delta.audio", "response.listen", "response.output_audio.delta"
    )
    assert event["metrics"]["seq"] == 1  # the refused unit never reached the worker
    assert not any(e["type"] == "session.closed" for e in client.events)
    await client.send({"type": "session.close"})
    await client.until("session.closed")


async def test_grpc_slices_outside_the_workers_range(stack):
    """RealtimeService: an init outside the worker's range ends the call with
    INVALID_ARGUMENT naming the range; a unit outside it is an `error` event."""
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        init = rt_pb.SessionInit(mode=common_pb2.MODE_VIDEO, system_prompt="hi", max_slice_nums=5)
        await call.write(rt_pb.ConnectRequest(init=init))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:  # queue_done comes first
                msg = await asyncio.wait_for(call.read(), scaled(10))
                assert msg is not grpc.aio.EOF and msg.WhichOneof("kind") != "created", msg
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == f"invalid_payload: {SLICES_REFUSED}"

        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        init = rt_pb.SessionInit(mode=common_pb2.MODE_VIDEO, system_prompt="hi", max_slice_nums=2)
        await call.write(rt_pb.ConnectRequest(init=init))
        while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
            pass
        pcm = SILENCE.astype("<f4").tobytes()
        await call.write(
            rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcm, max_slice_nums=5))
        )
        err = await asyncio.wait_for(call.read(), scaled(10))
        assert err.WhichOneof("kind") == "error", err
        assert (err.error.code, err.error.message) == ("invalid_payload", SLICES_REFUSED)
        await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcm)))
        out = await asyncio.wait_for(call.read(), scaled(10))
        assert out.WhichOneof("kind") == "output" and out.output.seq == 1
        await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest()))
        while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "closed":
            pass


async def test_invalid_json_closes_1003(stack):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    await client.ws.send("{this is not json")
    with pytest.raises(ConnectionClosed) as info:
        await client.recv()
    assert info.value.rcvd.code == 1003


async def test_close_while_waiting_for_init_and_healthz(stack):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    await client.send({"type": "session.close", "reason": "changed_mind"})
    closed = await client.until("session.closed")
    assert closed["reason"] == "changed_mind"
    host_port = stack.url.split("/")[2]
    with urllib.request.urlopen(f"http://{host_port}/healthz", timeout=scaled(5)) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


async def test_unknown_mode_is_rejected(stack):
    client = await WsClient.open(url(stack, "hologram"))
    err = await client.recv()
    assert err["type"] == "error" and err["error"]["code"] == "invalid_payload"


async def test_unknown_path_404(stack):
    with pytest.raises(InvalidStatus) as info:
        async with connect(stack.url.replace("/v1/realtime", "/nope")):
            pass
    assert info.value.response.status_code == 404


@pytest.mark.parametrize("dialect", ["current", "first"])
async def test_context_full_closes_session(stack, dialect):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    if dialect == "first":
        await client.send(
            {
                "type": "session.update",
                "session": {"instructions": "x", "config": {"max_kv_tokens": 64}},
            }
        )
    else:
        await client.send(
            {
                "type": "session.init",
                "payload": {"system_prompt": "x", "config": {"max_kv_tokens": 64}},
            }
        )
    await client.until("session.created")
    closed = None
    for _ in range(10):
        await client.append(SILENCE, dialect)
        event = await client.until("session.closed", "response.listen", "delta.listen")
        if event["type"] == "session.closed":
            closed = event
            break
        kv = event.get("kv_cache_length", event.get("metrics", {}).get("kv_cache_length", 0))
        if kv >= 64:  # the session ends now: appending again would race the close
            closed = await client.until("session.closed")
            break
    assert closed is not None and closed["reason"] == "context_full"
    kv = [
        e["metrics"]["kv_cache_length"]
        for e in client.events
        if "metrics" in e and "seq" in e["metrics"]
    ]
    assert kv[-1] >= 64 and kv == sorted(kv)


async def test_invalid_utf8_closes_1007(stack):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    await client.ws.send(b'{"type": "\xff\xfe"}', text=True)
    with pytest.raises(ConnectionClosed) as info:
        await client.recv()
    assert info.value.rcvd.code == 1007


async def test_oversized_frame_closes_1009(stack):
    client = await WsClient.open(url(stack))
    await client.until("session.queue_done")
    await client.ws.send(
        '{"type": "input.append", "input": {"audio": "' + "A" * (16 * 1024 * 1024) + '"}}'
    )
    with pytest.raises(ConnectionClosed) as info:
        await client.recv()
    assert info.value.rcvd.code == 1009


async def test_status_endpoint(stack):
    client = await WsClient.open(url(stack))
    created = await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen", "delta.audio")
    host_port = stack.url.split("/")[2]

    def get():
        with urllib.request.urlopen(f"http://{host_port}/status", timeout=scaled(5)) as resp:
            return resp.status, json.loads(resp.read())

    status, body = await asyncio.to_thread(get)
    assert status == 200
    [worker] = body["workers"]
    assert worker["engine"] == "synthetic" and worker["health"] == "serving"
    assert worker["slots"] == 2 and worker["leases"] >= 1 and "memory" in worker
    # The worker's engine limits, as its registration declared them to the scheduler.
    assert worker["limits"] == {"max_slice_nums": [1, 2], "unit_samples": [4000, 64000]}
    assert body["slots"]["total"] == 2 and body["queue"] == {"length": 0, "max": 100}
    [mine] = [s for s in body["sessions"] if s["session_id"] == created["session_id"]]
    assert mine["mode"] == "audio" and mine["units"] == 1
    assert mine["worker_id"] == worker["worker_id"] and mine["started"] is True
    assert mine["late_units"] == 0  # its units answered within their length (issue 37)
    assert set(mine) == {"session_id", "mode", "worker_id", "started", "units", "late_units"}
    # The worker's real-time headroom: engine seconds per session, late units, what it takes.
    room = worker["headroom"]
    assert room["engine_threads"] >= 1 and set(room["session_cost"]) == set(worker["modes"])
    assert room["late_units_recent"] == 0 and "audio" in worker["admits"]


async def test_grpc_reports_what_the_json_dialects_report(stack):
    """The same units over WebSocket (the current dialect's metrics, the legacy duplex
    endpoint's engine costs) and RealtimeService: every unit's timings with the engine's
    per-phase costs, token counts and usage reach the gRPC client too, from the same domain
    result (issue 17, defect 4: engine_costs_ms was dropped)."""
    client = await WsClient.open(url(stack))
    await client.start("current")
    for seq, unit in enumerate(SCRIPT, 1):
        await client.append(unit)
        # This unit's own result before the next unit (the worker keeps only the newest
        # unit waiting: a unit sent early may be replaced, which is not what this compares).
        while (await client.until("response.output.delta"))["metrics"]["seq"] < seq:
            pass
    await client.send({"type": "session.close"})
    await client.until("session.closed")
    json_units = {}
    for event in client.events:
        if event["type"] == "response.output.delta":
            json_units.setdefault(event["metrics"]["seq"], event)

    legacy = await WsClient.open(stack.url.replace("/v1/realtime", "/ws/duplex/adx_costs"))
    await legacy.until("queue_done")
    await legacy.send({"type": "prepare"})
    await legacy.until("prepared")
    legacy_units = []
    for unit in SCRIPT:
        audio = base64.b64encode(unit.astype("<f4").tobytes()).decode()
        await legacy.send({"type": "audio_chunk", "audio_base64": audio})
        legacy_units.append(await legacy.until("result"))
    await legacy.send({"type": "stop"})
    await legacy.until("stopped")

    grpc_units = {}
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        await call.write(rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO)))
        while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
            pass
        for unit in SCRIPT:
            pcm = unit.astype("<f4").tobytes()
            await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcm)))
            response = await asyncio.wait_for(call.read(), scaled(10))
            assert response.WhichOneof("kind") == "output", response
            grpc_units[response.output.seq] = response.output
        await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest()))
        closed = await asyncio.wait_for(call.read(), scaled(10))
        assert closed.WhichOneof("kind") == "closed"
        assert closed.closed.usage.total_tokens > 0

    assert sorted(grpc_units) == sorted(json_units) == list(range(1, len(SCRIPT) + 1))
    spoke = [s for s, out in grpc_units.items() if not out.is_listen]
    assert spoke, "the synthetic engine answers the speech units"
    for seq, out in grpc_units.items():
        metrics = json_units[seq]["metrics"]
        costs = out.timings.engine_costs_ms
        # The synthetic engine reports prefill, llm, tts and all costs for every unit; the
        # legacy result carries two of them.
        assert set(costs) == {"prefill", "llm", "tts", "all"}, seq
        assert all(legacy_units[seq - 1][f"cost_{k}_ms"] >= 0 for k in ("llm", "tts"))
        assert costs["all"] >= costs["llm"] >= 0 and out.timings.wall_clock_ms > 0
        assert (out.n_tokens, out.n_tts_tokens) == (metrics["n_tokens"], metrics["n_tts_tokens"])
    assert any(grpc_units[s].n_tts_tokens > 0 for s in spoke)
    assert all(grpc_units[s].usage.total_tokens > 0 for s in spoke)


async def test_compression_is_off_unless_configured(stack, tmp_path):
    # Default: a client's permessage-deflate offer is declined; the session runs plain.
    plain = await WsClient.open(url(stack), compression="deflate")
    assert plain.ws.protocol.extensions == []
    await plain.start()
    await plain.append(SILENCE)
    await plain.until("delta.listen", "delta.audio")
    # --ws-compression deflate: the offer is taken and the session runs compressed.
    edge = start_service(
        "edge-deflate",
        "omnifabric.edge",
        [
            "--port",
            "0",
            "--grpc-port",
            "-1",
            "--scheduler",
            stack.scheduler_address,
            "--ws-compression",
            "deflate",
        ],
        tmp_path,
    )
    try:
        deflate = await WsClient.open(f"{edge.wait_ready()[0]}?mode=audio", compression="deflate")
        [extension] = deflate.ws.protocol.extensions
        assert extension.name == "permessage-deflate"
        await deflate.start()
        await deflate.append(SILENCE)
        await deflate.until("delta.listen", "delta.audio")
        await deflate.ws.close()
    finally:
        edge.stop()


async def test_the_reference_servers_operator_views(stack):
    """GET /health, /workers, /cache and the /status fields the reference server's clients
    read, and its page paths leading to ours."""
    client = await WsClient.open(url(stack))
    created = await client.start()
    await client.append(SILENCE)
    await client.until("delta.listen", "delta.audio")
    base = "http://" + stack.url.split("/")[2]

    def get(path: str) -> tuple[int, dict, str]:
        request = urllib.request.Request(base + path)
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=scaled(5)) as resp:
                return resp.status, dict(resp.headers), resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read().decode()

    status, _, text = await asyncio.to_thread(get, "/health")
    assert status == 200 and json.loads(text)["status"] == "healthy"
    status, _, text = await asyncio.to_thread(get, "/workers")
    body = json.loads(text)
    assert status == 200 and body["total"] == 1
    [worker] = body["workers"]
    assert worker["status"] == "duplex_active" and worker["gpu_id"] == -1
    assert worker["current_session_id"] == created["session_id"]
    assert worker["current_request_type"] == "audio_duplex" and worker["port"] > 0
    status, _, text = await asyncio.to_thread(get, "/cache")
    assert json.loads(text) == {
        "workers": [{"worker_id": worker["worker_id"], "status": "duplex_active"}]
    }
    status, _, text = await asyncio.to_thread(get, "/status")
    summary = json.loads(text)
    assert (summary["total_workers"], summary["duplex_workers"], summary["idle_workers"]) == (
        1,
        1,
        0,
    )
    assert summary["max_queue_size"] == 100 and summary["gateway_healthy"] is True
    [task] = summary["running_tasks"]
    assert task["session_id"] == created["session_id"] and task["request_type"] == "audio_duplex"
    for path, target in (("/omni", "/video"), ("/turnbased", "/chat"), ("/audio_duplex", "/audio")):
        status, headers, _ = await asyncio.to_thread(get, path)
        assert (status, headers["Location"]) == (302, target)
    await client.close()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


async def test_grpc_session_calls_a_function_and_goes_on_from_its_output(stack):
    """Issue 53 on the RealtimeService: tools in the init, the model's call on an output,
    the client's tool_output request, and the reply that says the result (the synthetic
    engine calls the first function after a user turn)."""
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    weather = common_pb2.ToolSpec(name="get_weather", parameters_json=schema)
    init = rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO, tools=[weather])
    said = []
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        call = rt_grpc.RealtimeServiceStub(channel).Connect()
        await call.write(rt_pb.ConnectRequest(init=init))
        while (await asyncio.wait_for(call.read(), scaled(10))).WhichOneof("kind") != "created":
            pass
        calls = []
        for unit in SCRIPT:
            pcm = unit.astype("<f4").tobytes()
            await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcm)))
            out = (await asyncio.wait_for(call.read(), scaled(10))).output
            calls += list(out.tool_calls)
            said.append(out.text)
            if calls:
                break
        assert [c.name for c in calls] == ["get_weather"], said
        output = common_pb2.ToolOutput(call_id=calls[0].call_id, output="cloudy")
        await call.write(rt_pb.ConnectRequest(tool_output=output))
        for _ in range(3):
            pcm = SILENCE.astype("<f4").tobytes()
            await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcm)))
            said.append((await asyncio.wait_for(call.read(), scaled(10))).output.text)
        await call.write(rt_pb.ConnectRequest(close=rt_pb.SessionCloseRequest()))
    assert any(text.startswith("The result: cloudy") for text in said), said
