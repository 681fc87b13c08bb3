"""`omnifabric serve --engine minicpmo --model-dir <tiny> --device cpu` end to end (opt-in):
an SDK-style audio session (subprotocol map.realtime, session.init after queue_done, half-
second appends that the worker joins into model units) and a chat turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import websockets

from tests.e2e.wsclient import WsClient
from tests.worker.minicpmo.conftest import LAYOUTS, needs_code, tiny_serve

pytestmark = [needs_code, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(tiny_dirs):
    layout, code = LAYOUTS[0]
    with tiny_serve(tiny_dirs[code], layout) as (_, url):
        yield url


def test_audio_session_sdk_style(served):
    async def main():
        client = await WsClient.open(
            f"{served}?mode=audio&model=minicpm-o", subprotocols=["map.realtime"]
        )
        await client.until("session.queue_done", timeout_s=60)
        await client.send(
            {
                "type": "session.init",
                "payload": {"system_prompt": "Be brief.", "config": {"temperature": 0}},
            }
        )
        created = await client.until("session.created", timeout_s=60)
        rng = np.random.default_rng(3)
        for _ in range(8):  # 4 s of audio in half-second appends
            await client.append((0.05 * rng.standard_normal(8000)).astype(np.float32))
        deltas = []
        try:
            while len([d for d in deltas if d.get("kind") in ("listen", "text")]) < 4:
                event = await client.until("response.output.delta", timeout_s=60)
                deltas.append(event)
        except websockets.ConnectionClosed as exc:  # say what the server said before it
            last = [e for e in client.events if e.get("type") != "response.output.delta"]
            raise AssertionError(f"closed ({exc}) after {len(deltas)} deltas: {last[-4:]}") from exc
        await client.send({"type": "session.close", "payload": {"reason": "user_stop"}})
        closed = await client.until("session.closed", timeout_s=30)
        await client.close()
        return created, deltas, closed

    created, deltas, closed = asyncio.run(main())
    assert created["type"] == "session.created"
    assert closed["reason"] == "user_stop"
    assert not [e for e in deltas if e["type"] == "error"]
    # Startup protection: the model's first units listen; every listen carries its text.
    assert deltas[0]["kind"] == "listen" and deltas[0]["text"] == ""
    assert closed["usage"]["input_tokens_details"]["audio_tokens"] > 0


def test_video_session(served):
    """Audio with a camera frame per second; the vision tokens reach the usage."""
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(out, format="JPEG")
    frame = base64.b64encode(out.getvalue()).decode()

    async def main():
        client = await WsClient.open(f"{served}?mode=video", subprotocols=["map.realtime"])
        await client.until("session.queue_done", timeout_s=60)
        await client.send({"type": "session.init", "payload": {"system_prompt": "Look."}})
        await client.until("session.created", timeout_s=60)
        rng = np.random.default_rng(5)
        for _ in range(3):
            pcm = (0.05 * rng.standard_normal(16000)).astype(np.float32)
            await client.append(pcm, video_frames=[frame])
            await client.until("delta.listen", "delta.text", timeout_s=60)
        await client.send({"type": "session.close", "payload": {"reason": "user_stop"}})
        closed = await client.until("session.closed", timeout_s=30)
        await client.close()
        return client.events, closed

    events, closed = asyncio.run(main())
    assert not [e for e in events if e["type"] == "error"], events
    assert closed["usage"]["input_tokens_details"]["vision_tokens"] == 3 * 66


async def _chat(url: str, request: dict) -> tuple[list[dict], dict]:
    """One chat turn (`input.append` with `request`): every event, and response.done."""
    client = await WsClient.open(f"{url}?mode=chat&model=minicpm-o")
    await client.until("session.queue_done", timeout_s=60)
    await client.send({"type": "session.init", "payload": {}})
    await client.until("session.created", timeout_s=60)
    await client.send({"type": "input.append", "input": request})
    done = await client.until("response.done", timeout_s=300)
    await client.close()
    return client.events, done


def test_chat_turn(served):
    request = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "streaming": True,
        "generation": {"max_new_tokens": 8, "temperature": 0},
    }
    events, done = asyncio.run(_chat(served, request))
    assert not [e for e in events if e["type"] == "error"], events
    texts = [e for e in events if e.get("kind") == "text"]
    assert texts and done["text"]
    assert done["usage"]["output_tokens"] <= 8 and done["usage"]["input_tokens"] > 0


def test_half_duplex_call(served):
    """/ws/half_duplex on the model's chat path, prepared as the reference page does
    (system_content): the turn is heard, the answer streams to turn_done, the next turn goes
    on in the same call, stop ends it."""
    import base64
    import json

    from websockets.asyncio.client import connect

    from tests.worker.minicpmo.test_real_code import question

    speech = np.concatenate([question(), np.zeros(16000, np.float32)])

    async def main():
        seen = []

        async def until(ws, kind):
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(decode=True), 120))
                seen.append(event)
                assert event["type"] != "error", event
                if event["type"] == kind:
                    return event

        url = served.replace("/v1/realtime", "/ws/half_duplex/hd_tiny")
        async with connect(url) as ws:
            await until(ws, "queue_done")
            content = [
                {"type": "text", "text": "Be brief."},
                {"type": "audio", "data": None, "name": "", "duration": 0},
            ]
            generation = {"temperature": 0, "max_new_tokens": 40}
            await ws.send(
                json.dumps(
                    {
                        "type": "prepare",
                        "system_content": content,
                        "config": {"generation": generation},
                    }
                )
            )
            prepared = await until(ws, "prepared")
            done = []
            for _ in range(2):
                for i in range(0, speech.size, 8000):  # half-second chunks, in real time
                    audio = base64.b64encode(speech[i : i + 8000].tobytes()).decode()
                    await ws.send(json.dumps({"type": "audio_chunk", "audio_base64": audio}))
                    await asyncio.sleep(0.5)
                done.append(await until(ws, "turn_done"))
            await ws.send(json.dumps({"type": "stop"}))
            await until(ws, "stopped")
        return prepared, seen, done

    prepared, seen, done = asyncio.run(main())
    assert prepared["session_id"] == "hd_tiny"
    kinds = [e["type"] for e in seen]
    assert kinds.count("generating") == 2
    assert [d["turn_index"] for d in done] == [1, 2]
    first = seen[: kinds.index("turn_done") + 1]
    chunks = [e["text_delta"] for e in first if e["type"] == "chunk"]
    assert chunks and done[0]["text"] == "".join(chunks)


def test_chat_turn_with_speech(served):
    """A chat turn asking for speech streams audio deltas (the model's streaming path with
    the vocoder) beside its text."""
    import base64

    request = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "streaming": True,
        "tts": {"enabled": True},
        "generation": {"max_new_tokens": 12, "temperature": 0},
    }
    events, done = asyncio.run(_chat(served, request))
    assert not [e for e in events if e["type"] == "error"], events
    audio = [
        np.frombuffer(base64.b64decode(e["audio"]), "<f4")
        for e in events
        if e.get("kind") == "audio" and e.get("audio")
    ]
    assert audio and sum(a.size for a in audio) > 0
    assert all(np.isfinite(a).all() for a in audio)
    assert done["text"]


def test_openai_dialect_session_hears_speech(served):
    """The OpenAI Realtime dialect on the minicpmo worker, through the official SDK: the
    model's speech arrives as response.output_audio.delta (PCM16, 24 kHz)."""
    import base64

    openai = pytest.importorskip("openai")
    from tests.e2e.test_default_voice import http_url
    from tests.e2e.test_openai_realtime import speak, until

    async def main():
        seen: list = []
        api = openai.AsyncOpenAI(base_url=http_url(served, "/v1"), api_key="k", max_retries=0)
        async with api.realtime.connect(model="minicpm-o-4.5") as conn:
            await until(conn, "session.created", timeout_s=120)
            await speak(conn, seconds=4.0)
            await until(conn, "response.output_audio.delta", timeout_s=300, seen=seen)
        return seen

    seen = asyncio.run(main())
    assert not [e for e in seen if e.type == "error"], seen
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type.endswith("audio.delta"))
    assert len(audio) > 0 and len(audio) % 2 == 0
