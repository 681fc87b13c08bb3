"""The OpenAI Realtime dialect against the MiniCPM-o one, on the same stack in the same run.

    python -m omnifabric.tools.openai_ab [--sessions 8] [--url ws://HOST:PORT/v1/realtime]

Two figures:
- the edge's own work per 1 s unit, in-process (no network): the MiniCPM-o dialect takes a
  unit as one float32 16 kHz append and renders its answer; the OpenAI one takes five
  0.2 s appends (24 kHz PCM16, or 8 kHz G.711), cuts and resamples the unit, and renders
  the answer in the session's output format (PCM16 24 kHz, or G.711 8 kHz);
- first reply audio after the end of speech, through a whole stack: sessions alternate
  between the dialects, both clients stream the same audio in real time (3 s of silence,
  2 s of a loud tone, then silence until the reply's first audio); the time from the last
  speech sample sent to the first reply audio received. Without `--url` it starts a
  scheduler, a synthetic worker (20 ms a unit) and an edge on free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.edge import events as ev
from omnifabric.edge import g711, pcm
from omnifabric.edge.cadence import PacedCadence
from omnifabric.edge.dialects.base import SessionFacts
from omnifabric.edge.dialects.openai import OpenAIRealtime
from omnifabric.edge.dialects.realtime import RealtimeDuplex
from omnifabric.tools.client import SILENCE_UNIT, run_session

SPEECH_UNIT = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)
UNITS = [SILENCE_UNIT] * 3 + [SPEECH_UNIT] * 2
CHUNK_S = 0.2


def _answer(seq: int) -> ev.Output:
    reply = np.full(24000, 0.1, "<f4").tobytes()
    return ev.Output(seq, False, "Hello there.", reply, False, 0, {}, ev.Usage())


def micro(units: int = 300) -> dict[str, float]:
    """Microseconds of edge work per unit, by dialect and audio format."""
    out: dict[str, float] = {}
    unit_json = json.dumps(
        {
            "type": "input.append",
            "input": {"audio": base64.b64encode(SPEECH_UNIT.tobytes()).decode()},
        }
    )
    minicpmo = RealtimeDuplex("audio")
    minicpmo.decode(json.dumps({"type": "session.init", "payload": {}}))
    minicpmo.encode(ev.Created("rt_1", 10))
    t0 = time.perf_counter()
    for seq in range(1, units + 1):
        minicpmo.decode(unit_json)
        minicpmo.encode(_answer(seq))
    out["minicpm-o"] = (time.perf_counter() - t0) / units * 1e6
    tone24 = (0.3 * np.sin(2 * np.pi * 220 * np.arange(4800) / 24000) * 32767).astype("<i2")
    formats = {
        "openai pcm16 24k": ("audio/pcm", tone24.tobytes()),
        "openai g711 mu-law 8k": ("audio/pcmu", g711.mulaw_encode(tone24[::3])),
    }
    for name, (kind, chunk) in formats.items():
        dialect = OpenAIRealtime("m")
        fmt = {"type": kind}
        session = {"audio": {"input": {"format": fmt}, "output": {"format": fmt}}}
        dialect.decode(json.dumps({"type": "session.update", "session": session}))
        append = json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
        )
        cadence = PacedCadence()  # the driver's, as edge.connection runs it
        dialect.bind(SessionFacts("rt_1"))
        dialect.decode(append)
        cadence.start((16000, 16000), time.monotonic())
        dialect.encode(ev.Created("rt_1", 10))
        t0 = time.perf_counter()
        for seq in range(1, units + 1):
            sent: list[ev.AppendCommand] = []
            for _ in range(int(1 / CHUNK_S)):
                for cmd in dialect.decode(append):
                    if isinstance(cmd, ev.AudioCommand):
                        cadence.push(cmd.samples, cmd.rate)
                        sent += cadence.due(time.monotonic(), clock=False)
            for cmd in sent:
                cadence.sent(seq, time.monotonic())
                dialect.appended(seq, cmd)
            dialect.encode(_answer(seq))
            cadence.answered(_answer(seq))
        out[name] = (time.perf_counter() - t0) / units * 1e6
    return out


async def _minicpmo_session(url: str) -> float | None:
    report = await run_session(url + "?mode=audio", UNITS, pace_s=1.0, reply_tail_s=8)
    speech_end = report.units[len(UNITS)].sent_at
    replies = [u.audio_at for u in report.units.values() if u.audio_at is not None]
    return min(replies) - speech_end if replies else None


async def _openai_session(url: str) -> float | None:
    from websockets.asyncio.client import connect

    audio = np.concatenate([*UNITS, np.zeros(16000 * 8, np.float32)])
    pcm24 = (np.clip(pcm.resample(audio, 16000, 24000), -1, 1) * 32767).astype("<i2")
    step = int(24000 * CHUNK_S)
    speech_end_at = 5 * 24000
    first_audio: float | None = None
    speech_end: float | None = None
    async with connect(url + "?model=ab", max_size=None) as ws:

        async def read() -> None:
            nonlocal first_audio
            async for raw in ws:
                event = json.loads(raw)
                if event["type"] == "response.output_audio.delta" and first_audio is None:
                    first_audio = time.monotonic()
                    return

        reader = asyncio.ensure_future(read())
        start = time.monotonic()
        for i in range(0, pcm24.size, step):
            if reader.done():
                break
            chunk = base64.b64encode(pcm24[i : i + step].tobytes()).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            if i + step == speech_end_at:
                speech_end = time.monotonic()
            await asyncio.sleep(max(0.0, start + (i + step) / 24000 - time.monotonic()))
        await asyncio.wait_for(reader, 10)
    if first_audio is None or speech_end is None:
        return None
    return first_audio - speech_end


async def stack_sessions(url: str, sessions: int) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {"minicpm-o": [], "openai": []}
    for _ in range(sessions):
        for name, run in (("minicpm-o", _minicpmo_session), ("openai", _openai_session)):
            value = await run(url)
            if value is not None:
                got[name].append(value * 1000)
            print(f"{name:10s} first reply audio after speech: {value}", flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--url", help="a running edge's /v1/realtime URL")
    args = parser.parse_args(argv)
    for name, us in micro().items():
        print(f"edge work per unit, {name:24s} {us:8.0f} us")
    stack = None
    url = args.url
    if url is None:
        from omnifabric.tools.perf.stack import Stack

        stack = Stack(Path(tempfile.mkdtemp(prefix="openai_ab_")))
        stack.start_scheduler()
        stack.start_worker("--slots", "2", "--compute-ms", "20")
        stack.start_edge()
        url = stack.url
    try:
        got = asyncio.run(stack_sessions(url, args.sessions))
    finally:
        if stack is not None:
            stack.stop()
    for name, values in got.items():
        if values:
            print(
                f"first reply audio after speech, {name:10s} n={len(values)} "
                f"p50 {statistics.median(values):.0f} ms  p90 {percentile(values, 90):.0f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
