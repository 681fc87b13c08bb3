"""Where a reply's first audio waits: the eval's spoken questions through one reference
engine session in this process, no fabric, unit by unit as a real-time client sends them.

    python -m omnifabric.tools.turn_starts [--voices piper,espeak] [--limit N] [--turn-work auto]
                                           [--early] [--tools] [--paced]

For each question it prints the unit that began the reply, how it began (inline, finalize,
guess: GenerateResult.reply_start_how) and where the time went (reply_start_ms: the silence
waited after the words, recognition, the reply model, speech), then first audio p50/p90
and the gaps a client playing the chunks as they come would hear, and the units answered
late by the worker's rule (``headroom.is_late``: the finalize before a unit holds it).
First audio is counted as `omnifabric eval` counts it, from the end of the question: unit
n carries stream seconds
[n, n+1) and is complete at n+1; it starts then, or when the finalize before it ended if
that is later (the worker's barrier), and its result leaves when its generate returns
(the fabric's own ~10 ms are not in it); with ``--early``, a result a finalize sends at once
leaves when the engine hands it over. ``--tools``: each session is offered the function-calling
evaluation's three functions (none of which the questions need), so every turn's end also
checks whether to call one. ``--paced``: the audio comes in 100 ms appends through the
edge's own paced cadence (edge.cadence.PacedCadence, as the OpenAI dialect makes units:
whole seconds, and a shorter unit where speech stops; the session told so, as the edge
tells the worker: SessionStart.speech_cuts), results between units taken (``--early``
implied). A minute's run where `omnifabric eval` takes
several, for trying a turn-taking change; the eval through the stack is the figure of
record.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.tools.eval_outcome import playback_gaps
from omnifabric.tools.eval_reference import ITEMS, LEAD_INS_S, RATE, VOICES, Item, compose
from omnifabric.worker.engine import (
    OUTPUT_RATE,
    DuplexSettings,
    GenerateResult,
    ToolChoice,
    ToolSpec,
)
from omnifabric.worker.headroom import is_late

if TYPE_CHECKING:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

#: Silent units after the question while the reply has not ended.
TAIL_UNITS = 8


@dataclass
class Start:
    """One question's reply start."""

    question: str
    unit: int = -1
    how: str = ""
    parts_ms: dict[str, float] = field(default_factory=dict)
    first_audio_s: float | None = None
    gap_s: float = 0.0
    sent_s: float | None = None
    """When the reply's unit was sent, from the end of the question (its first audio
    leaves once the finalize before it and the unit itself are done)."""
    late: int = 0
    """The session's units answered late by the worker's rule (``headroom.is_late``: more
    than their length and more than a second after they came)."""


def drive(
    engine: ReferenceEngine,
    item: Item,
    kind: str,
    index: int,
    early: bool = False,
    tools: tuple[ToolSpec, ...] = (),
    paced: bool = False,
) -> Start:
    """One question through a fresh session of ``engine``; its reply's start. ``early``:
    the session sends what a finalize makes at once (EngineSession.early_sink); ``tools``:
    the functions it is offered."""
    voice, rate = VOICES[kind][index % len(VOICES[kind])]
    lead_in = LEAD_INS_S[index % len(LEAD_INS_S)]
    units, _, end_s = compose(item, kind, voice, rate, lead_in, index)
    units += [np.zeros(RATE, np.float32)] * TAIL_UNITS
    timed = [(unit, n + 1.0) for n, unit in enumerate(units)]
    if paced:
        early = True
        timed = paced_units(np.concatenate(units))
    out = Start(" / ".join(item.turns))
    session = engine.open_session(f"turn-starts-{index}", "audio")
    chunks: list[tuple[float, float]] = []
    made: list[tuple[float, GenerateResult]] = []  # a finalize's early results, when made
    if early:
        session.early_sink = lambda result: made.append((time.perf_counter(), result))
    session.speech_cuts = paced  # as the edge tells the worker (SessionStart.speech_cuts)

    def seen(n: int, result: GenerateResult, left_at: float) -> bool:
        """A result of unit ``n`` that left at stream time ``left_at``; True once the reply
        ended."""
        if result.reply_start_how and timed[n][1] > end_s:  # the last turn's reply
            out.unit, out.how, out.parts_ms = n, result.reply_start_how, result.reply_start_ms
            out.first_audio_s = left_at - end_s
            out.sent_s = timed[n][1] - end_s
        if out.unit >= 0 and result.audio.size:
            chunks.append((left_at, result.audio.size / OUTPUT_RATE))
        return out.unit >= 0 and result.end_of_turn

    try:
        session.prepare("", None, None, DuplexSettings())
        if tools:
            session.offer_tools(tools, ToolChoice())
        busy_until = 0.0  # stream time the previous unit's finalize ended
        for n, (unit, complete_at) in enumerate(timed):
            t0 = time.perf_counter()
            session.prefill(unit, [], 1)
            result = session.generate(False)
            t1 = time.perf_counter()
            # A unit arrives when its audio has come, and starts once the finalize
            # before it is done (the worker's barrier).
            left_at = max(complete_at, busy_until) + t1 - t0
            out.late += is_late(left_at - complete_at, unit.size / RATE)
            if seen(n, result, left_at):
                break
            session.finalize()
            busy_until = left_at + time.perf_counter() - t1
            ended = any([seen(n, r, left_at + at - t1) for at, r in made])
            made.clear()
            if ended:
                break
    finally:
        session.stop()
        session.close()
    out.gap_s = sum(playback_gaps(chunks))
    return out


def paced_units(stream: np.ndarray, append_s: float = 0.1) -> list[tuple[np.ndarray, float]]:
    """``stream`` (16 kHz) as the edge's paced cadence makes units of it from appends of
    ``append_s`` sent in real time: (unit, the stream time it is sent). The cadence's rule
    of one unit in flight is left out (the engine here answers a unit well within its
    length, or the barrier above holds the next one anyway)."""
    from omnifabric.common.session_types import EngineLimits
    from omnifabric.edge.cadence import PacedCadence

    limits = EngineLimits()
    cadence = PacedCadence()
    cadence.start((limits.min_unit_samples, limits.max_unit_samples), 0.0, short_units=True)
    step = int(append_s * RATE)
    out: list[tuple[np.ndarray, float]] = []
    for i in range(0, stream.size, step):
        now = (i + step) / RATE
        cadence.push(stream[i : i + step], RATE)
        for command in cadence.due(now, clock=True):
            out.append((np.frombuffer(command.pcm, "<f4").copy(), now))
    return out


def _line(kind: str, start: Start) -> str:
    parts = ", ".join(f"{k} {v:.0f}" for k, v in start.parts_ms.items())
    first = "-" if start.first_audio_s is None else f"{start.first_audio_s:.2f} s"
    sent = "-" if start.sent_s is None else f"{start.sent_s:.2f} s"
    return (
        f"{kind:6s} {start.question[:34]:34s} unit {start.unit:2d} {start.how:8s} "
        f"sent {sent:7s} first audio {first:7s} gap {start.gap_s:.2f} s late {start.late}  "
        f"ms: {parts}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnifabric.tools.turn_starts")
    parser.add_argument("--voices", default="piper,espeak", help="voice kinds: piper, espeak")
    parser.add_argument("--limit", type=int, help="only the first N questions")
    parser.add_argument("--turn-work", default="auto", help="auto, inline or finalize")
    parser.add_argument("--no-guess", action="store_true", help="turn guessing off")
    parser.add_argument(
        "--early",
        action="store_true",
        help="send what a finalize makes at once (a sender that takes results between units)",
    )
    parser.add_argument(
        "--tools", action="store_true", help="offer the function-calling evaluation's functions"
    )
    parser.add_argument(
        "--paced",
        action="store_true",
        help="100 ms appends through the edge's paced cadence (the OpenAI dialect's units)",
    )
    args = parser.parse_args(argv)
    from omnifabric.worker.engines.reference.engine import ReferenceEngine
    from omnifabric.worker.engines.reference.turns import TurnRules

    rules = TurnRules(turn_work=args.turn_work, guess_ahead=not args.no_guess)
    engine = ReferenceEngine(rules=rules)
    engine.load()
    engine.warmup()
    tools: tuple[ToolSpec, ...] = ()
    if args.tools:
        from omnifabric.tools.eval_tools import TOOLS

        tools = tuple(ToolSpec(t["name"], t["description"], t["parameters"]) for t in TOOLS)
    starts = []
    for kind in args.voices.split(","):
        for index, item in enumerate(ITEMS[: args.limit]):
            start = drive(engine, item, kind, index, args.early, tools, args.paced)
            print(_line(kind, start), flush=True)
            starts.append(start)
    firsts = sorted(s.first_audio_s for s in starts if s.first_audio_s is not None)
    if firsts:
        p50, p90 = percentile(firsts, 50), percentile(firsts, 90)
        hows = {h: sum(s.how == h for s in starts) for h in sorted({s.how for s in starts})}
        gapped = [s.gap_s for s in starts if s.gap_s > 0]
        print(
            f"first audio p50 {p50:.2f} s, p90 {p90:.2f} s ({len(firsts)} replies); "
            f"started {hows}; gaps: {len(gapped)} replies, {sum(gapped):.2f} s; "
            f"late units {sum(s.late for s in starts)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
