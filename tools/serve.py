"""`omnifabric serve`: the whole stack on one machine as child processes.

Starts the scheduler, N workers and the edge (in that order, each once the previous
reported ready), prints `omnifabric ready: ws://HOST:PORT/v1/realtime`, and on
Ctrl-C/SIGTERM drains them in reverse order: the edge (clients get
session.closed{server_shutdown}), then every worker at once, then the scheduler. Each
child gets `--grace` as its own drain grace and is killed only if it is still running
STOP_MARGIN_S after it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from omnifabric.common.children import Child, spawn, stop
from omnifabric.worker.config import ASR_CHOICES


def metrics_port(base: int, offset: int) -> int:
    """The metrics port of the service at `offset` from `--metrics-base-port`: free ports by
    default (a second stack on the host, or a test run beside one, never collides)."""
    return base if base <= 0 else base + offset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric serve", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds")
    parser.add_argument("--port", type=int, default=8006, help="edge WebSocket port (0 = any)")
    parser.add_argument(
        "--grpc-port", type=int, default=8007, help="edge RealtimeService port (0 = any, -1 = off)"
    )
    parser.add_argument(
        "--scheduler-port", type=int, default=50051, help="scheduler port (0 = any)"
    )
    parser.add_argument(
        "--worker-base-port", type=int, default=22400, help="worker i listens on base+i (0 = any)"
    )
    parser.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        help="scheduler /metrics on this port, worker i on base+1+i "
        "(0 = any free ports, printed on the metrics line; -1 = off)",
    )
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument(
        "--edge-processes",
        type=int,
        default=1,
        help="edge processes on the edge's ports (omnifabric edge --processes)",
    )
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.edge_processes < 1:
        print(
            "omnifabric serve: --workers and --edge-processes must be at least 1",
            file=sys.stderr,
        )
        return 2
    children: list[Child] = []
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        grace = ["--grace", str(args.grace)]
        voice = default_voice(args)
        sched_args = ["--host", args.host, "--port", str(args.scheduler_port), *grace]
        sched_args += ["--metrics-port", str(metrics_port(args.metrics_base_port, 0))]
        scheduler = spawn("scheduler", "omnifabric.scheduler", sched_args)
        children.append(scheduler)
        sched_addr = scheduler.wait_ready(args.ready_timeout).split()[0]
        workers = []
        for i in range(args.workers):
            port = 0 if args.worker_base_port == 0 else args.worker_base_port + i
            wargs = [
                "--host",
                args.host,
                "--port",
                str(port),
                "--scheduler",
                sched_addr,
                "--engine",
                args.engine,
                "--worker-id",
                f"{os.uname().nodename}-w{i}",
                "--metrics-port",
                str(metrics_port(args.metrics_base_port, 1 + i)),
                *grace,
            ]
            if args.slots is not None:
                wargs += ["--slots", str(args.slots)]
            if args.compute_ms is not None:
                wargs += ["--compute-ms", str(args.compute_ms)]
            for flag, value in (
                ("--model-dir", args.model_dir),
                ("--device", args.device),
                ("--minicpmo-api", args.minicpmo_api),
                ("--llm-model", args.llm_model),
                ("--asr", args.asr),
                ("--llm-threads", None if args.llm_threads is None else str(args.llm_threads)),
                ("--default-voice", voice),
                ("--context-window", args.context_window),
                *(
                    (flag, None if value is None else str(value))
                    for flag, value in (
                        ("--window-high-tokens", args.window_high_tokens),
                        ("--window-low-tokens", args.window_low_tokens),
                        ("--window-units", args.window_units),
                        ("--window-previous-tokens", args.window_previous_tokens),
                        ("--audio-limit-s", args.audio_limit_s),
                        ("--video-limit-s", args.video_limit_s),
                    )
                ),
            ):
                if value is not None:
                    wargs += [flag, value]
            if args.text_only:
                wargs.append("--text-only")
            workers.append(spawn(f"worker{i}", "omnifabric.worker", wargs))
        children.extend(workers)
        for w in workers:
            w.wait_ready(args.ready_timeout)
        edge = spawn(
            "edge",
            "omnifabric.edge",
            [
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--grpc-port",
                str(args.grpc_port),
                "--scheduler",
                sched_addr,
                *grace,
                *("--processes", str(args.edge_processes)),
                *(["--record-dir", args.record_dir] if args.record_dir else []),
                *(["--default-ref-audio", voice] if voice else []),
            ],
        )
        children.append(edge)
        url = edge.wait_ready(args.ready_timeout).split()[0]
        print(f"omnifabric ready: {url}", flush=True)
        web = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        print(f"omnifabric web client: {web.removesuffix('/v1/realtime')}/", flush=True)
        print(f"omnifabric metrics: {_metrics_urls(scheduler, workers, url)}", flush=True)
        while not stopping.wait(0.5):
            if scheduler.proc.poll() is not None or edge.proc.poll() is not None:
                dead = scheduler if scheduler.proc.poll() is not None else edge
                print(
                    f"omnifabric serve: {dead.name} exited ({dead.proc.returncode}); stopping",
                    file=sys.stderr,
                )
                code = 1
                break
            for w in workers:
                if w.proc.poll() is not None and not getattr(w, "reported", False):
                    print(
                        f"omnifabric serve: {w.name} exited ({w.proc.returncode}); serving on",
                        file=sys.stderr,
                    )
                    w.reported = True  # type: ignore[attr-defined]
    except RuntimeError as exc:
        print(f"omnifabric serve: {exc}", file=sys.stderr)
        code = 1
    finally:
        # Edge first (clients get session.closed), then the workers together (their
        # sessions are closed already; their leases go back), then the scheduler.
        by_kind = {
            kind: [c for c in children if c.name.rstrip("0123456789") == kind]
            for kind in ("edge", "worker", "scheduler")
        }
        for kind in ("edge", "worker", "scheduler"):
            stop(by_kind[kind], args.grace)
    print("omnifabric stopped", flush=True)
    return code


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


def _metrics_urls(scheduler: Child, workers: list[Child], edge_url: str) -> str:
    """name=URL for every /metrics endpoint (scheduler and workers: their ready lines'
    metrics= word; edge: its WebSocket port)."""
    urls = []
    for child in (scheduler, *workers):
        for word in child.ready_text.split():
            if word.startswith("metrics="):
                urls.append(f"{child.name}=http://{word.removeprefix('metrics=')}/metrics")
    host_port = edge_url.split("://", 1)[-1].split("/", 1)[0]
    urls.append(f"edge=http://{host_port}/metrics")
    return " ".join(urls)
