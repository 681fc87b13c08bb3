"""Ask a running stack spoken questions as a real client and score the spoken answers.

    omnifabric eval [--url ws://HOST:PORT/v1/realtime] [--voices piper,espeak] [--out DIR]
                    [--dialect current|openai]

Questions are rendered with several voices (Piper's neural voices, espeak-ng's robotic
ones) at several speaking rates, after lead-in silences of 0.3-1.5 s, with low seeded noise;
each goes through the whole stack in its own real-time session (1 s units, silence after
the question until the reply ends). The replies are transcribed by a recognizer other than
the engine's own (Whisper tiny.en here; the engine says what it heard in
`input_transcript`), and a reply is correct when it names the expected answer.
`--dialect openai` asks through the OpenAI Realtime dialect instead (tools/eval_openai.py:
the question as 24 kHz PCM16 in 100 ms appends, server VAD), scored the same way.
`--speech-cuts` (MiniCPM-o dialect) sends what the /audio page sends where the server takes
units as they come: whole seconds, and a shorter unit once speech stopped
(`speech_cut_units`); the official clients send whole seconds only.

Printed: a progress line per session, then one table row per voice kind: correct answers,
question word error rate (the engine's transcript against the question), reply length,
replies over 3 sentences or repeating themselves, first reply audio after the end of the
question (p50/p90), gaps inside replies for a client playing them as they arrive, and unit
round trips (p50/p99; n/a in the OpenAI dialect, which has no units). `--out` also gets
every session as JSON.
Without `--url` it starts `omnifabric serve` on free ports and stops it afterwards.

The question set here is small on purpose: acceptance uses questions, voices and timings
that are not in the repo.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from omnifabric.tools.eval_outcome import OUTPUT_RATE, Outcome, save_run, time_reply
from omnifabric.tools.perf.stack import start_serve

if TYPE_CHECKING:
    from omnifabric.tools.client import SessionReport, UnitRecord

RATE = 16000
LEAD_INS_S = (0.3, 0.7, 1.1, 1.5)
#: Seconds between the end of one turn's question and the next turn's (a reply fits).
TURN_GAP_S = 8.0
NOISE_SIGMA = 0.002
#: A unit's length in ms: a unit answered later than this after it was sent is late.
UNIT_MS = 1000.0


@dataclass(frozen=True)
class Item:
    """One conversation: what the user says, turn by turn, and the answer to the last turn
    (any of the words, as the recognizer writes them)."""

    turns: tuple[str, ...]
    expect: tuple[str, ...]


#: One session of a run: (item, voice kind, voice, rate, lead-in s).
Run = tuple[Item, str, str, float, float]


ITEMS = (
    Item(("What is the capital of France?",), ("paris",)),
    Item(("How many legs does a spider have?",), ("eight", "8")),
    Item(("What is two plus two?",), ("four", "4")),
    Item(("What color is the sky on a clear day?",), ("blue",)),
    Item(("Which animal barks?",), ("dog",)),
    Item(("What is the opposite of hot?",), ("cold",)),
    Item(("How many days are there in a week?",), ("seven", "7")),
    Item(("What is the capital of Japan?",), ("tokyo",)),
    Item(("What do bees make?",), ("honey",)),
    Item(("What is ten minus three?",), ("seven", "7")),
    Item(("What is the largest planet in our solar system?",), ("jupiter",)),
    Item(("My name is Anna.", "What is my name?"), ("anna",)),
)


def read_items(text: str) -> tuple[Item, ...]:
    """Questions from a file's text: one conversation a line, its turns separated by " / ",
    then " | " and the accepted answers separated by commas, e.g.
    ``My name is Anna. / What is my name? | anna``. Blank lines and lines starting with "#"
    are skipped. Raises ValueError naming the line that is malformed."""
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        question, bar, answers = line.partition("|")
        turns = tuple(t.strip() for t in question.split(" / ") if t.strip())
        expect = tuple(a.strip().lower() for a in answers.split(",") if a.strip())
        if not bar or not turns or not expect:
            raise ValueError(
                f"line {number}: expected 'question [/ next turn ...] | answer[, answer ...]', "
                f"got {line!r}"
            )
        items.append(Item(turns, expect))
    if not items:
        raise ValueError("no questions in the file")
    return tuple(items)


#: voice kind -> (voice, speaking-rate setting) variants; piper: length scale, espeak: wpm.
VOICES = {
    "piper": (("joe", 1.0), ("joe", 0.85), ("joe", 1.2)),
    "espeak": (("en-us", 165), ("en-us+f3", 150), ("en-gb", 180)),
}


# ---- speech ------------------------------------------------------------------------------


def render(kind: str, voice: str, rate: float, text: str, sample_rate: int = RATE) -> np.ndarray:
    """``text`` spoken at ``sample_rate`` Hz float32 (trimmed of the synthesizer's own
    silence). Piper renders at its voice's rate (22.05 kHz: speech up to 11 kHz) and is
    converted; espeak-ng's speech comes at 16 kHz only (make_fixtures.espeak)."""
    from scipy.signal import resample_poly

    if kind == "espeak":
        from omnifabric.tools.make_fixtures import espeak

        if sample_rate != RATE:
            raise ValueError(f"espeak voices render at {RATE} Hz only")
        audio = espeak(text, voice, int(rate))
    elif kind == "piper":
        from omnifabric.worker.engines.reference.piper import render as piper_render

        audio, native = piper_render(text, voice, length_scale=rate)
        g = np.gcd(int(native), sample_rate)
        audio = resample_poly(audio, sample_rate // g, int(native) // g).astype(np.float32)
    else:
        raise ValueError(f"unknown voice kind {kind!r} (piper or espeak)")
    loud = np.flatnonzero(np.abs(audio) > 0.01)
    return audio[loud[0] : loud[-1] + 1] if loud.size else audio


def compose(
    item: Item,
    kind: str,
    voice: str,
    rate: float,
    lead_in_s: float,
    seed: int,
    sample_rate: int = RATE,
) -> tuple[list[np.ndarray], float, float]:
    """The session's input audio (1 s units at ``sample_rate``) and the stream times where
    the last question starts and ends, in seconds."""
    sr = sample_rate
    pieces = [np.zeros(int(lead_in_s * sr), np.float32)]
    start_s = end_s = lead_in_s
    for i, turn in enumerate(item.turns):
        start_s = sum(p.size for p in pieces) / sr
        pieces.append(render(kind, voice, rate, turn, sr))
        end_s = sum(p.size for p in pieces) / sr
        if i < len(item.turns) - 1:
            pieces.append(np.zeros(int(TURN_GAP_S * sr), np.float32))
    pieces.append(np.zeros(sr, np.float32))
    audio = np.concatenate(pieces)
    noisy = audio + np.random.default_rng(seed).normal(0, NOISE_SIGMA, audio.size)
    audio = np.clip(noisy, -1, 1).astype(np.float32)
    n = -(-audio.size // sr)
    audio = np.pad(audio, (0, n * sr - audio.size))
    return [audio[i * sr : (i + 1) * sr] for i in range(n)], start_s, end_s


#: The page's microphone chunks (edge/web/js/capture.js: the worklet's 100 ms at 16 kHz).
PAGE_CHUNK = RATE // 10


def speech_cut_units(units: list[np.ndarray], fewest: int | None = None) -> list[np.ndarray]:
    """The stream of ``units`` (16 kHz) as the /audio page sends it to a server that takes
    units as they come (edge/web/js/duplex-page.js): in its 100 ms chunks, whole seconds,
    and what came so far once the edge's end-of-speech rule says a cut is due
    (``edge.cadence.SpeechEnd``, which the page's copy follows) and at least ``fewest``
    samples came (default: the engines' shortest unit, ``EngineLimits.min_unit_samples``)."""
    from omnifabric.common.session_types import EngineLimits
    from omnifabric.edge.cadence import SpeechEnd

    fewest = EngineLimits().min_unit_samples if fewest is None else fewest
    audio = np.concatenate(units) if units else np.zeros(0, np.float32)
    end, out, held = SpeechEnd(), [], np.zeros(0, np.float32)
    for i in range(0, audio.size, PAGE_CHUNK):
        chunk = audio[i : i + PAGE_CHUNK]
        held = np.concatenate([held, chunk])
        while held.size >= RATE:
            out.append(held[:RATE])
            held = held[RATE:]
        end.feed(chunk)
        if end.cut_due and held.size and held.size >= fewest:
            out.append(held)
            held = np.zeros(0, np.float32)
            end.cut()
    if held.size:  # the stream goes on in silence: its last second is made whole
        out.append(np.concatenate([held, np.zeros(RATE - held.size, np.float32)]))
    return out


# ---- scoring -----------------------------------------------------------------------------

_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()


def words_of(text: str) -> list[str]:
    """Lower-case words, digits spelled out (0-20), punctuation dropped. Letters and digits
    run together are two words: a recognizer writes "has three" as "S3", "24 hours" as
    "24hours"; digits grouped by thousands ("55,501") are one number, commas between
    other digits ("7,10") part two."""
    out = []
    for w in re.findall(r"[a-z']+|[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+", text.lower()):
        w = w.replace(",", "")
        out.append(_NUMBERS[int(w)] if w.isdigit() and int(w) < len(_NUMBERS) else w)
    return out


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of ``hypothesis`` against ``reference`` (edit distance / words)."""
    ref, hyp = words_of(reference), words_of(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


def names_answer(text: str, expect: tuple[str, ...]) -> bool:
    said = set(words_of(text))
    return any(set(words_of(e)) <= said for e in expect)


# ---- one session -------------------------------------------------------------------------


async def ask(
    url: str,
    item: Item,
    kind: str,
    voice: str,
    rate: float,
    lead_in_s: float,
    seed: int,
    tail_s: int,
    hearer: Callable[[np.ndarray], str],
    dialect: str = "current",
    wideband: bool = False,
    speech_cuts: bool = False,
) -> Outcome:
    """One conversation through the stack in `dialect` ("current": the MiniCPM-o
    protocol; "openai": the OpenAI Realtime one), scored. `wideband` (openai only): the
    question rendered at 24 kHz, its band above 8 kHz kept, instead of at 16 kHz.
    `speech_cuts` (current only): units cut short where speech stops, as the /audio page
    sends them (``speech_cut_units``)."""
    sample_rate = OUTPUT_RATE if wideband else RATE
    units, start_s, end_s = compose(item, kind, voice, rate, lead_in_s, seed, sample_rate)
    out = Outcome(kind, voice, rate, lead_in_s, " / ".join(item.turns))
    if dialect == "openai":
        if speech_cuts:
            raise ValueError("speech cuts are the MiniCPM-o dialect's page's (current)")
        from omnifabric.tools.eval_openai import session as run
    elif not wideband:
        run = functools.partial(current_session, speech_cuts=speech_cuts)
    else:
        raise ValueError("wideband questions go through the openai dialect only")
    try:
        reply_audio = await run(out, url, units, start_s, end_s, tail_s)
    except Exception as exc:  # a broken stack is a result too
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    hear_question(out, item)
    judge(out, item, reply_audio, hearer)
    return out


async def current_session(
    out: Outcome,
    url: str,
    units: list[np.ndarray],
    start_s: float,
    end_s: float,
    tail_s: int,
    speech_cuts: bool = False,
) -> np.ndarray:
    """The session in the MiniCPM-o protocol (1 s units in real time; `speech_cuts`: cut
    where speech stops by ``speech_cut_units``, each sent once its audio was spoken, the
    init saying so in `config.speech_cuts`): what the engine heard, the reply's text and
    timing go into `out`; returns the reply's audio (24 kHz)."""
    from omnifabric.tools.client import run_session

    at_s, init_extra = None, None
    if speech_cuts:
        units = speech_cut_units(units)
        ends = np.cumsum([u.size for u in units]) / RATE
        at_s = [float(t - ends[0]) for t in ends]
        init_extra = {"config": {"speech_cuts": True}}
    report = await run_session(
        url, units, pace_s=1.0, reply_tail_s=tail_s, at_s=at_s, init_extra=init_extra
    )
    if report.error:
        out.error = str(report.error)
    created = next((e for e in report.events if e.get("type") == "session.created"), {})
    if speech_cuts and not (created.get("input_units") or {}).get("as_sent"):
        out.error = out.error or "the server does not take units as they come: no speech cuts"

    out.queued = any(e.get("type") == "session.queued" for e in report.events)
    out.queue_wait_s = round(report.queue_wait_s, 3)
    out.heard = " / ".join(
        e["input_transcript"] for e in report.events if e.get("input_transcript")
    )
    records = sorted(report.units.values(), key=lambda u: u.seq)
    out.unit_rtt_ms = [u.rtt_ms for u in records if u.rtt_ms is not None]
    out.slow_units = [slow_unit(u) for u in records if (u.rtt_ms or 0.0) > UNIT_MS / 2]
    if not records:
        return np.zeros(0, np.float32)
    # Each unit is sent once its audio was spoken: the first one ends at its length.
    origin = records[0].sent_at - units[0].size / RATE
    # The reply scored is the one to the last turn (earlier turns get replies of their own).
    replies = [u for u in records if u.kind == "speak" and u.sent_at - origin > start_s]
    out.reply_text = "".join(u.text for u in replies).strip()
    chunks = [(u.audio_at, u.audio_samples / OUTPUT_RATE) for u in replies if u.audio_at]
    time_reply(out, chunks, origin + end_s)
    return np.concatenate([np.zeros(0, np.float32), *_reply_audio(report, replies)])


def slow_unit(unit: UnitRecord) -> dict[str, Any]:
    """A slow unit as results.json keeps it (Outcome.slow_units)."""
    return {
        "seq": unit.seq,
        "kind": unit.kind,
        "rtt_ms": round(unit.rtt_ms or 0.0),
        "finalize_wait_ms": round(unit.finalize_wait_ms),
        "engine_busy_ms": round(unit.engine_busy_ms),
        "prefill_ms": round(unit.prefill_ms),
        "generate_ms": round(unit.generate_ms),
        "wall_clock_ms": round(unit.wall_clock_ms),
    }


def hear_question(out: Outcome, item: Item) -> None:
    """The question's word error rate, from what the engine said it heard (`out.heard`,
    turns joined by " / ")."""
    if out.heard:
        out.question_wer = wer(" ".join(item.turns), out.heard)


def judge(
    out: Outcome, item: Item, reply_audio: np.ndarray, hearer: Callable[[np.ndarray], str]
) -> None:
    """Score the reply: the independent recognizer's hearing of its audio (24 kHz) names
    the answer or not; its text's sentences, words and loops."""
    from scipy.signal import resample_poly

    from omnifabric.worker.engines.reference.turns import repeated_from, sentence_ends

    if reply_audio.size:
        out.reply_heard = hearer(resample_poly(reply_audio, 2, 3).astype(np.float32))
    out.correct = names_answer(out.reply_heard, item.expect)
    out.sentences = len(sentence_ends(out.reply_text + " "))
    out.words = len(words_of(out.reply_text))
    out.loops = repeated_from(out.reply_text) is not None


def _reply_audio(report: SessionReport, replies: list[UnitRecord]) -> list[np.ndarray]:
    """The reply's audio chunks, in arrival order, for the scored units only."""
    wanted = {u.seq for u in replies}
    chunks = []
    for event in report.events:
        seq = (event.get("metrics") or {}).get("seq")
        if seq in wanted and event.get("audio"):
            chunks.append(np.frombuffer(base64.b64decode(event["audio"]), "<f4"))
    return chunks


# ---- the run ------------------------------------------------------------------------------


def plan(kinds: list[str], items: tuple[Item, ...], repeat: int) -> list[Run]:
    """(item, kind, voice, rate, lead-in) for every session, deterministic."""
    runs: list[Run] = []
    for kind in kinds:
        for r in range(repeat):
            for i, item in enumerate(items):
                voice, rate = VOICES[kind][(i + r) % len(VOICES[kind])]
                lead = LEAD_INS_S[(i + 2 * r) % len(LEAD_INS_S)]
                runs.append((item, kind, voice, rate, lead))
    return runs


def progress(done: int, total: int, last: Outcome, started: float) -> None:
    width = 24
    filled = int(width * done / total)
    verdict = "error" if last.error else ("right" if last.correct else "wrong")
    eta = (time.monotonic() - started) / done * (total - done)
    line = (
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} eta {eta:4.0f}s "
        f"{last.kind}:{last.voice} {verdict:5} {last.question[:40]!r:44}"
    )
    print(line, end="" if done < total else "\n", file=sys.stderr, flush=True)


def table(outcomes: list[Outcome]) -> str:
    """The summary, one row per voice kind and one for all."""
    from omnifabric.common.stats import percentile

    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.kind, []).append(o)
    groups["all"] = outcomes
    head = (
        "| voices | sessions | correct | question WER | reply words (mean) | over 3 sentences "
        "| loops | first audio p50 / p90 s | gaps in replies (n, s) | unit p50 / p99 ms "
        "| late units | queued (n, longest wait s) | errors |"
    )
    rows = [head, "|" + "---|" * 13]
    for name, group in groups.items():
        n = len(group)
        right = sum(o.correct for o in group)
        wers = [o.question_wer for o in group if o.question_wer is not None]
        firsts = [o.first_audio_s for o in group if o.first_audio_s is not None]
        rtts = [ms for o in group for ms in o.unit_rtt_ms]
        words = [o.words for o in group if o.reply_text]
        question_wer = f"{100 * np.mean(wers):.0f}%" if wers else "n/a"
        rows.append(
            f"| {name} | {n} | {right}/{n} ({100 * right / max(1, n):.0f}%) | {question_wer} "
            f"| {np.mean(words) if words else 0:.1f} | {sum(o.sentences > 3 for o in group)} "
            f"| {sum(o.loops for o in group)} "
            f"| {percentile(firsts, 50):.2f} / {percentile(firsts, 90):.2f} "
            f"({len(firsts)} replied) "
            f"| {sum(o.gap_s > 0.05 for o in group)}, {sum(o.gap_s for o in group):.2f} "
            f"| {_unit_rtts(rtts)} | {_late(rtts)} | {_queued(group)} "
            f"| {sum(bool(o.error) for o in group)} |"
        )
    return "\n".join(rows)


def _late(rtts: list[float]) -> str:
    """Units answered later than a unit length (1 s) after they were sent, as the client saw
    them (its round trip; the worker's own count is `omni_worker_unit_deadline_misses_total`);
    n/a in a dialect without units."""
    return str(sum(ms > UNIT_MS for ms in rtts)) if rtts else "n/a"


def _queued(group: list[Outcome]) -> str:
    """Callers that waited in the scheduler's queue, and the longest wait from connecting to
    the lease."""
    waits = [o.queue_wait_s for o in group if o.queue_wait_s is not None]
    longest = f"{max(waits):.1f}" if waits else "n/a"
    return f"{sum(o.queued for o in group)}, {longest}"


def _unit_rtts(rtts: list[float]) -> str:
    """The unit round trips' cell: p50 / p99 ms (n/a in a dialect without units)."""
    from omnifabric.common.stats import percentile

    if not rtts:
        return "n/a"
    return f"{percentile(rtts, 50):.0f} / {percentile(rtts, 99):.0f}"


def start_stack(extra: list[str], log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`omnifabric serve` on free ports; (process, ws url) once it is ready. Its output goes
    to ``log`` when given (the worker's warm-up says there what it measured and how many
    sessions it admits at once), else nowhere."""
    proc = start_serve(*extra)
    out = proc.stdout
    assert out is not None
    sink = open(log, "w", encoding="utf-8") if log else None  # noqa: SIM115 - kept open
    for line in out:
        if sink:
            sink.write(line)
        match = re.match(r"omnifabric ready: (\S+)", line)
        if match:
            import threading

            threading.Thread(target=_drain, args=(out, sink), daemon=True).start()
            return proc, match.group(1)
    raise SystemExit(f"omnifabric serve exited ({proc.wait()}) before it was ready")


def _drain(out: Any, sink: Any) -> None:
    """Read the server's output to its end (into ``sink`` when there is one)."""
    for line in out:
        if sink:
            sink.write(line)
            sink.flush()


async def run_all(
    args: argparse.Namespace, runs: list[Run], hearer: Callable[[np.ndarray], str]
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    started = time.monotonic()
    sem = asyncio.Semaphore(args.parallel)

    async def one(i: int, spec: Run) -> None:
        async with sem:
            item, kind, voice, rate, lead = spec
            outcome = await ask(
                args.url,
                item,
                kind,
                voice,
                rate,
                lead,
                1000 + i,
                args.tail_s,
                hearer,
                args.dialect,
                args.wideband,
                args.speech_cuts,
            )
            outcomes.append(outcome)
            progress(len(outcomes), len(runs), outcome, started)

    await asyncio.gather(*(one(i, spec) for i, spec in enumerate(runs)))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnifabric eval", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running edge (default: start omnifabric serve here)")
    parser.add_argument("--voices", default="piper,espeak", help="voice kinds: piper, espeak")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the question set")
    parser.add_argument("--limit", type=int, help="only the first N questions")
    parser.add_argument(
        "--questions",
        type=Path,
        help="your own questions, one a line: 'question [/ next turn] | answer[, answer]'",
    )
    parser.add_argument(
        "--dialect",
        choices=["current", "openai"],
        default="current",
        help="the protocol the sessions speak: current (MiniCPM-o) or openai (OpenAI Realtime)",
    )
    parser.add_argument(
        "--wideband",
        action="store_true",
        help="openai dialect, piper voices: questions at 24 kHz with their band above 8 kHz",
    )
    parser.add_argument(
        "--speech-cuts",
        action="store_true",
        help="current dialect: units cut short where speech stops, as the /audio page sends them",
    )
    parser.add_argument("--parallel", type=int, default=1, help="sessions at once")
    parser.add_argument("--tail-s", type=int, default=15, help="silence after the question, max s")
    parser.add_argument("--out", type=Path, help="folder for results.json and table.md")
    parser.add_argument("--label", default="", help="name of this run in the table")
    parser.add_argument("serve_args", nargs="*", help="extra `omnifabric serve` flags (after --)")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.voices.split(",") if k.strip()]
    for kind in kinds:
        if kind not in VOICES:
            parser.error(f"unknown voice kind {kind!r}: choose from {', '.join(VOICES)}")
    if args.wideband and (args.dialect != "openai" or kinds != ["piper"]):
        parser.error("--wideband needs --dialect openai and --voices piper (espeak is 16 kHz)")
    if args.speech_cuts and args.dialect != "current":
        parser.error("--speech-cuts is the current (MiniCPM-o) dialect's page's")
    items: tuple[Item, ...] = ITEMS
    if args.questions:
        try:
            items = read_items(args.questions.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            parser.error(f"--questions {args.questions}: {exc}")
    items = items[: args.limit] if args.limit else items
    runs = plan(kinds, items, args.repeat)
    print(f"rendering {len(runs)} spoken questions ...", file=sys.stderr)
    for item, kind, voice, rate, _ in runs:  # fail early (a missing voice) and warm caches
        render(kind, voice, rate, item.turns[0])
    from omnifabric.worker.engines.reference.asr import Transcriber

    # The replies' own hearing in fp32 on every host, as every earlier run heard them.
    hearer = Transcriber(model="tiny.en", precision="fp32").transcribe
    proc = None
    if not args.url:
        print("starting omnifabric serve ...", file=sys.stderr)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
        proc, args.url = start_stack(args.serve_args, args.out / "serve.log" if args.out else None)
    try:
        outcomes = asyncio.run(run_all(args, runs, hearer))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = table(outcomes)
    print(f"\n{args.label}\n{summary}" if args.label else f"\n{summary}")
    wrong = [o for o in outcomes if not o.correct]
    for o in wrong:
        print(
            f"- {o.kind}:{o.voice}@{o.rate} lead {o.lead_in_s}s: {o.question!r} heard "
            f"{o.heard!r} -> {o.reply_text!r} (reply heard as {o.reply_heard!r}) {o.error}"
        )
    if args.out:
        save_run(args.out, outcomes, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
