"""Fabric overhead under N concurrent real-time audio sessions (a small precursor of
`omnifabric bench`): per-unit overhead = client send -> client receive minus the
engine's reported compute (prefill + generate).

    python -m omnifabric.tools.load --url ws://127.0.0.1:8006/v1/realtime --sessions 50 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.tools.client import SILENCE_UNIT, SessionReport, run_session
from omnifabric.tools.perf.console import run_loop

SPEECH_UNIT = (0.2 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)


def script(seconds: int) -> list[np.ndarray]:
    """Speech then silence, repeated: replies keep coming so speak units are measured too."""
    pattern = [
        SILENCE_UNIT,
        SPEECH_UNIT,
        SPEECH_UNIT,
        SILENCE_UNIT,
        SILENCE_UNIT,
        SILENCE_UNIT,
        SILENCE_UNIT,
    ]
    return [pattern[i % len(pattern)] for i in range(seconds)]


async def run(
    url: str,
    sessions: int,
    seconds: int,
    wav: str | None = None,
    drop_after: int | None = None,
    resume_url: str | None = None,
) -> dict:
    if wav:
        from pathlib import Path

        from omnifabric.tools.probe import read_wav_16k, split_units

        speech = split_units(read_wav_16k(Path(wav)), 0)
        units = [speech[i % len(speech)] for i in range(seconds)]
    else:
        units = script(seconds)

    async def one(i: int) -> SessionReport:
        await asyncio.sleep(i * 1.0 / max(1, sessions))  # spread the units over the second
        # With drop_after: each session loses its connection once (at a unit spread over
        # the sessions) and resumes, at resume_url when given.
        drop = None if drop_after is None else drop_after + i % 5
        return await run_session(url, units, pace_s=1.0, drop_after=drop, resume_url=resume_url)

    reports = await asyncio.gather(*(one(i) for i in range(sessions)))
    overheads = [
        u.overhead_ms for r in reports for u in r.units.values() if u.overhead_ms is not None
    ]
    answered = [u for r in reports for u in r.units.values() if u.received_at is not None]
    engine_ms = [u.engine_ms for u in answered]
    rtts = [rtt for u in answered if (rtt := u.rtt_ms) is not None]  # all: answered
    speak = [
        u.overhead_ms
        for r in reports
        for u in r.units.values()
        if u.kind == "speak" and u.overhead_ms is not None
    ]
    resumes = [t for r in reports for t in r.resumes_s]
    faults = [r.seq_faults() for r in reports]
    return {
        "sessions": sessions,
        "seconds": seconds,
        "units_sent": sum(len(r.units) for r in reports),
        "units_answered": len(overheads),
        "dropped": sum(u.kind == "dropped" for r in reports for u in r.units.values()),
        "lost": sum(len(r.lost_units()) for r in reports),
        "closed_ok": sum(r.closed_reason == "user_stop" for r in reports),
        "errors": [r.error for r in reports if r.error],
        "resumed": len(resumes),
        "resume_s": {
            "p50": percentile(resumes, 50),
            "p99": percentile(resumes, 99),
            "max": max(resumes, default=float("nan")),
        },
        "events_missed": sum(m for m, _ in faults),
        "events_repeated": sum(r for _, r in faults),
        "overhead_ms": {
            "p50": percentile(overheads, 50),
            "p95": percentile(overheads, 95),
            "p99": percentile(overheads, 99),
            "max": max(overheads, default=float("nan")),
        },
        "speak_overhead_ms_p50": percentile(speak, 50),
        "engine_ms": {
            "p50": percentile(engine_ms, 50),
            "p99": percentile(engine_ms, 99),
            "max": max(engine_ms, default=float("nan")),
        },
        "rtt_ms": {
            "p50": percentile(rtts, 50),
            "p99": percentile(rtts, 99),
            "max": max(rtts, default=float("nan")),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8006/v1/realtime?mode=audio")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--input", help="WAV looped as every session's speech (default: tones)")
    parser.add_argument(
        "--drop-after",
        type=int,
        help="each session loses its connection once, after about this many units, and "
        "resumes (resume time, missed and repeated events are reported)",
    )
    parser.add_argument("--resume-url", help="resume at this URL (another edge)")
    args = parser.parse_args(argv)
    result = run_loop(
        run(args.url, args.sessions, args.seconds, args.input, args.drop_after, args.resume_url)
    )
    print(json.dumps(result, indent=2))
    faults = result["events_missed"] + result["events_repeated"] + len(result["errors"])
    return 0 if result["lost"] == 0 and faults == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
