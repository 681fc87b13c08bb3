"""`omnifabric soak`: the long-run rows of RELIABILITY.md, measured on this machine.

Rows (`--rows`, default all):
- L1: N concurrent real-time audio sessions for S seconds on synthetic workers: lost
  units, fabric overhead per unit, and every service's RSS, open fds and asyncio tasks
  (from its /metrics) before and after.
- L2: one session until the worker's audio limit: it closes with `timeout` exactly once.
- L3: sessions one after another on one reference-engine worker: its RSS returns to the
  baseline taken after the first session.
- F1: SIGKILL the worker serving one of two sessions, repeatedly: the victim's client gets
  session.closed{error} in time, the other session goes on, no lease leaks.
- FUZZ: tests/fuzz with OMNI_FUZZ_EXAMPLES (10k) examples.

Each row starts its own services on free ports of 127.0.0.1 (their logs in --log-dir),
prints progress lines, and the command ends with a table; `--json` writes every figure.
Exit status 1 when a row fails. It runs from a source checkout (it uses tests/).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

from omnifabric.tools.perf.console import run_loop, say
from omnifabric.tools.perf.soak_f1 import row_f1
from omnifabric.tools.perf.soak_row import ROOT, RowResult
from omnifabric.tools.perf.soak_rows import SPEECH_FIXTURE, row_fuzz, row_l1, row_l2, row_l3

ROWS = ("L1", "L2", "L3", "F1", "FUZZ")

RUNNERS: dict[str, Callable[[argparse.Namespace, Path], Awaitable[RowResult]]] = {
    "L1": row_l1,
    "L2": row_l2,
    "L3": row_l3,
    "F1": row_f1,
    "FUZZ": row_fuzz,
}


def build_parser() -> argparse.ArgumentParser:
    """The flags of `omnifabric soak`: rows, and a short form for each row's size."""
    parser = argparse.ArgumentParser(prog="omnifabric soak", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temp folder)")
    parser.add_argument(
        "--progress-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument(
        "--settle", type=float, default=15.0, help="max wait for the fabric to go idle, s"
    )
    l1 = parser.add_argument_group("L1")
    l1.add_argument("--sessions", type=int, default=100, help="concurrent sessions")
    l1.add_argument("--seconds", type=int, default=120, help="units (seconds) per session")
    l1.add_argument("--workers", type=int, default=4)
    l1.add_argument("--slots", type=int, default=25, help="slots per worker")
    l1.add_argument("--compute-ms", type=float, default=40.0, help="synthetic compute per unit")
    l1.add_argument(
        "--warmup-seconds",
        type=int,
        default=30,
        help="a first round of the same sessions, so that the baseline is the processes' "
        "steady state rather than a cold start (0 = none)",
    )
    l1.add_argument("--max-overhead-p99-ms", type=float, default=20.0)
    l1.add_argument("--max-rss-growth", type=float, default=10.0, help="percent per service")
    l2 = parser.add_argument_group("L2")
    l2.add_argument("--l2-seconds", type=float, default=600.0, help="the worker's audio limit")
    l3 = parser.add_argument_group("L3")
    l3.add_argument("--l3-sessions", type=int, default=100)
    l3.add_argument("--l3-units", type=int, default=8, help="units of the speech fixture each")
    l3.add_argument("--max-l3-rss-drift", type=float, default=5.0, help="percent")
    f1 = parser.add_argument_group("F1")
    f1.add_argument("--f1-repeats", type=int, default=50)
    f1.add_argument("--f1-close-limit", type=float, default=2.0, help="seconds")
    f1.add_argument("--f1-pace", type=float, default=0.25, help="seconds between units")
    fuzz = parser.add_argument_group("FUZZ")
    fuzz.add_argument("--fuzz-examples", type=int, default=10_000)
    return parser


async def run(args: argparse.Namespace, rows: list[str], log_dir: Path) -> list[RowResult]:
    """Run the rows in order; a row that raises is a FAIL with the error as its figure."""
    results = []
    for row in rows:
        started = time.monotonic()
        say(row, "start")
        try:
            result = await RUNNERS[row](args, log_dir)
        except Exception as exc:  # noqa: BLE001 - reported as the row's failure
            result = RowResult(row, False, f"error: {type(exc).__name__}: {exc}", "-")
        result.seconds = round(time.monotonic() - started, 1)
        say(row, f"{'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s")
        results.append(result)
    return results


def table(results: list[RowResult]) -> str:
    """The per-row table: row, figure, target, PASS/FAIL."""
    lines = ["row   result  time     figure", "      target"]
    for r in results:
        lines.append(
            f"{r.row:5s} {'PASS' if r.passed else 'FAIL':6s}  {r.seconds:6.0f}s  {r.figure}"
        )
        lines.append(f"      target: {r.target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `omnifabric soak`; 0 when every row passes."""
    args = build_parser().parse_args(argv)
    rows = [r.strip().upper() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in RUNNERS]
    if unknown or not rows:
        print(f"omnifabric soak: unknown rows {unknown}; choose from {ROWS}", file=sys.stderr)
        return 2
    # L3's speech fixture and FUZZ's tests are the checkout's (a subprocess runs pytest).
    if not ((ROOT / "tests" / "fuzz").is_dir() and SPEECH_FIXTURE.exists()):
        print("omnifabric soak: run it from a source checkout (it needs tests/)", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="omnifabric-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"omnifabric soak: rows {','.join(rows)}; service logs in {log_dir}", flush=True)
    results = run_loop(run(args, rows, log_dir))
    print()
    print(table(results))
    passed = all(r.passed for r in results)
    if args.json:
        body = {
            "command": ["omnifabric", "soak", *(sys.argv[1:] if argv is None else argv)],
            "pass": passed,
            "rows": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(body, indent=2, default=str) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
