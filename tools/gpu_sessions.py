"""Sessions one after another on one engine loaded in this process: per-unit compute and the
memory left after each session (for a lent GPU machine; runs on CPU too, for tests).

    python -m omnifabric.tools.gpu_sessions --engine reference --device cuda:0 --sessions 5 \\
        --json out.json

With --batched 1,2,4,8: N sessions at once instead, batched steps against time-sliced units
in the same run (tools.batched).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.tools import batched, step_profile
from omnifabric.tools.probe import read_wav_16k, split_units
from omnifabric.worker.config import SWITCHES, WorkerConfig
from omnifabric.worker.engine import DuplexSettings, Engine
from omnifabric.worker.engines.memory import cleanup, rss_bytes
from omnifabric.worker.engines.registry import load_engine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURE = "tests/fixtures/speech/question.wav"
MIB = 1024 * 1024
#: Steps --profile records at most (the trace grows with every kernel; the first units of
#: new sessions mostly listen, so a few more than that show the speaking phases).
PROFILE_STEPS = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.gpu_sessions", description=__doc__
    )
    parser.add_argument(
        "--engine",
        default="reference",
        choices=("reference", "minicpmo", "synthetic"),
        help="synthetic: only to try the tool (its compute is a sleep)",
    )
    parser.add_argument("--device", default="cuda:0", help="cpu, cuda or cuda:N (cuda:0)")
    parser.add_argument("--sessions", type=int, default=3, help="sessions, one after another")
    parser.add_argument(
        "--model-dir",
        "--model-path",
        dest="model_path",
        default=None,
        help="model folder (minicpmo)",
    )
    parser.add_argument("--attn", default=None, help="attention implementation (minicpmo)")
    parser.add_argument("--compile", action="store_true", help="torch.compile (minicpmo)")
    parser.add_argument(
        "--fixture",
        default=DEFAULT_FIXTURE,
        help="speech WAV (or a .npy of its 16 kHz float32 samples)",
    )
    parser.add_argument("--tail-s", type=int, default=3, help="silent units after the fixture")
    parser.add_argument(
        "--warmup-sessions",
        type=int,
        default=0,
        help="untimed fixture sessions after engine.warmup(), before the memory baseline",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    _batched_options(parser)
    _engine_options(parser)
    return parser


def _batched_options(parser: argparse.ArgumentParser) -> None:
    """--batched and what goes with it."""
    parser.add_argument(
        "--batched",
        default=None,
        help="session counts, e.g. 1,2,4,8: N sessions at once, batched steps against "
        "time-sliced units (the engine's slots are set to the largest)",
    )
    parser.add_argument(
        "--units", type=int, default=None, help="units per session with --batched (the fixture's)"
    )
    parser.add_argument(
        "--warmup-units",
        type=int,
        default=0,
        help="with --batched: untimed units each session runs first in every run (a bucket's "
        "first kernels and graph captures), their rounds' ms reported apart",
    )
    parser.add_argument(
        "--modes",
        default=f"{batched.BATCHED},{batched.SLICED}",
        help="with --batched: which to run (batched, serial-vocoder: batched with the vocoder "
        "per speaker, batched-eager: batched with ragged eager decode forwards, "
        "batched-in-step: batched with the host between decode forwards, time-sliced)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --batched: after the runs, profile a few steps of the largest N: a torch "
        "profiler trace in DIR and the GPU's busy share per phase",
    )


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """The worker's engine settings the tool passes on."""
    parser.add_argument(
        "--cuda-graphs",
        choices=SWITCHES,
        default=None,
        help="minicpmo: the batched decode in static shapes replayed as CUDA graphs (worker's)",
    )
    parser.add_argument(
        "--vocoder-tf32",
        choices=SWITCHES,
        default=None,
        help="minicpmo: the vocoder flow's float32 matrix products in TF32 on CUDA (worker's)",
    )
    parser.add_argument(
        "--decode-ahead",
        type=int,
        default=None,
        help="minicpmo: decode forwards the GPU runs before the host reads their tokens "
        "(worker's; 0: the host reads each forward's tokens first)",
    )
    parser.add_argument(
        "--batch-share",
        type=float,
        default=None,
        help="synthetic engine: what a batched step's extra row costs (a share of a unit)",
    )


def resolve_fixture(name: str) -> Path:
    """The fixture as given, else relative to the repo root (so any cwd works)."""
    path = Path(name)
    if not path.exists() and not path.is_absolute() and (ROOT / path).exists():
        return ROOT / path
    return path


class Meter:
    """Memory in use on the engine's device: CUDA allocated bytes, or process RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.torch = None
        self.device = device
        self.kind = "cpu"
        if device.startswith("cuda"):
            import torch

            self.torch = torch
            self.kind = "cuda"
            # memory.cleanup() measures the current CUDA device: make that ours ("cuda" alone
            # already is, and set_device refuses a device without an index).
            index = torch.device(device).index
            if index is not None:
                torch.cuda.set_device(index)

    def now(self) -> int:
        if self.torch is not None:
            return int(self.torch.cuda.memory_allocated())
        return rss_bytes()

    def sync(self) -> None:
        """Wait for queued kernels, so a unit's time includes its GPU work."""
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.torch is not None:
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.torch is not None else None

    def cleanup(self) -> tuple[int, int]:
        """memory.cleanup(); its before/after bytes when it measured our device kind."""
        report = cleanup()
        if report.device == self.kind:
            return report.before_bytes, report.after_bytes
        # e.g. --device cpu on a CUDA machine: cleanup measured the GPU, we want RSS.
        now = self.now()
        return now, now


def make_config(args: argparse.Namespace) -> tuple[WorkerConfig, list[str]]:
    """WorkerConfig from the environment and flags; the flags this config has no field for."""
    fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    wanted = {
        "device": args.device,
        "model_path": args.model_path,
        "attn": args.attn,
        "compile": True if args.compile else None,
        "cuda_graphs": args.cuda_graphs,
        "decode_ahead": args.decode_ahead,
        "vocoder_tf32": args.vocoder_tf32,
    }
    overrides: dict[str, Any] = {"engine": args.engine}
    if args.batched:
        overrides["slots"] = max(batched.parse_counts(args.batched))
    if args.batch_share is not None:
        overrides["synthetic_batch_share"] = args.batch_share
    missing = []
    for name, value in wanted.items():
        if value is None:
            continue
        if name in fields:
            overrides[name] = value
        else:
            missing.append(name)
    return WorkerConfig.from_env(**overrides), missing


def load(args: argparse.Namespace, config: WorkerConfig, missing: list[str]) -> Engine:
    """The engine, loaded on args.device (directly for "reference" when the config cannot
    carry a device yet)."""
    if "device" in missing:
        if args.engine != "reference":
            raise ValueError(f"this WorkerConfig has no device field: cannot put {args.engine}")
        from omnifabric.worker.engines.reference.engine import ReferenceEngine
        from omnifabric.worker.engines.reference.turns import TurnRules

        rules = TurnRules(
            min_speech_s=config.turn_min_speech_s, end_silence_s=config.turn_end_silence_s
        )
        engine: Engine = ReferenceEngine(slots=config.slots or 5, rules=rules, device=args.device)
        engine.load()
        return engine
    return load_engine(args.engine, config)


def run_session(engine: Engine, units: list[np.ndarray], index: int, meter: Meter) -> dict:
    """One session over the units; compute per unit and memory around it."""
    meter.sync()
    meter.reset_peak()
    before = meter.now()
    compute: list[float] = []
    listen = speak = turns = 0
    text: list[str] = []
    session = engine.open_session(f"gpu-sessions-{index}", "audio")
    try:
        session.prepare("", None, None, DuplexSettings())
        for unit in units:
            t0 = time.perf_counter()
            session.prefill(unit, [], 1)
            result = session.generate(False)
            session.finalize()
            meter.sync()
            compute.append((time.perf_counter() - t0) * 1000.0)
            listen += result.is_listen
            speak += not result.is_listen
            turns += result.end_of_turn
            text.append(result.text)
        session.stop()
    finally:
        session.close()
    del session  # the last reference: cleanup may now free its KV cache
    meter.sync()
    peak = meter.peak()
    after_close, after_cleanup = meter.cleanup()
    return {
        "session": index,
        "units": len(units),
        "listen": listen,
        "speak": speak,
        "end_of_turns": turns,
        "text": "".join(text),
        "compute_ms": {
            "p50": percentile(compute, 50),
            "p99": percentile(compute, 99),
            "max": max(compute) if compute else float("nan"),
            "mean": float(np.mean(compute)) if compute else float("nan"),
        },
        "memory": {
            "before_bytes": before,
            "after_close_bytes": after_close,
            "after_cleanup_bytes": after_cleanup,
            "peak_bytes": peak,
        },
    }


def add_deltas(sessions: list[dict], baseline: int) -> None:
    """Each memory figure's difference to the post-warm-up baseline."""
    for s in sessions:
        m = s["memory"]
        for key in ("before", "after_close", "after_cleanup"):
            m[f"{key}_vs_baseline_bytes"] = m[f"{key}_bytes"] - baseline


def table(report: dict) -> str:
    """The sessions as a fixed-width table (memory in MiB, deltas to the baseline)."""
    head = (
        f"{'#':>3} {'units':>5} {'L':>3} {'S':>3} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
        f" {'before':>9} {'closed':>9} {'cleaned':>9} {'d_base':>8} {'peak':>9}"
    )
    lines = [head, "-" * len(head)]
    for s in report["sessions"]:
        c, m = s["compute_ms"], s["memory"]
        peak = "-" if m["peak_bytes"] is None else f"{m['peak_bytes'] / MIB:9.1f}"
        lines.append(
            f"{s['session']:>3} {s['units']:>5} {s['listen']:>3} {s['speak']:>3}"
            f" {c['p50']:8.1f} {c['p99']:8.1f} {c['max']:8.1f}"
            f" {m['before_bytes'] / MIB:9.1f} {m['after_close_bytes'] / MIB:9.1f}"
            f" {m['after_cleanup_bytes'] / MIB:9.1f}"
            f" {m['after_cleanup_vs_baseline_bytes'] / MIB:+8.1f} {peak:>9}"
        )
    return "\n".join(lines)


def _batched_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """--batched's session counts and --modes. Raises ValueError naming the bad flag (of
    these, --sessions and --warmup-units)."""
    if args.sessions < 1:
        raise ValueError("--sessions must be >= 1")
    if args.warmup_units < 0:
        raise ValueError("--warmup-units must be >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    counts = batched.parse_counts(args.batched) if args.batched else []
    known = {*batched.STEPPED, batched.SLICED}
    if not modes or set(modes) - known:
        raise ValueError(f"--modes takes {', '.join(sorted(known))}")
    if args.units is not None and args.units < 1:
        raise ValueError("--units must be >= 1")
    if args.profile is not None and not counts:
        raise ValueError("--profile needs --batched")
    return counts, modes


def _fixture_audio(path: Path) -> np.ndarray:
    """The fixture as mono float32 at 16 kHz: a WAV, or a .npy of those samples (what
    tools/gpu/bundle.sh writes for a GPU host without the WAV reader's FFmpeg wheel)."""
    if path.suffix == ".npy":
        return np.load(path).astype(np.float32, copy=False).reshape(-1)
    return read_wav_16k(path)


def main(argv: list[str] | None = None) -> int:
    """Load, warm up, run the sessions, print the table; 1 when GPU memory leaked, 2 on error."""
    args = build_parser().parse_args(argv)
    try:
        counts, modes = _batched_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fixture = resolve_fixture(args.fixture)
    units = split_units(_fixture_audio(fixture), args.tail_s)
    try:
        config, missing = make_config(args)
        for name in missing:
            print(f"note: this WorkerConfig has no {name!r} field; --{name} not passed on")
        t0 = time.perf_counter()
        # The engine checks the device first, so a missing GPU gets its clear message.
        engine = load(args, config, missing)
        meter = Meter(args.device)
    except Exception as exc:  # noqa: BLE001 - a bad device/model is reported, not traced
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    actual = getattr(engine, "device", None)
    if actual is not None and str(actual) != args.device:
        print(f"warning: asked for {args.device}, the engine reports {actual}")
    loaded = meter.now()
    t1 = time.perf_counter()
    engine.warmup()
    for i in range(args.warmup_sessions):
        run_session(engine, units, -1 - i, meter)
    warmup_s = time.perf_counter() - t1
    _, baseline = meter.cleanup()
    if counts:
        timings = {"load_s": load_s, "warmup_s": warmup_s}
        return _batched(args, engine, meter, units, counts, modes, timings)
    sessions = [run_session(engine, units, i, meter) for i in range(1, args.sessions + 1)]
    add_deltas(sessions, baseline)

    tolerance = int(config.memory_tolerance_mb * MIB)
    worst = max(s["memory"]["after_cleanup_vs_baseline_bytes"] for s in sessions)
    report = {
        "engine": args.engine,
        "device": args.device,
        "device_name": _device_name(meter),
        "memory_measure": "torch.cuda.memory_allocated" if meter.kind == "cuda" else "rss",
        "fixture": str(fixture),
        "units_per_session": len(units),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "loaded_bytes": loaded,
        "baseline_bytes": baseline,
        "tolerance_bytes": tolerance,
        # RSS moves with allocator arenas: only GPU memory is held to the tolerance.
        "leak_checked": meter.kind == "cuda",
        "leak_ok": worst <= tolerance,
        "sessions": sessions,
    }
    if meter.kind == "cpu":
        print("NOTE: ran on CPU (--device cpu): CPU timings, memory is process RSS, not GPU")
    print(
        f"engine {args.engine} on {args.device} ({report['device_name']}): load {load_s:.1f} s,"
        f" warm-up {warmup_s:.1f} s, {len(units)} units per session ({fixture.name} +"
        f" {args.tail_s} s silence)"
    )
    print(
        f"memory ({report['memory_measure']}, MiB): loaded {loaded / MIB:.1f},"
        f" baseline after warm-up {baseline / MIB:.1f}; d_base = after cleanup - baseline"
    )
    print(table(report))
    for s in sessions:
        print(f"session {s['session']} said: {s['text']!r}")
    print(
        f"worst after-cleanup growth {worst / MIB:+.1f} MiB vs tolerance"
        f" {tolerance / MIB:.1f} MiB: {'ok' if report['leak_ok'] else 'OVER'}"
        + ("" if report["leak_checked"] else " (not enforced on CPU)")
    )
    _write_json(args.json, report)
    return 1 if report["leak_checked"] and not report["leak_ok"] else 0


def _batched(
    args: argparse.Namespace,
    engine: Engine,
    meter: Meter,
    units: list[np.ndarray],
    counts: list[int],
    modes: list[str],
    timings: dict[str, float],
) -> int:
    """--batched: every N in each mode, the table, the ratios, the JSON; 1 where a run
    failed (its error kept in the JSON's `failed`, the next runs still made)."""
    print(f"loaded in {timings['load_s']:.1f} s, warm-up {timings['warmup_s']:.1f} s", flush=True)
    steps = set(batched.STEPPED) & set(modes)
    stepper = engine.stepper() if steps else None
    if steps and stepper is None:
        print(f"error: the {args.engine} engine offers no batched step here", file=sys.stderr)
        return 2
    count = args.units or len(units)
    unit_s = int(getattr(engine, "unit_samples", 16000)) / 16000
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for n in counts:
        for mode in modes:
            meter.reset_peak()
            try:
                with batched.engine_mode(engine, stepper, mode):
                    row = batched.run(
                        engine,
                        stepper,
                        mode,
                        n,
                        units,
                        count,
                        unit_s,
                        meter.sync,
                        warmup=args.warmup_units,
                    )
            except Exception as exc:  # noqa: BLE001 - one run's failure (memory, say) is a figure
                error = f"{type(exc).__name__}: {exc}"
                failed.append({"sessions": n, "mode": mode, "error": error})
                print(f"N={n} {mode}: failed: {error}", flush=True)
            else:
                row["peak_bytes"] = meter.peak()
                rows.append(row)
                print(_progress(row), flush=True)
            meter.cleanup()
            report = _report(args, meter, count, rows, failed, timings, None)
            _write_json(args.json, report, quiet=True)
    if meter.kind == "cpu":
        print("NOTE: ran on CPU (--device cpu): CPU timings, memory is process RSS, not GPU")
    print(
        f"engine {args.engine} on {args.device} ({_device_name(meter)}): {count} units per "
        f"session, all sessions' units arriving together"
    )
    print(batched.table(rows))
    for line in batched.summary(rows):
        print(line)
    profiled = None
    if args.profile is not None:
        try:
            profiled = step_profile.profile(
                engine,
                stepper,
                max(counts),
                units,
                min(count, PROFILE_STEPS),
                unit_s,
                meter.sync,
                args.profile,
            )
        except Exception as exc:  # noqa: BLE001 - the runs' figures are kept
            error = f"{type(exc).__name__}: {exc}"
            failed.append({"sessions": max(counts), "mode": "profile", "error": error})
        else:
            for line in step_profile.lines(profiled):
                print(line)
    _write_json(args.json, _report(args, meter, count, rows, failed, timings, profiled))
    for f in failed:
        print(f"N={f['sessions']} {f['mode']} failed: {f['error']}")
    return 1 if failed else 0


def _progress(row: dict[str, Any]) -> str:
    """One run's line as it ends (a run cut short by a time limit keeps the lines before)."""
    phases = ", ".join(f"{p} {ms:.0f}" for p, ms in row["phases_ms_per_step"].items())
    warm = "/".join(f"{ms:.0f}" for ms in row["warmup_ms"])
    return (
        f"N={row['sessions']} {row['mode']}: {row['units_per_s']:.2f} units/s, unit p95"
        f" {row['unit_ms']['p95']:.0f} ms, cycle {row['cycle_ms']['mean']:.0f} ms"
        + (f" (warm-up {warm} ms)" if warm else "")
        + (f"; ms a step: {phases}" if phases else "")
        + f"; audio {row['audio_s_per_s']:.1f} s/s, {row['speaking_units']} speaking units"
    )


def _report(
    args: argparse.Namespace,
    meter: Meter,
    count: int,
    rows: list[dict[str, Any]],
    failed: list[dict[str, Any]],
    timings: dict[str, float],
    profiled: dict[str, Any] | None,
) -> dict[str, Any]:
    """--batched's JSON: the runs so far (written after each run, then whole)."""
    return {
        "engine": args.engine,
        "device": args.device,
        "device_name": _device_name(meter),
        **timings,
        "units_per_session": count,
        "warmup_units": args.warmup_units,
        "runs": rows,
        "failed": failed,
        "summary": batched.summary(rows),
        "profile": profiled,
    }


def _write_json(path: Path | None, report: dict[str, Any], quiet: bool = False) -> None:
    """The report as JSON at `path` (nothing when None), replaced whole (a reader never
    sees half a file)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)
    if not quiet:
        print(f"report written to {path}")


def _device_name(meter: Meter) -> str:
    if meter.torch is not None:
        return meter.torch.cuda.get_device_name()
    import platform

    return platform.processor() or platform.machine() or "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
