"""gpu_sessions' batched mode: N sessions at once on one engine, each unit of all of them in
one batched step (the engine's Stepper), against the same N served one by one
(time-sliced), in the same run.

Every session gets the fixture's units (each session starting at another offset, so the
rows differ); all N units of a round arrive together, as when N callers speak at once. A
unit's latency is from the round's start to its result: in a batched step, the step's end
(every row's result leaves together); time-sliced, the end of its own generate, after the
units of the sessions before it in the round. A round's deferred finalizes run after the
results (batched: one finalize call for all); the next round starts when they are done,
so a round's cycle (step and finalize) against the unit length says whether N sessions
keep real time. Per N: the step's phases (the engine's own, summed over the step), units
per second over the whole run, unit latency p50/p95, deadline misses (units later than one
unit length), forwards of the LLM backbone per round (minicpmo: counted by a hook on the
module, so both modes are counted alike), peak memory.

    python -m omnifabric.tools.gpu_sessions --engine minicpmo --model-dir DIR \\
        --device cuda:0 --batched 1,2,4,8,16 --units 12
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.worker.engine import DuplexSettings, Engine, EngineSession, Stepper, StepRow

#: The modes compared: one batched step per round, the same with the vocoder run per speaker
#: (minicpmo's --serial-vocoder), the same with ragged eager decode forwards (minicpmo's
#: --cuda-graphs off), the same with the host reading each decode forward's tokens before
#: the next (minicpmo's --decode-ahead 0), or the units one by one.
BATCHED = "batched"
SERIAL_VOCODER = "serial-vocoder"
EAGER = "batched-eager"
IN_STEP = "batched-in-step"
SLICED = "time-sliced"
STEPPED = (BATCHED, SERIAL_VOCODER, EAGER, IN_STEP)
#: Output audio: samples a second (24 kHz), and the share of a unit a speaking unit may lack
#: before it counts as a gap a listener hears.
OUT_RATE = 24000
GAP_SHARE = 0.9


def parse_counts(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]; ValueError for anything but positive integers."""
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--batched takes positive session counts, e.g. 1,2,4,8: {text!r}")
    return counts


class _ForwardCounter:
    """Counts the forwards of the engine's LLM backbone (a hook on its module: the same
    count whichever path calls it), for the engines that have one (minicpmo)."""

    def __init__(self, module: Any, replays: Callable[[], int]) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._seen)
        self.replays = replays
        self.replayed = replays()

    def _seen(self, *_: Any) -> None:
        self.count += 1

    @classmethod
    def on(cls, engine: Engine, stepper: Stepper | None) -> _ForwardCounter | None:
        """The counter of the engine's backbone; forwards replayed as CUDA graphs (no hook
        sees them) come from the stepper's graph_replays."""
        backbone = getattr(getattr(getattr(engine, "model", None), "llm", None), "model", None)
        if not hasattr(backbone, "register_forward_pre_hook"):
            return None
        return cls(backbone, lambda: int(getattr(stepper, "graph_replays", 0)))

    def take(self) -> int:
        replayed = self.replays()
        count = self.count + replayed - self.replayed
        self.count, self.replayed = 0, replayed
        return count

    def remove(self) -> None:
        self.handle.remove()


def _open(engine: Engine, n: int, tag: str, settings: DuplexSettings) -> list[EngineSession]:
    sessions = []
    try:
        for i in range(n):
            session = engine.open_session(f"batched-{tag}-{n}-{i}", "audio")
            sessions.append(session)
            session.prepare("", None, None, settings)
    except Exception:
        _close(sessions)
        raise
    return sessions


def _close(sessions: Sequence[EngineSession]) -> None:
    for session in sessions:
        try:
            session.stop()
        finally:
            session.close()


@contextlib.contextmanager
def engine_mode(engine: Engine, stepper: Stepper | None, mode: str) -> Iterator[None]:
    """The engine as `mode` runs it, where the engine has the choice: the vocoder per
    speaker in SERIAL_VOCODER (batched otherwise); ragged eager decode forwards in EAGER
    (the engine's own --cuda-graphs otherwise); the host between decode forwards in
    IN_STEP (the engine's own --decode-ahead otherwise). The step's CUDA graphs captured
    before the run, as a worker's warm-up does (none to capture on a CPU). As it was
    afterwards."""
    vocoder = getattr(engine, "vocoder_batched", None)
    graphs = getattr(engine, "cuda_graphs", None)
    reset = getattr(stepper, "reset_decode", None)
    ahead = getattr(engine, "decode_ahead", None)
    capture = getattr(stepper, "capture_graphs", None)
    if vocoder is not None:
        engine.vocoder_batched = mode != SERIAL_VOCODER  # type: ignore[attr-defined]
    if mode == EAGER and reset is not None:
        reset("off")
    elif capture is not None:
        capture()
    if mode == IN_STEP and hasattr(engine, "decode_ahead"):
        engine.decode_ahead = 0
    try:
        yield
    finally:
        if vocoder is not None:
            engine.vocoder_batched = vocoder  # type: ignore[attr-defined]
        if mode == EAGER and reset is not None:
            reset(graphs)
        if mode == IN_STEP and hasattr(engine, "decode_ahead"):
            engine.decode_ahead = ahead


def _units(units: list[np.ndarray], count: int, offset: int) -> list[np.ndarray]:
    return [units[(offset + k) % len(units)] for k in range(count)]


def run(
    engine: Engine,
    stepper: Stepper | None,
    mode: str,
    n: int,
    units: list[np.ndarray],
    count: int,
    unit_s: float,
    sync: Callable[[], None],
    settings: DuplexSettings | None = None,
    warmup: int = 0,
) -> dict[str, Any]:
    """`n` sessions, `count` units each, in `mode`; the figures of the run. With `warmup`,
    each session's first `warmup` units run untimed before them (a bucket's first kernels,
    its CUDA graphs' captures): their rounds' ms are kept apart, as `warmup_ms`."""
    if mode in STEPPED and stepper is None:
        raise ValueError(f"the {engine.name} engine has no batched step")
    settings = settings or DuplexSettings(temperature=0)
    sessions = _open(engine, n, mode, settings)
    counter = _ForwardCounter.on(engine, stepper)
    latencies: list[float] = []
    cycles: list[float] = []
    phases: dict[str, float] = {}
    forwards: list[int] = []
    texts = [""] * n
    speaking = 0
    speech = _Speech(n, unit_s)
    cache_bytes: list[int] = []
    voices = 0
    try:
        feeds = [_units(units, count + warmup, 3 * i) for i in range(n)]
        warmup_ms = _warm(stepper, mode, sessions, feeds, warmup, sync, speech)
        if counter is not None:
            counter.take()
        feeds = [feed[warmup:] for feed in feeds]
        sync()
        started = time.perf_counter()
        for k in range(count):
            t0 = time.perf_counter()
            results, unit_latency = _round(stepper, mode, sessions, feeds, k, sync, phases)
            latencies += unit_latency
            sync()
            cycles.append(time.perf_counter() - t0)
            if counter is not None:
                forwards.append(counter.take())
            for i, result in enumerate(results):
                texts[i] += result.text
                speaking += not result.is_listen
                speech.add(i, k, result, unit_latency[i])
        wall = time.perf_counter() - started
        measure = getattr(engine, "vocoder_cache_bytes", None)
        if measure is not None:
            cache_bytes = [int(measure(s)) for s in sessions]
            voices = int(getattr(engine, "voice_bytes", lambda: 0)())
        sets = getattr(stepper, "graph_sets", None)
        graphs = {name: part.figures() for name, part in sets().items()} if sets else {}
    finally:
        if counter is not None:
            counter.remove()
        _close(sessions)
    return {
        "mode": mode,
        "sessions": n,
        "units": n * count,
        "warmup_ms": warmup_ms,
        "speaking_units": speaking,
        "wall_s": wall,
        "units_per_s": n * count / wall if wall > 0 else float("nan"),
        **_timing(latencies, cycles, unit_s),
        "phases_ms_per_step": {p: ms / count for p, ms in sorted(phases.items())},
        "llm_forwards_per_round": float(np.mean(forwards)) if forwards else None,
        "texts": texts,
        **speech.figures(wall),
        "vocoder_cache_mib_per_session": (
            float(np.mean(cache_bytes)) / 2**20 if cache_bytes else None
        ),
        "vocoder_voices_mib": voices / 2**20 if cache_bytes else None,
        "graphs": graphs,
        "vocoder_tf32": getattr(engine, "vocoder_in_tf32", None),
    }


def _timing(latencies: list[float], cycles: list[float], unit_s: float) -> dict[str, Any]:
    """A run's unit latencies and round cycles (s) as its figures, and whether it held real
    time (unit p95 and the mean cycle within a unit)."""
    return {
        "unit_ms": {
            "p50": percentile([x * 1000 for x in latencies], 50),
            "p95": percentile([x * 1000 for x in latencies], 95),
        },
        "cycle_ms": {
            "mean": float(np.mean(cycles)) * 1000,
            "p95": percentile([x * 1000 for x in cycles], 95),
        },
        "deadline_misses": sum(x > unit_s for x in latencies),
        "real_time": percentile(latencies, 95) < unit_s and float(np.mean(cycles)) < unit_s,
    }


def _warm(
    stepper: Stepper | None,
    mode: str,
    sessions: Sequence[EngineSession],
    feeds: list[list[np.ndarray]],
    warmup: int,
    sync: Callable[[], None],
    speech: _Speech,
) -> list[float]:
    """The run's untimed first `warmup` rounds; each one's ms. A reply they leave open is
    marked so (_Speech.before)."""
    spent = []
    for k in range(warmup):
        sync()
        t0 = time.perf_counter()
        results, _ = _round(stepper, mode, sessions, feeds, k, sync, {})
        sync()
        spent.append((time.perf_counter() - t0) * 1000)
        for i, result in enumerate(results):
            speech.before(i, result)
    return spent


def _round(
    stepper: Stepper | None,
    mode: str,
    sessions: Sequence[EngineSession],
    feeds: list[list[np.ndarray]],
    k: int,
    sync: Callable[[], None],
    phases: dict[str, float],
) -> tuple[list[Any], list[float]]:
    """Unit k of every session (one batched step, or one by one) and their finalizes; the
    results and each unit's latency from the round's start. A step's phases add to
    `phases`. Raises a row's error."""
    t0 = time.perf_counter()
    if mode != SLICED:
        assert stepper is not None
        rows = [StepRow(s, feeds[i][k], [], 1, False) for i, s in enumerate(sessions)]
        outcome = stepper.step(rows)
        sync()
        done = time.perf_counter() - t0
        results = []
        for row in outcome.rows:
            if isinstance(row, Exception):
                raise row
            results.append(row[1])
        for phase, ms in outcome.phases_ms.items():
            phases[phase] = phases.get(phase, 0.0) + ms
        failed = [e for e in stepper.finalize(sessions) if e is not None]
        if failed:
            raise failed[0]
        return results, [done] * len(sessions)
    results, latency = [], []
    for i, session in enumerate(sessions):
        session.prefill(feeds[i][k], [], 1)
        results.append(session.generate(False))
        sync()
        latency.append(time.perf_counter() - t0)
    for session in sessions:
        session.finalize()
    return results, latency


class _Speech:
    """The audio of a run's speaking units: seconds out, gaps (a speaking unit short of
    GAP_SHARE of a unit's audio that does not end its turn), and first audio: from the start
    of the round of a reply's first speaking unit to the result that first carries audio."""

    def __init__(self, n: int, unit_s: float) -> None:
        self.unit_s = unit_s
        self.seconds = 0.0
        self.speaking = 0
        self.gaps = 0
        self.reply_start: list[int | None] = [None] * n
        self.first_audio_s: list[float] = []

    def before(self, i: int, result: Any) -> None:
        """A result of session i's untimed warm-up: a reply it leaves open has had its first
        audio outside the figures."""
        self.reply_start[i] = None if result.is_listen or result.end_of_turn else -1

    def add(self, i: int, k: int, result: Any, latency_s: float) -> None:
        if result.is_listen:
            self.reply_start[i] = None
            return
        self.speaking += 1
        samples = 0 if result.audio is None else int(np.asarray(result.audio).size)
        self.seconds += samples / OUT_RATE
        if samples < GAP_SHARE * OUT_RATE * self.unit_s and not result.end_of_turn:
            self.gaps += 1
        start = self.reply_start[i]
        if start is None:
            self.reply_start[i] = start = k
        if samples and start >= 0:
            self.first_audio_s.append((k - start) * self.unit_s + latency_s)
            self.reply_start[i] = -1  # this reply's first audio is counted
        if result.end_of_turn:
            self.reply_start[i] = None

    def figures(self, wall_s: float) -> dict[str, Any]:
        first = self.first_audio_s
        return {
            "audio_s": self.seconds,
            "audio_s_per_s": self.seconds / wall_s if wall_s > 0 else float("nan"),
            "audio_gaps": self.gaps,
            "first_audio_ms": {
                "replies": len(first),
                "p50": percentile([x * 1000 for x in first], 50) if first else None,
                "p95": percentile([x * 1000 for x in first], 95) if first else None,
            },
        }


def table(rows: list[dict[str, Any]]) -> str:
    """The runs as a fixed-width table, batched beside time-sliced for each N."""
    head = (
        f"{'N':>3} {'mode':<11} {'units/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'cycle':>8}"
        f" {'late':>5} {'rt':>3} {'peak MiB':>9} {'audio/s':>7} {'gaps':>4}"
        f" {'1st audio':>9}  phases ms per step"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = r.get("peak_bytes")
        phases = " ".join(
            f"{p} {ms:.0f}"
            for p, ms in r["phases_ms_per_step"].items()
            if ms >= 0.5 and p not in ("all", "prefill", "generate")  # the parts, not sums
        )
        if r["llm_forwards_per_round"] is not None:
            phases = f"LLM forwards {r['llm_forwards_per_round']:.1f}; {phases}"
        lines.append(
            f"{r['sessions']:>3} {r['mode']:<11} {r['units_per_s']:8.2f}"
            f" {r['unit_ms']['p50']:8.0f} {r['unit_ms']['p95']:8.0f}"
            f" {r['cycle_ms']['mean']:8.0f} {r['deadline_misses']:>5}"
            f" {'yes' if r['real_time'] else 'no':>3}"
            f" {'-' if peak is None else f'{peak / 2**20:9.0f}':>9}"
            f" {r['audio_s_per_s']:7.2f} {r['audio_gaps']:>4}"
            f" {_ms(r['first_audio_ms']['p50']):>9}  {phases}"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per N, batched units/s over time-sliced; the largest N each mode holds in real time."""
    lines = []
    by_n: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_n.setdefault(r["sessions"], {})[r["mode"]] = r
    for n, modes in sorted(by_n.items()):
        if BATCHED in modes and SLICED in modes:
            ratio = modes[BATCHED]["units_per_s"] / modes[SLICED]["units_per_s"]
            lines.append(f"N={n}: batched/time-sliced units per second = {ratio:.2f}")
        if BATCHED in modes and SERIAL_VOCODER in modes:
            a, b = modes[BATCHED], modes[SERIAL_VOCODER]
            va = a["phases_ms_per_step"].get("vocoder", 0.0)
            vb = b["phases_ms_per_step"].get("vocoder", 0.0)
            lines.append(
                f"N={n}: vocoder ms per step batched {va:.1f} vs per speaker {vb:.1f}; "
                f"cycle {a['cycle_ms']['mean']:.0f} vs {b['cycle_ms']['mean']:.0f} ms"
            )
        if BATCHED in modes and EAGER in modes:
            lines.append(_decode_line(n, modes[BATCHED], modes[EAGER], "eager"))
        if BATCHED in modes and IN_STEP in modes:
            lines.append(_decode_line(n, modes[BATCHED], modes[IN_STEP], "in step"))
        if modes.get(BATCHED, {}).get("graphs"):
            lines.append(f"N={n}: {_graphs_line(modes[BATCHED]['graphs'])}")
        cache = next((r["vocoder_cache_mib_per_session"] for r in modes.values()), None)
        if cache is not None:
            tf32 = next((r.get("vocoder_tf32") for r in modes.values()), None)
            flow = "" if tf32 is None else "; its flow in " + ("TF32" if tf32 else "full float32")
            voices = next((r.get("vocoder_voices_mib") for r in modes.values()), None)
            shared = "" if voices is None else f", and {voices:.1f} MiB of voices they share"
            lines.append(f"N={n}: vocoder caches {cache:.1f} MiB per session{shared}{flow}")
    for mode in (*STEPPED, SLICED):
        held = [r["sessions"] for r in rows if r["mode"] == mode and r["real_time"]]
        ran = [r["sessions"] for r in rows if r["mode"] == mode]
        if ran:
            best = max(held) if held else 0
            lines.append(f"{mode}: the largest N that holds real time (unit p95 < 1 s): {best}")
    return lines


def _graphs_line(graphs: dict[str, dict[str, Any]]) -> str:
    """The batched mode's graph sets after its run: static or ragged, captures and replays
    so far (cumulative over the tool's runs), or why graphs stopped."""
    parts = []
    for name, g in graphs.items():
        if g["failure"]:
            parts.append(f"{name} eager after a failed capture ({g['failure']})")
        elif g["graphs"]:
            parts.append(f"{name} {g['captured']} graphs, {g['replays']} replays")
        else:
            parts.append(f"{name} {'static' if g['static'] else 'ragged'} eager")
    return "graphs: " + "; ".join(parts)


def _decode_line(n: int, static: dict[str, Any], eager: dict[str, Any], other: str) -> str:
    """Decode per step and per decode forward (the round's LLM forwards less its prefill),
    the engine's own decode (static shapes, graphs on CUDA, the device ahead of the host)
    against another way (ragged eager forwards; the host between forwards)."""

    def per_forward(r: dict[str, Any]) -> str:
        forwards = r["llm_forwards_per_round"]
        if not forwards or forwards <= 1:
            return "-"
        return f"{r['phases_ms_per_step'].get('decode', 0.0) / (forwards - 1):.1f}"

    a = static["phases_ms_per_step"].get("decode", 0.0)
    b = eager["phases_ms_per_step"].get("decode", 0.0)
    return (
        f"N={n}: decode ms per step {a:.1f} vs {other} {b:.1f} (per forward "
        f"{per_forward(static)} vs {per_forward(eager)}); cycle "
        f"{static['cycle_ms']['mean']:.0f} vs {eager['cycle_ms']['mean']:.0f} ms"
    )
