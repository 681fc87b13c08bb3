"""Score the reference engine's recognizers alone on short spoken questions and requests.

    python -m omnifabric.tools.eval_hearing [--asr both|closely|whisper]
                                            [--asr-precision auto|fp32]
                                            [--voices piper,espeak] [--context TEXT]
                                            [--limit N] [--out DIR]

No server and no reply model: each utterance goes straight through the engine's hearing
(``Ears``: Whisper base and Moonshine base-en; or Whisper base alone), as the engine would
hand it over at the end of a turn (``--asr closely``: as it hears a whole input_audio item
when functions are offered, ``Ears.hear_closely``). The utterances are ``PROBES`` (50
short questions and requests, with names, places, times and order numbers like the
function-calling evaluation's) rendered by ``eval_reference``'s renderers with every voice
of ``VOICES`` (six espeak-ng voices and rates, Piper's voice at three rates), each after a
lead-in and with low seeded noise by ``eval_reference.compose``'s rules, then cut as the
engine's turn tracker cuts an utterance (its pre-roll before the speech, its tail after).
``--context`` gives Whisper the same words with every utterance, as a session's names do
(``Ears.hear``); by default the engine's prompt for a session that names nothing
(``engine.HEARING_PRIMER``), and ``--context ""`` none.

Printed: one row per voice kind with the utterances whose key words all survived, the key
words that survived, the word error rate against the text, what a conversation would get by
the engine's rule (answered with every key word heard, answered on a misheard word, asked to
say it again: a confidence under ``ReferenceEngine.repair_below``), and the recognition time per
utterance (p50/p90, one torch thread per recognizer as the engine runs them), plus the load
average; then every utterance that lost a key word. ``--out`` also gets every utterance as
JSON. Rendered speech is kept in ``--cache`` (default: the temporary folder) between runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnifabric.tools.eval_outcome import save_run
from omnifabric.tools.eval_reference import LEAD_INS_S, RATE, Item, compose, words_of
from omnifabric.tools.eval_reference import VOICES as EVAL_VOICES
from omnifabric.tools.eval_reference import wer as eval_wer
from omnifabric.worker.config import ASR_PRECISIONS
from omnifabric.worker.engines.vad import UtteranceRules


@dataclass(frozen=True)
class Probe:
    """What is said and the words of it that must be heard (as ``words_of`` writes them;
    "a|b": either spelling)."""

    text: str
    keys: tuple[str, ...]


def _p(text: str, keys: str) -> Probe:
    return Probe(text, tuple(keys.split()))


PROBES = (
    _p("What is the capital of France?", "capital france"),
    _p("How many legs does a spider have?", "legs spider"),
    _p("What is two plus two?", "two plus"),
    _p("What color is the sky on a clear day?", "color|colour sky"),
    _p("Which animal barks?", "animal barks"),
    _p("What is the opposite of hot?", "opposite hot"),
    _p("How many days are there in a week?", "days week"),
    _p("What is the capital of Japan?", "capital japan"),
    _p("What do bees make?", "bees make"),
    _p("What is ten minus three?", "ten minus three"),
    _p("What is the largest planet in our solar system?", "largest planet"),
    _p("My name is Anna.", "name anna"),
    _p("What is my name?", "my name"),
    _p("What's the weather in Paris?", "weather paris"),
    _p("Is it raining in London right now?", "raining london"),
    _p("How warm is it in Tokyo today?", "warm tokyo"),
    _p("Tell me the weather for Berlin.", "weather berlin"),
    _p("Do I need an umbrella in Seattle today?", "umbrella seattle"),
    _p("What's the temperature in Madrid?", "temperature madrid"),
    _p("Is it sunny in Rome?", "sunny rome"),
    _p("Book a table for four at Luigi's at 8pm.", "table four luigi's"),
    _p("Reserve a table for two at Nobu at 7pm.", "reserve two nobu seven"),
    _p("Can you get me a table for six at the Ivy at 9pm?", "six ivy nine"),
    _p("I'd like to book Chez Marie for three people at 6pm.", "chez marie three six"),
    _p("Book Sakura for five at 8:30pm please.", "sakura five"),
    _p("Please reserve a table at Roma for two at noon.", "roma two noon"),
    _p("Where is my order 12345?", "order 12345"),
    _p("What's the status of order 98765?", "status 98765"),
    _p("Has my order 55501 shipped yet?", "55501 shipped"),
    _p("Can you check order number 4242 for me?", "order 4242"),
    _p("Track my order 31337.", "track 31337"),
    _p("Is order 77777 delivered?", "77777 delivered"),
    _p("Who wrote Romeo and Juliet?", "wrote romeo juliet"),
    _p("Why is the sky blue?", "sky blue"),
    _p("How do I boil an egg?", "boil egg"),
    _p("What language do people speak in Brazil?", "language brazil"),
    _p("What's the tallest mountain in the world?", "tallest mountain"),
    _p("How do you say thank you in French?", "thank french"),
    _p("What color is a banana?", "color|colour banana"),
    _p("Set a timer for fifteen minutes.", "timer fifteen minutes"),
    _p("Play some jazz music.", "play jazz"),
    _p("How far is the moon from the earth?", "far moon earth"),
    _p("Remind me to buy milk tomorrow.", "remind milk tomorrow"),
    _p("What time is it in Sydney?", "time sydney"),
    _p("Translate good morning into Spanish.", "good morning spanish"),
    _p("My name is Oliver and I live in Dublin.", "oliver dublin"),
    _p("What is nine times nine?", "nine times"),
    _p("Send a message to Priya.", "message priya"),
    _p("How many ounces are in a pound?", "ounces pound"),
    _p("Turn off the lights in the kitchen.", "lights kitchen"),
)

#: voice kind -> (voice, rate) variants: the spoken evaluation's, and three more espeak-ng ones.
VOICES = {
    "piper": EVAL_VOICES["piper"],
    "espeak": (*EVAL_VOICES["espeak"], ("en-us", 140), ("en-us+m3", 175), ("en-gb+f2", 160)),
}

#: One utterance of a run: (probe, voice kind, voice, rate, lead-in s, noise seed).
Utterance = tuple[Probe, str, str, float, float, int]


@dataclass
class Heard:
    """One utterance's result."""

    kind: str
    voice: str
    rate: float
    text: str
    heard: str
    keys_kept: int
    keys: int
    wer: float
    ms: float
    confidence: float


def normal(text: str) -> str:
    """``text`` with digit groups joined ("55,501" -> "55501"): a recognizer writes a
    spoken number either way."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


def score(probe: Probe, heard: str) -> tuple[int, float]:
    """Key words of ``probe`` found in ``heard``, and the word error rate."""
    said = set(words_of(normal(heard)))
    kept = sum(any(k in said for k in key.split("|")) for key in probe.keys)
    return kept, eval_wer(normal(probe.text), normal(heard))


def plan(kinds: list[str], probes: tuple[Probe, ...]) -> list[Utterance]:
    """Every probe in every voice of each kind, lead-ins in turn; deterministic."""
    runs: list[Utterance] = []
    for kind in kinds:
        for v, (voice, rate) in enumerate(VOICES[kind]):
            for i, probe in enumerate(probes):
                lead = LEAD_INS_S[(i + v) % len(LEAD_INS_S)]
                runs.append((probe, kind, voice, float(rate), lead, 1000 * v + i))
    return runs


def utterance_audio(spec: Utterance) -> np.ndarray:
    """The audio the engine would hear: the probe composed by the spoken evaluation's
    rules (lead-in, noise), cut from the turn tracker's pre-roll before the speech to its
    tail after it."""
    probe, kind, voice, rate, lead, seed = spec
    units, start_s, end_s = compose(Item((probe.text,), ("",)), kind, voice, rate, lead, seed)
    audio = np.concatenate(units)
    rules = UtteranceRules()
    start = max(0, int((start_s - rules.pre_roll_s) * RATE))
    return audio[start : int((end_s + rules.tail_s) * RATE)]


def cached_audio(spec: Utterance, cache: Path) -> np.ndarray:
    """``utterance_audio``, kept in ``cache`` under a name made of everything it depends on."""
    probe, kind, voice, rate, lead, seed = spec
    key = re.sub(r"[^a-z0-9]+", "-", f"{kind} {voice} {rate} {lead} {seed} {probe.text}".lower())
    path = cache / f"{key[:150]}.npy"
    if path.is_file():
        return np.load(path)
    audio = utterance_audio(spec)
    np.save(path, audio)
    return audio


def load(
    asr: str, context: str | None = None, precision: str = "auto"
) -> Callable[[np.ndarray], tuple[str, float]]:
    """The engine's hearing: Whisper base and Moonshine base-en (``both``; ``closely``: with
    their beam searches' readings, ``Ears.hear_closely``) or Whisper base alone
    (``whisper``), one torch thread each as the engine runs them; ``context`` goes with
    every utterance (the words a session would give Whisper's prompt); ``precision`` as the
    worker's ``--asr-precision``."""
    import torch

    from omnifabric.worker.engines.reference import moonshine
    from omnifabric.worker.engines.reference.asr import Transcriber
    from omnifabric.worker.engines.reference.hearing import Ears

    torch.set_num_threads(1)
    whisper = Transcriber(precision=precision)
    if asr == "whisper":
        return lambda audio: whisper.hear(audio, context)
    ears = Ears(whisper, moonshine.Moonshine(precision=precision))
    hear = ears.hear_closely if asr == "closely" else ears.hear
    return lambda audio: hear(audio, context)


def run(
    runs: list[Utterance], hear: Callable[[np.ndarray], tuple[str, float]], cache: Path
) -> list[Heard]:
    """Every utterance heard (once unmeasured first, to warm the recognizers), scored."""
    audios = [cached_audio(spec, cache) for spec in runs]
    if audios:
        hear(audios[0])
    out = []
    for spec, audio in zip(runs, audios, strict=True):
        probe, kind, voice, rate, _, _ = spec
        t0 = time.perf_counter()
        heard, confidence = hear(audio)
        ms = (time.perf_counter() - t0) * 1000.0
        kept, error = score(probe, heard)
        keys = len(probe.keys)
        out.append(Heard(kind, voice, rate, probe.text, heard, kept, keys, error, ms, confidence))
    return out


def outcomes(group: list[Heard], repair_below: float) -> tuple[int, int, int]:
    """What a conversation gets from these hearings, by the engine's rule: (answered with
    every key word heard, answered on a word misheard, asked to say it again: a confidence
    under ``repair_below``)."""
    asked = sum(r.confidence < repair_below for r in group)
    right = sum(r.confidence >= repair_below and r.keys_kept == r.keys for r in group)
    return right, len(group) - asked - right, asked


def table(results: list[Heard], repair_below: float) -> str:
    """One row per voice kind and one for all; ``repair_below``: the engine's threshold for
    asking again (``ReferenceEngine.repair_below``)."""
    from omnifabric.common.stats import percentile

    groups: dict[str, list[Heard]] = {}
    for r in results:
        groups.setdefault(r.kind, []).append(r)
    groups["all"] = results
    rows = [
        "| voices | utterances | all key words kept | key words kept | WER "
        "| answered right / wrong / asked again | ms p50 / p90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, group in groups.items():
        n = len(group)
        whole = sum(r.keys_kept == r.keys for r in group)
        kept, keys = sum(r.keys_kept for r in group), sum(r.keys for r in group)
        right, wrong, asked = outcomes(group, repair_below)
        ms = [r.ms for r in group]
        rows.append(
            f"| {name} | {n} | {whole}/{n} ({100 * whole / max(1, n):.1f}%) "
            f"| {kept}/{keys} ({100 * kept / max(1, keys):.1f}%) "
            f"| {100 * float(np.mean([r.wer for r in group])):.1f}% "
            f"| {right} / {wrong} / {asked} "
            f"| {percentile(ms, 50):.0f} / {percentile(ms, 90):.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.eval_hearing", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--asr", choices=["both", "closely", "whisper"], default="both")
    parser.add_argument(
        "--asr-precision",
        choices=ASR_PRECISIONS,
        default="auto",
        help="the recognizers' arithmetic, as the worker's --asr-precision",
    )
    parser.add_argument("--voices", default="piper,espeak", help="voice kinds: piper, espeak")
    parser.add_argument("--limit", type=int, help="only the first N probes")
    parser.add_argument(
        "--context",
        help="text given to Whisper's prompt with every utterance (default: the engine's "
        'HEARING_PRIMER; "" for none)',
    )
    parser.add_argument("--cache", type=Path, help="folder for rendered speech")
    parser.add_argument("--out", type=Path, help="folder for results.json and table.md")
    parser.add_argument("--label", default="", help="name of this run in the output")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.voices.split(",") if k.strip()]
    for kind in kinds:
        if kind not in VOICES:
            parser.error(f"unknown voice kind {kind!r}: choose from {', '.join(VOICES)}")
    cache = args.cache or Path(tempfile.gettempdir()) / "omnifabric-eval-hearing"
    cache.mkdir(parents=True, exist_ok=True)
    runs = plan(kinds, PROBES[: args.limit] if args.limit else PROBES)
    t0 = time.perf_counter()
    from omnifabric.worker.engines.reference.engine import HEARING_PRIMER, ReferenceEngine

    if args.context is None:
        args.context = HEARING_PRIMER
    hear = load(args.asr, args.context or None, args.asr_precision)
    print(f"recognizers loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    results = run(runs, hear, cache)
    summary = table(results, ReferenceEngine.repair_below)
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    context = f", context {args.context!r}" if args.context else ""
    label = f"{args.label}: " if args.label else ""
    precision = f" ({args.asr_precision})" if args.asr_precision != "auto" else ""
    print(f"\n{label}asr {args.asr}{precision}{context}, load average {load_avg}")
    print(summary)
    for r in results:
        if r.keys_kept < r.keys:
            print(f"- {r.kind}:{r.voice}@{r.rate:g}: {r.text!r} heard {r.heard!r}")
    if args.out:
        save_run(args.out, results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
