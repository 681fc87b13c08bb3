"""Smoke-test every public surface of a running edge from one script:
/v1/realtime in audio, video and chat modes, legacy /ws/chat and /ws/duplex/{id}.

    python -m omnifabric.tools.smoke --url ws://127.0.0.1:8006

Prints one line per surface and exits 1 if any fails. Works on any engine; it checks the
protocol (events, fields, order), not what the model says.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

TIMEOUT_S = 60.0
SILENCE = np.zeros(16000, np.float32)


def _b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<f4").tobytes()).decode()


def _jpeg() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 90, 160)).save(buf, "JPEG")
    return base64.b64encode(buf.getvalue()).decode()


class Check(Exception):
    """A protocol expectation that did not hold."""


async def _recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))


async def _until(ws: ClientConnection, *types: str) -> dict[str, Any]:
    while True:
        event = await _recv(ws)
        if event.get("type") == "error":
            raise Check(f"error event: {event.get('error')}")
        if event.get("type") in types:
            return event


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Check(what)


async def realtime_duplex(base: str, mode: str, units: int) -> str:
    url = f"{base}/v1/realtime?mode={mode}"
    async with connect(url, subprotocols=[Subprotocol("map.realtime")]) as ws:
        await _until(ws, "session.queue_done")
        await ws.send(json.dumps({"type": "session.init", "payload": {"system_prompt": "smoke"}}))
        created = await _until(ws, "session.created")
        expect(created.get("mode") == "full_duplex", "session.created mode is full_duplex")
        seen = 0
        for _ in range(units):
            body: dict[str, Any] = {"audio": _b64(SILENCE)}
            if mode == "video":
                body["video_frames"] = [_jpeg()]
            await ws.send(json.dumps({"type": "input.append", "input": body}))
            event = await _until(ws, "response.output.delta")
            expect(isinstance(event.get("text", ""), str), "delta text is a string")
            expect("kv_cache_length" in event.get("metrics", {}), "metrics.kv_cache_length")
            seen += 1
        await ws.send(json.dumps({"type": "session.close", "reason": "user_stop"}))
        closed = await _until(ws, "session.closed")
        expect(closed.get("reason") == "user_stop", "session.closed echoes the reason")
        expect("usage" in closed, "session.closed carries usage")
    return f"{seen} units answered, closed {closed['reason']}"


async def realtime_chat(base: str) -> str:
    async with connect(f"{base}/v1/realtime?mode=chat") as ws:
        await _until(ws, "session.queue_done")
        await ws.send(json.dumps({"type": "session.init", "payload": {}}))
        created = await _until(ws, "session.created")
        expect(created.get("mode") == "turn_based", "session.created mode is turn_based")
        await ws.send(
            json.dumps(
                {
                    "type": "input.append",
                    "input": {
                        "messages": [{"role": "user", "content": "Reply with exactly: test"}],
                        "streaming": True,
                        "generation": {"max_new_tokens": 32},
                        "tts": {"enabled": False},
                    },
                }
            )
        )
        done = await _until(ws, "response.done")
        expect(done.get("reason") in ("turn_end", "max_tokens"), "response.done reason")
        expect(isinstance(done.get("text"), str) and done["text"], "response.done text")
        expect("usage" in done, "response.done usage")
        await ws.send(json.dumps({"type": "session.close"}))
        await _until(ws, "session.closed")
    return f"reply {done['text'][:40]!r}"


async def legacy_chat(base: str) -> str:
    async with connect(f"{base}/ws/chat") as ws:
        await ws.send(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "streaming": True,
                    "generation": {"max_new_tokens": 32},
                    "tts": {"enabled": True},
                }
            )
        )
        events = []
        async for message in ws:
            events.append(json.loads(message))
    kinds = [e["type"] for e in events if e["type"] not in ("queued", "queue_update")]
    expect(kinds[:2] == ["queue_done", "prefill_done"], f"queue_done, prefill_done first: {kinds}")
    expect(kinds[-1] == "done", "done last, then the server closes")
    done = events[-1]
    for key in ("text", "generated_tokens", "input_tokens", "audio_data", "recording_session_id"):
        expect(key in done, f"done.{key}")
    return f"{kinds.count('chunk')} chunks, reply {done['text'][:40]!r}"


async def legacy_duplex(base: str) -> str:
    session_id = f"adx_smoke_{int(time.time() * 1000)}"
    async with connect(f"{base}/ws/duplex/{session_id}") as ws:
        await _until(ws, "queue_done")
        await ws.send(json.dumps({"type": "prepare", "system_prompt": "smoke", "config": {}}))
        prepared = await _until(ws, "prepared")
        expect(prepared.get("prompt_length", 0) > 0, "prepared.prompt_length")
        fields = (
            "is_listen",
            "text",
            "audio_data",
            "end_of_turn",
            "kv_cache_length",
            "wall_clock_ms",
            "cost_llm_ms",
            "cost_tts_ms",
            "cost_all_ms",
            "n_tokens",
            "n_tts_tokens",
            "server_send_ts",
        )
        for _ in range(3):
            await ws.send(json.dumps({"type": "audio_chunk", "audio_base64": _b64(SILENCE)}))
            result = await _until(ws, "result")
            missing = [f for f in fields if f not in result]
            expect(not missing, f"result fields missing: {missing}")
        await ws.send(json.dumps({"type": "pause", "timeout": 30}))
        await _until(ws, "paused")
        await ws.send(json.dumps({"type": "resume"}))
        await _until(ws, "resumed")
        await ws.send(json.dumps({"type": "stop"}))
        await _until(ws, "stopped")
    return "3 results, pause/resume, stopped"


async def run(base: str) -> int:
    checks: list[tuple[str, Callable[[], Awaitable[str]]]] = [
        ("/v1/realtime?mode=audio", lambda: realtime_duplex(base, "audio", 4)),
        ("/v1/realtime?mode=video", lambda: realtime_duplex(base, "video", 4)),
        ("/v1/realtime?mode=chat", lambda: realtime_chat(base)),
        ("/ws/chat", lambda: legacy_chat(base)),
        ("/ws/duplex/{adx_id}", lambda: legacy_duplex(base)),
    ]
    failed = 0
    for name, check in checks:
        t0 = time.monotonic()
        try:
            detail = await check()
            print(f"ok    {name:26s} {time.monotonic() - t0:5.1f}s  {detail}", flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next runs
            failed += 1
            print(f"FAIL  {name:26s} {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8006", help="the edge's ws:// base")
    args = parser.parse_args(argv)
    base = args.url.split("/v1/")[0].rstrip("/")
    return asyncio.run(run(base))


if __name__ == "__main__":
    sys.exit(main())
