"""`omnifabric worker` / `python -m omnifabric.worker`: run one worker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from omnifabric.common import logs
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.errors import WorkerError
from omnifabric.worker.metrics import serve_http
from omnifabric.worker.server import start_worker

log = logging.getLogger("omnifabric.worker")


def build_parser() -> argparse.ArgumentParser:
    """The worker's command-line flags; each overrides its OMNI_WORKER_* variable."""
    parser = argparse.ArgumentParser(
        prog="omnifabric worker", description="Run one omnifabric worker (one engine, one GPU)."
    )
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on, 0 = any free (default 22400)")
    parser.add_argument("--advertise", help="host:port edges dial (default host:actual port)")
    parser.add_argument("--scheduler", help="scheduler host:port (default 127.0.0.1:50051)")
    parser.add_argument("--worker-id", help="stable worker id (default hostname-pid)")
    parser.add_argument("--engine", help="synthetic, reference or minicpmo (default synthetic)")
    parser.add_argument("--slots", type=int, help="sessions at once (default: the engine's)")
    parser.add_argument("--audio-limit-s", type=float, help="audio session limit, s (600)")
    parser.add_argument("--video-limit-s", type=float, help="video session limit, s (300)")
    parser.add_argument("--compute-ms", type=float, help="synthetic engine ms per unit (40)")
    parser.add_argument(
        "--model-dir",
        "--model-path",
        dest="model_path",
        help="minicpmo: local MiniCPM-o 4.5 checkpoint directory",
    )
    parser.add_argument(
        "--minicpmo-api",
        choices=["auto", "unified", "as_duplex", "duplex"],
        help="minicpmo: the model code layout to drive (auto: the best offered)",
    )
    parser.add_argument(
        "--text-only", action="store_true", default=None, help="minicpmo: no speech output"
    )
    parser.add_argument(
        "--default-voice", help="minicpmo: WAV voice for sessions without reference audio"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the engine's model directory and environment, print the report, exit",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (minicpmo: cuda by default)")
    parser.add_argument(
        "--llm-model", help="reference: reply model, qwen2.5-coder-1.5b (default) or -0.5b"
    )
    parser.add_argument(
        "--llm-threads", type=int, help="reference: llama.cpp threads (2 on 2+ cores, else 1)"
    )
    parser.add_argument("--attn", choices=["sdpa", "flash_attention_2", "eager"], help="minicpmo")
    parser.add_argument(
        "--compile", action="store_true", default=None, help="minicpmo: torch.compile the LLM"
    )
    parser.add_argument(
        "--fail-unit", type=int, help="fault injection: synthetic engine fails on unit N"
    )
    parser.add_argument(
        "--hang-unit", type=int, help="fault injection: synthetic engine hangs in unit N"
    )
    parser.add_argument(
        "--unit-timeout", type=float, help="engine call of one unit longer than this: stuck, s (5)"
    )
    parser.add_argument(
        "--grace", type=float, help="on SIGTERM: time sessions get to end in-band, s (10)"
    )
    parser.add_argument(
        "--max-message-bytes", type=int, help="largest gRPC message either way (16 MiB)"
    )
    parser.add_argument("--fabric-tls-ca", help="PEM CA: TLS to the scheduler; with a cert: mTLS")
    parser.add_argument("--fabric-tls-cert", help="PEM certificate: the worker serves TLS")
    parser.add_argument("--fabric-tls-key", help="PEM private key of --fabric-tls-cert")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--metrics-port", type=int, help="Prometheus /metrics port, 0 = any free, -1 = off (9160)"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """OMNI_WORKER_* variables with the given flags on top. Raises ConfigError."""
    return WorkerConfig.from_env(
        host=args.host,
        port=args.port,
        advertise_address=args.advertise,
        scheduler_address=args.scheduler,
        worker_id=args.worker_id,
        engine=args.engine,
        slots=args.slots,
        audio_limit_s=args.audio_limit_s,
        video_limit_s=args.video_limit_s,
        synthetic_compute_ms=args.compute_ms,
        synthetic_fail_unit=args.fail_unit,
        synthetic_hang_unit=args.hang_unit,
        unit_timeout_s=args.unit_timeout,
        drain_grace_s=args.grace,
        max_message_bytes=args.max_message_bytes,
        tls_ca=args.fabric_tls_ca,
        tls_cert=args.fabric_tls_cert,
        tls_key=args.fabric_tls_key,
        model_path=args.model_path,
        device=args.device,
        llm_model=args.llm_model,
        llm_threads=args.llm_threads,
        attn=args.attn,
        compile=args.compile,
        minicpmo_api=args.minicpmo_api,
        text_only=args.text_only,
        default_voice=args.default_voice,
        metrics_port=args.metrics_port,
    )


async def serve(config: WorkerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; prints the ready line once serving and registered."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    from omnifabric.common import telemetry

    provider = telemetry.setup("worker", config.worker_id)
    worker = await start_worker(config)
    try:
        metrics_word = ""
        if config.metrics_port >= 0:
            _, metrics_port = serve_http(
                worker.runtime.metrics.registry, config.host, config.metrics_port
            )
            metrics_word = f" metrics={config.host}:{metrics_port}"
        ready = asyncio.ensure_future(worker.wait_ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is None:
            print(
                f"omnifabric worker ready: {worker.worker_id} {worker.address}{metrics_word}",
                flush=True,
            )
            await stopping
        elif ready.done():
            log.error("worker failed to start: %s", ready.exception())
            stopping.cancel()
            return 1
        else:
            ready.cancel()
        log.info("signal received: draining")
    finally:
        await worker.drain_and_stop()
        if provider is not None:
            provider.shutdown()  # flush the last spans
        if worker.runtime.stuck:
            # Interpreter exit joins the engine threads, and a stuck one never returns.
            log.warning(
                "exiting with %d engine calls still stuck: %s",
                len(worker.runtime.stuck),
                "; ".join(worker.runtime.stuck.values()),
            )
            logging.shutdown()
            sys.stdout.flush()
            os._exit(0)
    return 0


def check(config: WorkerConfig) -> int:
    """--check: report what the engine needs and lacks; 0 when it can start."""
    if config.engine == "minicpmo":
        from omnifabric.worker.engines.minicpmo.check import report

        ok, lines = report(config.model_path, config.device or "cuda", config.minicpmo_api)
        print("\n".join(lines))
        print("ready to start" if ok else "cannot start: see MISSING above")
        return 0 if ok else 1
    from omnifabric.worker.engines.registry import load_engine

    try:
        load_engine(config.engine, config)
    except WorkerError as exc:
        print(f"cannot start: {exc}")
        return 1
    print(f"ready to start: engine {config.engine} loaded")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `omnifabric worker`; returns the exit status."""
    args = build_parser().parse_args(argv)
    # JSON lines on stderr (OMNI_LOG_FORMAT=text: plain text).
    logs.configure("worker", getattr(logging, str(args.log_level).upper(), logging.INFO))
    try:
        config = config_from_args(args)
    except WorkerError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 2
    if args.check:
        return check(config)
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        return runner(serve(config))
    except WorkerError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 1
