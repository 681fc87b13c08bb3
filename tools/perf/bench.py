"""`omnifabric bench`: fabric overhead per unit against baselines measured in the same run.

For each session count N (`--sessions 1,10,50,100`), N concurrent real-time audio sessions
send one 1 s unit per second for S seconds over seven paths on this machine:

- **fabric**: the public WebSocket protocol through edge, scheduler and worker (a stack
  this command starts: synthetic engine with `--compute-ms`, or `--url` of a running edge);
- **grpc-realtime**: the same sessions in protobuf over the edge's RealtimeService (what
  an internal client that skips JSON gets; with `--url`, at `--grpc`);
- **ws-echo**: a raw websockets server (uvloop, own process) echoing the same JSON frames;
- **grpc-echo**: a raw grpc.aio server (uvloop, own process) echoing the same PCM as one
  message each: the cost of one gRPC exchange and nothing else;
- **grpc-thread**: the same server's answer after `--compute-ms` spent on a thread of a
  pool, as a worker runs its engine: one gRPC exchange and one engine-thread hand-off, the
  floor of the worker's design before any session logic;
- **grpc-sync**: a synchronous gRPC server (own process) that spends the compute on the
  stream's own thread: the floor of a worker without the hand-off;
- **grpc-direct**: a lease from the scheduler, then WorkerService.Session straight to the
  worker with the same PCM (no edge, no JSON; the scheduler is not on the unit path).

Overhead per unit = client send to client receive minus the engine's reported compute
(prefill + generate; on grpc-thread and grpc-sync what the server's thread measured; zero
for the echoes). Reported per path and count: p50/p95/p99/max,
lost units (no result and no counted drop; also sessions without a close), dropped units,
queue waits, CPU and peak RSS of every process, the edge's CPU microseconds per unit, and
the ratios and the milliseconds added to the baselines (fabric, grpc-realtime), and the
split of the fabric's added p50 (gRPC round trip, engine-thread hand-off, the worker's
session logic, edge), and the edge's CPU per unit
beside the two echo servers' (the same I/O without translation). `--find-max` then
searches the largest count whose fabric p99 stays within `--max-p99-ms` with nothing lost.
Output: bench.json, bench.md and bench.png (overhead percentiles against session count) in
`--out`; progress lines while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from omnifabric.tools.perf.baselines import (
    GrpcDirect,
    GrpcEcho,
    echo_server_main,
    grpc_echo_server_main,
    grpc_sync_server_main,
)
from omnifabric.tools.perf.bench_stack import start_stack
from omnifabric.tools.perf.console import run_loop
from omnifabric.tools.perf.fabric import GrpcRealtime
from omnifabric.tools.perf.ledger import PATHS, Level, within
from omnifabric.tools.perf.levels import measure, run_level, say
from omnifabric.tools.perf.report import markdown, plot, summarize


def next_probe(passed: int, failed: int | None, limit: int, resolution: float) -> int | None:
    """The next session count of the max search, None when it is done.

    Grows by half while every probe passes (up to `limit`), then bisects between the
    largest pass and the smallest failure until they are within `resolution` (a fraction
    of the pass, at least 5 sessions)."""
    if failed is None:
        if passed >= limit:
            return None
        return min(limit, max(passed + 5, int(passed * 1.5)))
    gap = max(5, int(passed * resolution))
    if failed - passed <= gap:
        return None
    return (passed + failed) // 2


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every level of every path, the max search, and the summary."""
    out: Path = args.out
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.sessions.split(",") if n.strip()]
    paths = [p for p in args.paths.split(",") if p]
    say(f"starting the stack (logs in {log_dir})")
    stack = await asyncio.to_thread(start_stack, args, paths, log_dir)
    grpc_clients: dict[str, Any] = {}
    if "grpc-direct" in paths:
        grpc_clients["grpc-direct"] = GrpcDirect(stack.scheduler)
    if "grpc-realtime" in paths:
        grpc_clients["grpc-realtime"] = GrpcRealtime(stack.grpc)
    if "grpc-echo" in paths:
        grpc_clients["grpc-echo"] = GrpcEcho(stack.grpc_echo)
    if "grpc-thread" in paths:
        grpc_clients["grpc-thread"] = GrpcEcho(stack.grpc_echo, thread=True)
    if "grpc-sync" in paths:
        grpc_clients["grpc-sync"] = GrpcEcho(stack.grpc_sync, thread=True)
    levels: list[Level] = []
    max_search: list[dict[str, Any]] = []
    try:
        say(
            f"fabric at {stack.url or '-'} (gRPC {stack.grpc or '-'}); "
            f"echo at {stack.echo_url or '-'}; "
            f"scheduler {stack.scheduler or '-'}"
        )
        if args.warmup_seconds > 0:
            warm = argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds})
            warm_n = min(max(counts), 10)
            say(f"warm-up: {warm_n} sessions x {args.warmup_seconds} s per path (not reported)")
            for path in paths:
                await run_level(path, warm_n, warm, stack, grpc_clients)
        for n in counts:
            for path in paths:
                levels.append(await measure(path, n, args, stack, grpc_clients))
        if args.find_max:
            fabric = {lv.sessions: lv for lv in levels if lv.path == "fabric"}
            passed = max((n for n, lv in fabric.items() if within(lv, args.max_p99_ms)), default=0)
            failed = min(
                (n for n, lv in fabric.items() if n > passed and not within(lv, args.max_p99_ms)),
                default=None,
            )
            while (probe := next_probe(passed, failed, args.max_sessions, 0.1)) is not None:
                say(f"max search: {passed} passed, {failed or '-'} failed; trying {probe}")
                level = await measure("fabric", probe, args, stack, grpc_clients)
                ok = within(level, args.max_p99_ms)
                max_search.append(
                    {
                        "sessions": probe,
                        "p99_ms": level.overhead_ms["p99"],
                        "lost": level.lost + level.lost_sessions,
                        "passed": ok,
                    }
                )
                fabric[probe] = level
                if ok:
                    passed = probe
                else:
                    failed = probe
            if passed and passed not in counts:
                say(f"max {passed} sessions: measuring it on every path")
                for path in paths:
                    levels.append(await measure(path, passed, args, stack, grpc_clients))
            max_sessions = passed
        else:
            max_sessions = None
    finally:
        for client in grpc_clients.values():
            await client.close()
        await asyncio.to_thread(stack.stop)
    return summarize(args, levels, max_sessions, max_search)


def default_paths(args: argparse.Namespace) -> str:
    """Every path, but grpc-realtime against a running edge (--url) whose gRPC port was not
    given (--grpc)."""
    skip = ("grpc-realtime",) if args.url and not args.grpc else ()
    return ",".join(p for p in PATHS if p not in skip)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnifabric bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sessions", default="1,10,50,100", help="comma-separated session counts")
    p.add_argument("--seconds", type=int, default=30, help="units (seconds) per session")
    p.add_argument(
        "--paths",
        help=f"paths to measure, of {','.join(PATHS)} (default: every one; with --url and "
        "no --grpc, every one but grpc-realtime)",
    )
    p.add_argument(
        "--ramp-s",
        type=float,
        default=1.0,
        help="open the sessions over this many seconds (1: all within the first second)",
    )
    p.add_argument(
        "--url",
        help="a running edge (ws://HOST:PORT/v1/realtime) instead of "
        "the fabric stack this command starts; baselines still run locally",
    )
    p.add_argument(
        "--grpc",
        metavar="HOST:PORT",
        help="with --url: that edge's gRPC port (RealtimeService), for the grpc-realtime path",
    )
    p.add_argument(
        "--edge-pid", type=int, help="with --url: the edge's pid, to measure its CPU and memory"
    )
    p.add_argument(
        "--edge-processes",
        type=int,
        default=1,
        help="edge processes of the started stack (omnifabric edge --processes N); the edge's "
        "CPU and memory are their sum",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the started services bind")
    p.add_argument("--workers", type=int, default=4, help="synthetic workers")
    p.add_argument("--slots", type=int, default=150, help="slots per worker")
    p.add_argument("--compute-ms", type=float, default=40.0, help="synthetic compute per unit")
    p.add_argument("--warmup-seconds", type=int, default=5, help="0: no warm-up round")
    p.add_argument(
        "--find-max",
        action="store_true",
        help="search the largest count with fabric p99 <= --max-p99-ms, 0 lost",
    )
    p.add_argument("--max-p99-ms", type=float, default=50.0)
    p.add_argument("--max-sessions", type=int, default=600, help="the max search's cap")
    p.add_argument(
        "--max-steal",
        type=float,
        default=0.1,
        help="cores taken by the host (steal) above which a level is measured again",
    )
    p.add_argument("--noisy-retries", type=int, default=2, help="0: keep every first attempt")
    p.add_argument("--target-sessions", type=int, default=100)
    p.add_argument("--target-p99-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, help="output folder (default: a new temp folder)")
    p.add_argument("--progress-every", type=float, default=5.0, help="seconds")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="record the edge with py-spy during each fabric level (flame graph SVGs)",
    )
    p.add_argument(
        "--check", action="store_true", help="exit 1 when the target at --target-sessions is missed"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--echo-server"]:
        return echo_server_main(argv[1] if len(argv) > 1 else "127.0.0.1")
    servers = {
        "--grpc-echo-server": grpc_echo_server_main,
        "--grpc-sync-server": grpc_sync_server_main,
    }
    if argv[:1] and argv[0] in servers:  # FLAG [HOST [COMPUTE_MS]], as bench_stack starts them
        host = argv[1] if len(argv) > 1 else "127.0.0.1"
        compute_ms = float(argv[2]) if len(argv) > 2 else build_parser().get_default("compute_ms")
        return servers[argv[0]](host, compute_ms)
    args = build_parser().parse_args(argv)
    try:
        counts = [int(n) for n in args.sessions.split(",") if n.strip()]
    except ValueError:
        print(
            f"omnifabric bench: --sessions: not a list of integers: {args.sessions!r}",
            file=sys.stderr,
        )
        return 2
    if args.paths is None:
        args.paths = default_paths(args)
    bad = [p for p in args.paths.split(",") if p and p not in PATHS]
    if args.ramp_s < 0 or args.ramp_s >= args.seconds:
        print("omnifabric bench: --ramp-s must be >= 0 and shorter than --seconds", file=sys.stderr)
        return 2
    if args.edge_processes < 1:
        print("omnifabric bench: --edge-processes must be at least 1", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1 or bad or args.seconds < 1:
        print(
            f"omnifabric bench: need --sessions >= 1, --seconds >= 1 and paths among "
            f"{', '.join(PATHS)} (got {bad or args.sessions})",
            file=sys.stderr,
        )
        return 2
    if "grpc-realtime" in args.paths.split(",") and args.url and not args.grpc:
        print(
            "omnifabric bench: grpc-realtime against --url needs the edge's gRPC address "
            "(--grpc HOST:PORT)",
            file=sys.stderr,
        )
        return 2
    if args.grpc and not args.url:
        print("omnifabric bench: --grpc goes with --url (a running edge)", file=sys.stderr)
        return 2
    if "fabric" not in args.paths.split(",") and args.find_max:
        print("omnifabric bench: --find-max measures the fabric path", file=sys.stderr)
        return 2
    if not args.url and args.workers * args.slots < max(
        counts + [args.max_sessions if args.find_max else 0]
    ):
        print(
            f"omnifabric bench: {args.workers} workers x {args.slots} slots cannot hold "
            "every session at once (raise --slots or --workers)",
            file=sys.stderr,
        )
        return 2
    args.out = args.out or Path(tempfile.mkdtemp(prefix="omnifabric-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = run_loop(bench(args))
    except RuntimeError as exc:
        print(f"omnifabric bench: {exc}", file=sys.stderr)
        return 1
    (args.out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    table = markdown(result)
    (args.out / "bench.md").write_text(table)
    plot(result, args.out / "bench.png")
    print(table)
    say(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}")
    at = result["targets"].get("at_target_sessions")
    if args.check and at is not None and not at["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
