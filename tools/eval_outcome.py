"""What one spoken-question session of `omnifabric eval` scores (an Outcome) and how a
reply's arrival is timed, shared by the eval's two dialects (tools/eval_reference.py for the
MiniCPM-o protocol, tools/eval_openai.py for the OpenAI Realtime one) and tools/turn_starts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The reply audio's rate (24 kHz, both protocols).
OUTPUT_RATE = 24000


@dataclass
class Outcome:
    """One session's scores."""

    kind: str
    voice: str
    rate: float
    lead_in_s: float
    question: str
    heard: str = ""
    reply_text: str = ""
    reply_heard: str = ""
    correct: bool = False
    question_wer: float | None = None
    sentences: int = 0
    words: int = 0
    loops: bool = False
    first_audio_s: float | None = None
    gap_s: float = 0.0
    """Silence a client playing the reply as it arrives hears inside it (chunks late)."""
    reply_chunks: list[tuple[float, float]] = field(default_factory=list)
    """The reply's audio as (arrival after the end of the question, seconds of audio)."""
    unit_rtt_ms: list[float] = field(default_factory=list)
    slow_units: list[dict[str, Any]] = field(default_factory=list)
    """Units answered more than half a unit after they were sent, with the worker's own
    times for them (ms: its wait for the session's previous unit and finalize, prefill,
    generate, arrival to result), to tell a busy engine from a slow network."""
    queued: bool = False
    """The caller waited in the scheduler's queue (it got ``session.queued``) before its
    session began; False where the dialect does not say."""
    queue_wait_s: float | None = None
    """Seconds from connecting to the lease (``session.queue_done``); None where not known."""
    error: str = ""


def time_reply(out: Outcome, chunks: list[tuple[float, float]], speech_end: float) -> None:
    """The reply's timing from its audio as it arrived ((arrival, seconds of audio), in
    order; `speech_end` is when the last question's audio ended, on the same clock)."""
    first = next((t for t, seconds in chunks if seconds > 0), None)
    if first is not None:
        out.first_audio_s = first - speech_end
    out.gap_s = sum(playback_gaps(chunks))
    out.reply_chunks = [(round(t - speech_end, 3), round(d, 3)) for t, d in chunks]


def playback_gaps(chunks: list[tuple[float, float]]) -> list[float]:
    """Silences inside a reply for a client that plays each chunk (arrival time, seconds of
    audio; in order) as soon as it has it and the chunk before it has played."""
    gaps: list[float] = []
    end = None
    for arrival, duration in chunks:
        if duration <= 0:
            continue
        start = arrival if end is None else max(arrival, end)
        if end is not None and start > end:
            gaps.append(start - end)
        end = start + duration
    return gaps


def save_run(folder: Path, rows: Sequence[Any], table: str) -> None:
    """An eval's `--out` folder: every row (dataclasses) as results.json, the printed table
    as table.md (the evals of spoken questions, hearing and function calls share it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    (folder / "table.md").write_text(table + "\n")
