"""Turn-based chat through real processes: /v1/realtime?mode=chat and legacy /ws/chat."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import grpc
import numpy as np
import pytest
from PIL import Image
from websockets.asyncio.client import connect

from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import claimed_png, scaled
from tests.e2e.wsclient import WsClient
from tests.e2e.wsclient import post_json as _post
from tests.stack import Stack

#: An image whose header claims 20000 x 20000 pixels (base64).
BOMB = base64.b64encode(claimed_png(20000, 20000)).decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        s.start_worker("--slots", "1", "--compute-ms", "5")
        s.start_edge()
        yield s
    finally:
        s.stop()


def chat_url(stack: Stack) -> str:
    return f"{stack.url}?mode=chat&model=minicpm-o"


def legacy_url(stack: Stack) -> str:
    return stack.url.replace("/v1/realtime", "/ws/chat")


async def leases_active(stack: Stack, settle_s: float = 1.0) -> int:
    """Leases held on the workers, once returns in flight have settled (up to settle_s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(settle_s)
    async with grpc.aio.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        while True:
            status = await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))
            held = sum(len(w.lease_ids) for w in status.workers)
            if held == 0 or loop.time() > deadline:
                return held
            await asyncio.sleep(0.02)


async def test_chat_mode_streaming_and_non_streaming_turns(stack):
    client = await WsClient.open(chat_url(stack), subprotocols=["map.realtime"])
    assert (await client.recv())["type"] == "session.queue_done"
    await client.send({"type": "session.init", "payload": {}})
    created = await client.until("session.created")
    assert created["mode"] == "turn_based"
    assert await leases_active(stack) == 0  # no slot held between turns
    await client.send(
        {
            "type": "input.append",
            "input": {
                "messages": [{"role": "user", "content": "Reply with exactly: test"}],
                "streaming": True,
                "generation": {"max_new_tokens": 64, "length_penalty": 1.1},
                "tts": {"enabled": True},
            },
        }
    )
    done = await client.until("response.done")
    deltas = [e for e in client.events if e["type"] == "response.output.delta"]
    texts = [e["text"] for e in deltas if e["kind"] == "text"]
    assert len(texts) > 1 and "".join(texts) == done["text"] == "You said: Reply with exactly: test"
    assert any(e["kind"] == "audio" and base64.b64decode(e["audio"]) for e in deltas)
    assert done["reason"] == "turn_end" and done["usage"]["output_tokens"] > 0
    assert done["metrics"]["generated_tokens"] > 0
    assert await leases_active(stack) == 0
    # A second turn with the client's history, not streaming, text only.
    before = len(client.events)
    await client.send(
        {
            "type": "input.append",
            "input": {
                "messages": [
                    {"role": "user", "content": "Reply with exactly: test"},
                    {"role": "assistant", "content": done["text"]},
                    {"role": "user", "content": [{"type": "text", "text": "again"}]},
                ],
                "streaming": False,
                "tts": {"enabled": False},
            },
        }
    )
    done2 = await client.until("response.done")
    new = [e for e in client.events[before:] if e["type"] == "response.output.delta"]
    assert [e["kind"] for e in new] == ["text"] and new[0]["text"] == done2[
        "text"
    ] == "You said: again"
    assert done2["usage"]["total_tokens"] > done["usage"]["total_tokens"]  # cumulative
    await client.send({"type": "session.close", "reason": "user_stop"})
    closed = await client.until("session.closed")
    assert closed["reason"] == "user_stop"


async def test_chat_content_parts_and_errors(stack):
    client = await WsClient.open(chat_url(stack))
    await client.recv()
    await client.send({"type": "input.append", "input": {"messages": []}})
    assert (await client.until("error"))["error"]["code"] == "not_ready"
    await client.send({"type": "session.init", "payload": {}})
    await client.until("session.created")
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(buf, "PNG")
    audio_8k = base64.b64encode(np.zeros(8000, "<f4").tobytes()).decode()
    await client.send(
        {
            "type": "input.append",
            "input": {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "data": base64.b64encode(buf.getvalue()).decode()},
                            {"type": "audio", "data": audio_8k, "sample_rate": 8000},
                            {"type": "text", "text": "what is this?"},
                        ],
                    }
                ],
                "image": {"max_slice_nums": 2},
            },
        }
    )
    done = await client.until("response.done")
    # The 8 kHz second of audio arrives resampled to 16 kHz (1.0 s); the image is verified.
    assert "[audio 1.0 s]" in done["text"] and "[image" in done["text"]
    bad = [
        ({"messages": "hi"}, "invalid_payload"),
        ({}, "missing_field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_payload"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "invalid_payload"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "data": "aGk="}]}]},
            "invalid_payload",
        ),
        # A header claiming 20000 x 20000 pixels (PIL's DecompressionBombError escaped).
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "data": BOMB}]}]},
            "invalid_payload",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "generation": {"temperature": "hot"}},
            "invalid_payload",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tts": {"mode": "karaoke"}},
            "invalid_payload",
        ),
        # A voice of the wrong type, if falsy, was taken as none.
        (
            {"messages": [{"role": "user", "content": "x"}], "tts": {"ref_audio_data": []}},
            "invalid_payload",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tts": {"ref_audio_data": 0}},
            "invalid_payload",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tts": {"ref_audio_path": {}}},
            "invalid_payload",
        ),
        # An integer beyond float range is a bad number, not a crash (it closed with 1011).
        (
            {"messages": [{"role": "user", "content": "x"}], "generation": {"top_p": 10**400}},
            "invalid_payload",
        ),
    ]
    for body, code in bad:
        await client.send({"type": "input.append", "input": body})
        assert (await client.until("error"))["error"]["code"] == code, body
    await client.send({"type": "session.close"})
    await client.until("session.closed")


def without_queue(events: list[dict]) -> list[dict]:
    """Drop leading queued/queue_update events (the one slot may still be returning)."""
    while events and events[0]["type"] in ("queued", "queue_update"):
        assert "session." not in events[0]["type"] and events[0]["position"] >= 1
        events = events[1:]
    return events


async def test_legacy_ws_chat_streaming(stack):
    async with connect(legacy_url(stack)) as ws:
        await ws.send(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "Hello there!"}],
                    "streaming": True,
                    "generation": {"max_new_tokens": 256},
                    "tts": {"enabled": True},
                    "image": {"max_slice_nums": None},
                    "omni_mode": False,
                    "enable_thinking": False,
                }
            )
        )
        events = without_queue([json.loads(m) async for m in ws])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "queue_done" and kinds[1] == "prefill_done" and kinds[-1] == "done"
    assert set(kinds[2:-1]) == {"chunk"}
    assert events[1]["input_tokens"] > 0
    done = events[-1]
    assert done["text"] == "".join(e["text_delta"] for e in events if e["type"] == "chunk")
    assert done["text"] == "You said: Hello there!"
    assert done["generated_tokens"] > 0 and done["input_tokens"] > 0
    assert done["audio_data"] and "recording_session_id" in done


async def test_legacy_ws_chat_non_streaming_and_error(stack):
    async with connect(legacy_url(stack)) as ws:
        await ws.send(
            json.dumps({"messages": [{"role": "user", "content": "Hi"}], "streaming": False})
        )
        events = without_queue([json.loads(m) async for m in ws])
    assert [e["type"] for e in events] == ["queue_done", "prefill_done", "done"]
    full = np.frombuffer(base64.b64decode(events[-1]["audio_data"]), "<f4")
    assert full.size > 0  # the whole reply's audio at once
    async with connect(legacy_url(stack)) as ws:
        await ws.send(json.dumps({"messages": [{"role": "user"}]}))
        events = [json.loads(m) async for m in ws]
    assert [e["type"] for e in events] == ["error"]
    assert "content" in events[0]["error"]


def test_smoke_script_drives_every_surface(stack):
    """One script, every surface: the regression guard across all modes and endpoints."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    base = stack.url.split("/v1/")[0]
    run = subprocess.run(
        [sys.executable, "-m", "omnifabric.tools.cli", "smoke", "--url", base],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 passed, 0 failed" in run.stdout


def make_video(seconds: float = 2.5) -> bytes:
    """A small MP4 (mpeg4 video at 10 fps + AAC audio) made with PyAV."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = out.add_stream("aac", rate=16000)
        audio.layout = "mono"
        for i in range(int(seconds * 10)):
            img = Image.new("RGB", (64, 48), (i * 9 % 255, 80, 160))
            for packet in video.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        tone = (0.2 * np.sin(np.arange(int(seconds * 16000)) / 5)).astype(np.float32)
        for start in range(0, tone.size, 1024):
            chunk = tone[start : start + 1024].reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout="mono")
            frame.sample_rate, frame.pts = 16000, start
            for packet in audio.encode(frame):
                out.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode(None):
                out.mux(packet)
    return buf.getvalue()


async def test_chat_video_part_gives_frames_and_audio(stack):
    client = await WsClient.open(chat_url(stack))
    await client.recv()
    await client.send({"type": "session.init", "payload": {}})
    await client.until("session.created")
    data = base64.b64encode(make_video(2.5)).decode()
    await client.send(
        {
            "type": "input.append",
            "input": {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "video", "data": data, "stack_frames": 1}],
                    }
                ],
                "tts": {"enabled": False},
            },
        }
    )
    done = await client.until("response.done")
    # One frame per second (t = 0, 1, 2) and the audio track at 16 kHz.
    assert done["text"].count("[image") == 3, done["text"]
    assert "[audio 2.5 s]" in done["text"] or "[audio 2.6 s]" in done["text"], done["text"]
    await client.send(
        {
            "type": "input.append",
            "input": {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "video",
                                "data": base64.b64encode(b"not a video at all").decode(),
                            }
                        ],
                    }
                ]
            },
        }
    )
    err = await client.until("error")
    assert err["error"]["code"] == "invalid_payload" and "video" in err["error"]["message"]


async def test_post_api_chat_on_the_websocket_port(stack):
    import wave

    base = stack.url.replace("ws://", "http://").replace("/v1/realtime", "")
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Hello HTTP"}], "tts": {"enabled": True}}
    ).encode()
    status, answer = await asyncio.to_thread(_post, f"{base}/api/chat", body)
    assert status == 200, answer
    assert answer["success"] and answer["text"] == "You said: Hello HTTP"
    assert answer["generated_tokens"] > 0 and answer["input_tokens"] > 0
    with wave.open(io.BytesIO(base64.b64decode(answer["audio_data"]))) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    status, answer = await asyncio.to_thread(_post, f"{base}/api/chat", b"{not json")
    assert status == 400 and answer["error"] == "invalid_payload"
    status, answer = await asyncio.to_thread(_post, f"{base}/api/chat", b'{"messages": []}')
    assert status == 400 and answer["error"] == "invalid_payload"
    status, answer = await asyncio.to_thread(_post, f"{base}/api/nope", b"{}")
    assert status == 404
    # WebSocket clients on the same port are unaffected.
    client = await WsClient.open(chat_url(stack))
    assert (await client.recv())["type"] == "session.queue_done"


async def test_post_api_chat_answers_a_half_closed_request(stack):
    """A client that half-closes its side once the body is sent (curl, many HTTP clients)
    gets its answer; one that closes mid-body gets a 400 naming what was missing (issue 17,
    defect 2: the answer was never written)."""
    host, port = stack.url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "half"}]}).encode()

    async def exchange(payload: bytes) -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        writer.write(head + payload)
        await writer.drain()
        writer.write_eof()  # the half-close
        raw = await asyncio.wait_for(reader.read(), scaled(20))
        writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])

    status, answer = await exchange(body)
    assert status == 200, answer
    assert answer["success"] and answer["text"] == "You said: half"
    status, answer = await exchange(body[:10])
    assert status == 400 and "ended the request body early" in answer["message"], answer
