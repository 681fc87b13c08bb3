"""`omnifabric serve`: the whole stack on one machine as child processes.

Starts the scheduler, N workers and the edge (in that order, each once the previous
reported ready), prints `omnifabric ready: ws://HOST:PORT/v1/realtime`, and on
Ctrl-C/SIGTERM drains them in reverse order: the edge (clients get
session.closed{server_shutdown}), then every worker at once, then the scheduler. Each
child gets `--grace` as its own drain grace and is killed only if it is still running
STOP_MARGIN_S after it.

`--schedulers 2 --ha redis://HOST:PORT/DB` runs an active/standby pair instead of the one
scheduler: both elect a leader on that Redis (which serve never starts: it checks that it
answers before starting anything), the second listens on --scheduler-port + 1 (0: any
free port), serve waits for one to lead, and the workers and the edge get both addresses.
One of them exiting leaves the stack serving with the other; serve stops when both are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from omnifabric.common import config as settings
from omnifabric.common import listen
from omnifabric.common.children import Child, StopRequest, spawn, stop
from omnifabric.scheduler import election
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.worker.config import ASR_CHOICES, ASR_PRECISIONS

#: How long the election store gets to answer serve's check before anything starts, s.
STORE_CHECK_TIMEOUT_S = 3.0


def metrics_port(base: int, offset: int) -> int:
    """The metrics port of the service at `offset` from `--metrics-base-port`: free ports by
    default (a second stack on the host, or a test run beside one, never collides)."""
    return base if base <= 0 else base + offset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric serve", description=__doc__.splitlines()[0])
    _fabric_flags(parser)
    _engine_flags(parser)
    _run_flags(parser)
    return parser


def _fabric_flags(parser: argparse.ArgumentParser) -> None:
    """Addresses, ports and how many of each service."""
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds")
    parser.add_argument("--port", type=int, default=8006, help="edge WebSocket port (0 = any)")
    parser.add_argument(
        "--grpc-port", type=int, default=8007, help="edge RealtimeService port (0 = any, -1 = off)"
    )
    parser.add_argument(
        "--scheduler-port",
        type=int,
        default=50051,
        help="scheduler port (0 = any); with --schedulers 2 the second's is this + 1",
    )
    parser.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="scheduler processes: 2 runs an active/standby pair (needs --ha)",
    )
    parser.add_argument(
        "--ha",
        metavar="URL",
        help="the schedulers' election store, redis://HOST:PORT/DB or "
        "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE/DB; serve starts no Redis: it must "
        "answer",
    )
    parser.add_argument(
        "--ha-ttl",
        type=float,
        help="leader key time to live, s (the scheduler's default): a failover takes about this",
    )
    parser.add_argument(
        "--worker-base-port", type=int, default=22400, help="worker i listens on base+i (0 = any)"
    )
    parser.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        help="scheduler /metrics on this port, worker i on base+1+i, a second scheduler on "
        "base+1+workers (0 = any free ports, printed on the metrics line; -1 = off)",
    )
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument(
        "--edge-processes",
        type=int,
        default=1,
        help="edge processes on the edge's ports (omnifabric edge --processes)",
    )


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """What the workers run and how their sessions' contexts slide."""
    parser.add_argument(
        "--engine", default="reference", choices=["synthetic", "reference", "minicpmo"]
    )
    parser.add_argument("--slots", type=int, help="sessions per worker (engine default)")
    parser.add_argument("--model-dir", help="minicpmo: the MiniCPM-o 4.5 checkpoint directory")
    parser.add_argument("--device", help="engine device: cpu, cuda or cuda:N (engine default)")
    parser.add_argument(
        "--minicpmo-api",
        choices=["auto", "unified", "as_duplex", "duplex"],
        help="minicpmo: the model code layout to drive (auto)",
    )
    parser.add_argument(
        "--llm-model", help="reference: reply model, qwen2.5-coder-1.5b (default) or -0.5b"
    )
    parser.add_argument(
        "--asr",
        choices=ASR_CHOICES,
        help="reference: recognizers, both (Whisper base and Moonshine base-en) or whisper",
    )
    parser.add_argument(
        "--asr-precision",
        choices=ASR_PRECISIONS,
        help="reference: auto (recognizers in bfloat16 where the CPU computes it natively) or fp32",
    )
    parser.add_argument(
        "--llm-threads",
        type=int,
        help="reference: llama.cpp threads per worker (2 on 2+ cores, else 1)",
    )
    parser.add_argument("--text-only", action="store_true", help="minicpmo: no speech output")
    parser.add_argument(
        "--default-voice", help="WAV voice for sessions without reference audio (minicpmo)"
    )
    parser.add_argument("--compute-ms", type=float, help="synthetic engine: compute time per unit")
    parser.add_argument(
        "--context-window",
        choices=["off", "basic", "context"],
        help="how a full context slides (workers' default: off, sessions close context_full)",
    )
    for flag, what in (
        ("--window-high-tokens", "basic window: slide once the context passes this, tokens"),
        ("--window-low-tokens", "basic window: what a slide keeps, tokens"),
        ("--window-units", "context window: units kept"),
        ("--window-previous-tokens", "context window: earlier replies carried, tokens"),
    ):
        parser.add_argument(flag, type=int, help=what)


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """Session limits, start and stop, recording."""
    parser.add_argument("--audio-limit-s", type=float, help="audio session limit, s (0: none)")
    parser.add_argument("--video-limit-s", type=float, help="video session limit, s (0: none)")
    parser.add_argument(
        "--grace", type=float, default=10.0, help="drain grace per service on stop, s"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="max wait for each service, s"
    )
    parser.add_argument(
        "--record-dir", help="the edge records every audio/video session here (user audio!)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = flag_problem(args)
    if problem is not None:
        print(f"omnifabric serve: {problem}", file=sys.stderr)
        return 2
    if args.ha is not None and (problem := store_problem(args.ha)) is not None:
        print(f"omnifabric serve: {problem}", file=sys.stderr)
        return 1
    children: list[Child] = []
    stopping = StopRequest()
    stopping.install()
    code = 0
    try:
        scheds, workers, edge = _start(args, children)
        code = _watch(stopping, edge, scheds, workers)
    except RuntimeError as exc:
        print(f"omnifabric serve: {exc}", file=sys.stderr)
        code = 1
    finally:
        _stop_in_order(children, args.grace)
    print("omnifabric stopped", flush=True)
    return code


def _start(
    args: argparse.Namespace, children: list[Child]
) -> tuple[list[Child], list[Child], Child]:
    """The schedulers, the workers, then the edge, each once the ones before are ready
    (every child added to `children` as it starts); the ready lines printed."""
    voice = default_voice(args)
    scheds = [
        spawn(name, "omnifabric.scheduler", scheduler_args(args, i))
        for i, name in enumerate(scheduler_names(args.schedulers))
    ]
    children.extend(scheds)
    addresses = [s.wait_ready(args.ready_timeout).split()[0] for s in scheds]
    if args.ha is not None:
        wait_for_leader(addresses, scheds, args.ready_timeout)
    sched_addr = ",".join(addresses)
    workers = [
        spawn(f"worker{i}", "omnifabric.worker", worker_args(args, i, sched_addr, voice))
        for i in range(args.workers)
    ]
    children.extend(workers)
    for w in workers:
        w.wait_ready(args.ready_timeout)
    edge = spawn("edge", "omnifabric.edge", edge_args(args, sched_addr, voice))
    children.append(edge)
    ready = edge.wait_ready(args.ready_timeout)
    url = ready.split()[0]
    print(f"omnifabric ready: {url}", flush=True)
    print(f"omnifabric web client: {web_client_url(url)}", flush=True)
    print(f"omnifabric metrics: {_metrics_urls(scheds, workers, url)}", flush=True)
    grpc = edge_grpc_address(ready)
    if grpc:
        print(f"omnifabric grpc: {grpc}", flush=True)
    return scheds, workers, edge


def worker_args(args: argparse.Namespace, i: int, sched_addr: str, voice: str | None) -> list[str]:
    """Worker i's command line: its port, the schedulers, the engine and what was given
    of the engine's and the sessions' settings."""
    port = 0 if args.worker_base_port == 0 else args.worker_base_port + i
    wargs = [
        *("--host", args.host, "--port", str(port), "--scheduler", sched_addr),
        *("--engine", args.engine, "--worker-id", f"{os.uname().nodename}-w{i}"),
        *("--metrics-port", str(metrics_port(args.metrics_base_port, 1 + i))),
        *("--grace", str(args.grace)),
    ]
    given = {
        "--slots": args.slots,
        "--compute-ms": args.compute_ms,
        "--model-dir": args.model_dir,
        "--device": args.device,
        "--minicpmo-api": args.minicpmo_api,
        "--llm-model": args.llm_model,
        "--asr": args.asr,
        "--asr-precision": args.asr_precision,
        "--llm-threads": args.llm_threads,
        "--default-voice": voice,
        "--context-window": args.context_window,
        "--window-high-tokens": args.window_high_tokens,
        "--window-low-tokens": args.window_low_tokens,
        "--window-units": args.window_units,
        "--window-previous-tokens": args.window_previous_tokens,
        "--audio-limit-s": args.audio_limit_s,
        "--video-limit-s": args.video_limit_s,
    }
    for flag, value in given.items():
        if value is not None:
            wargs += [flag, str(value)]
    if args.text_only:
        wargs.append("--text-only")
    return wargs


def edge_args(args: argparse.Namespace, sched_addr: str, voice: str | None) -> list[str]:
    """The edge's command line."""
    return [
        *("--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port)),
        *("--scheduler", sched_addr, "--grace", str(args.grace)),
        *("--processes", str(args.edge_processes)),
        *(["--record-dir", args.record_dir] if args.record_dir else []),
        *(["--default-ref-audio", voice] if voice else []),
    ]


def _watch(stopping: StopRequest, edge: Child, scheds: list[Child], workers: list[Child]) -> int:
    """Serve until a stop is asked (0) or nothing can be served any more (1: the edge
    gone, or every scheduler); a worker, or one scheduler of a pair, exiting is reported
    and the others serve on."""
    reported: set[str] = set()
    while not stopping.wait(0.5):
        gone = [edge] if edge.proc.poll() is not None else []
        if all(s.proc.poll() is not None for s in scheds):
            gone += [s for s in scheds if s.name not in reported]
        if gone:
            for dead in gone:
                print(
                    f"omnifabric serve: {dead.name} exited ({dead.proc.returncode}); stopping",
                    file=sys.stderr,
                )
            return 1
        for child in (*scheds, *workers):
            if child.proc.poll() is not None and child.name not in reported:
                print(
                    f"omnifabric serve: {child.name} exited ({child.proc.returncode}); serving on",
                    file=sys.stderr,
                )
                reported.add(child.name)
    return 0


def _stop_in_order(children: list[Child], grace: float) -> None:
    """Edge first (clients get session.closed), then the workers together (their sessions
    are closed already; their leases go back), then the scheduler."""
    by_kind = {
        kind: [c for c in children if c.name.rstrip("0123456789") == kind]
        for kind in ("edge", "worker", "scheduler")
    }
    for kind in ("edge", "worker", "scheduler"):
        stop(by_kind[kind], grace)


def default_voice(args: argparse.Namespace) -> str | None:
    """The voice sessions without reference audio get (workers) and that the edge serves at
    /api/default_ref_audio: --default-voice, else the model directory's own, else the
    project's clip; None (with a warning) when none can be had."""
    from omnifabric.worker.engines.minicpmo import voice

    try:
        path, _ = voice.resolve(
            args.default_voice, Path(args.model_dir) if args.model_dir else None
        )
    except RuntimeError as exc:
        print(f"omnifabric serve: no default voice: {exc}", file=sys.stderr)
        return None
    return str(path)


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, before anything starts; None when nothing is."""
    if args.workers < 1 or args.edge_processes < 1:
        return "--workers and --edge-processes must be at least 1"
    if args.schedulers < 1:
        return "--schedulers must be at least 1"
    if args.ha is None:
        if args.schedulers > 1:
            return (
                f"--schedulers {args.schedulers} runs active/standby schedulers: it needs "
                "--ha redis://HOST:PORT/DB, a Redis for their election (serve starts none)"
            )
        if args.ha_ttl is not None:
            return "--ha-ttl needs --ha"
        return None
    try:
        election.parse_store_url(args.ha)
    except election.StoreUrlError as exc:
        return f"--ha {exc}"
    try:
        ttl = settings.settings(SchedulerConfig)["ha_ttl_s"]
        settings.check_value(ttl, args.ha_ttl, "--ha-ttl")
    except settings.ConfigError as exc:
        return str(exc)
    return None


def store_problem(url: str, timeout_s: float = STORE_CHECK_TIMEOUT_S) -> str | None:
    """Why the election store at `url` (a valid address) cannot serve the schedulers, in one
    line; None when it answers. Serve starts no Redis: the operator must."""
    try:
        asyncio.run(election.check_store(election.parse_store_url(url), timeout_s))
    except (OSError, ImportError) as exc:
        detail = " ".join(str(exc).split())
        return f"{detail}; serve starts no Redis: start one there or name another with --ha"
    return None


def scheduler_names(count: int) -> list[str]:
    """The schedulers' child names: `scheduler` alone, `scheduler0`, `scheduler1`, ... in a
    group (the drain order goes by the name without its digits)."""
    return ["scheduler"] if count == 1 else [f"scheduler{i}" for i in range(count)]


def scheduler_args(args: argparse.Namespace, i: int) -> list[str]:
    """Scheduler i's flags: --scheduler-port + i (0: any free), its metrics port after the
    workers' (the first: --metrics-base-port itself), the election store when given."""
    port = args.scheduler_port + i if args.scheduler_port else 0
    metrics = metrics_port(args.metrics_base_port, args.workers + i if i else 0)
    out = ["--host", args.host, "--port", str(port), "--grace", str(args.grace)]
    out += ["--metrics-port", str(metrics)]
    if args.ha is not None:
        out += ["--ha", args.ha]
    if args.ha_ttl is not None:
        out += ["--ha-ttl", str(args.ha_ttl)]
    return out


def wait_for_leader(addresses: list[str], scheds: list[Child], timeout_s: float) -> str:
    """Ask the schedulers which leads (common.schedulers) until one does; its address.
    RuntimeError when none does within `timeout_s` or all of them exited."""
    import grpc

    from omnifabric.common import schedulers
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

    async def poll() -> str:
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        try:
            stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in channels]
            deadline = time.monotonic() + timeout_s
            while True:
                answer, _ = await schedulers.find_leader(stubs)
                if answer is not None:
                    return addresses[answer.index]
                if all(s.proc.poll() is not None for s in scheds):
                    raise RuntimeError("every scheduler exited before one led")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no scheduler leads after {timeout_s:.0f}s")
                await asyncio.sleep(0.1)
        finally:
            for channel in channels:
                await channel.close()

    return asyncio.run(poll())


def web_client_url(edge_url: str) -> str:
    """The pages' address for a browser on this host, from the edge's WebSocket URL. A
    wildcard bind becomes loopback (--host 0.0.0.0: 127.0.0.1, --host ::: [::1],
    ``listen.dial_host``): browsers do not take 0.0.0.0 as a secure context, and the pages
    need one for the microphone and camera."""
    parts = urlsplit(edge_url)
    scheme = "https" if parts.scheme == "wss" else "http"
    host = listen.dial_host(parts.hostname or "")
    return f"{scheme}://{listen.target(host, parts.port or 0)}/"


def edge_grpc_address(ready_text: str) -> str | None:
    """Where a gRPC client on this host dials the edge's RealtimeService, from the edge's
    ready line (its `grpc=HOST:PORT` word; a wildcard bind as loopback); None when the
    edge serves no gRPC (`--grpc-port -1`)."""
    for word in ready_text.split():
        if word.startswith("grpc="):
            host, _, port = word.removeprefix("grpc=").rpartition(":")
            if not port.isdigit():  # -1: no gRPC port
                return None
            return listen.target(listen.dial_host(host.strip("[]")), int(port))
    return None


def _metrics_urls(scheds: list[Child], workers: list[Child], edge_url: str) -> str:
    """name=URL for every /metrics endpoint (schedulers and workers: their ready lines'
    metrics= word; edge: its WebSocket port)."""
    urls = []
    for child in (*scheds, *workers):
        for word in child.ready_text.split():
            if word.startswith("metrics="):
                urls.append(f"{child.name}=http://{word.removeprefix('metrics=')}/metrics")
    host_port = edge_url.split("://", 1)[-1].split("/", 1)[0]
    urls.append(f"edge=http://{host_port}/metrics")
    return " ".join(urls)
