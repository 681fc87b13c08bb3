"""`omnifabric worker` / `python -m omnifabric.worker`: run one worker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from omnifabric.common import config as settings
from omnifabric.common import listen, logs, process
from omnifabric.common.metrics import serve_http
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.errors import ConfigError, WorkerError
from omnifabric.worker.server import start_worker

log = logging.getLogger("omnifabric.worker")


def build_parser() -> argparse.ArgumentParser:
    """The worker's command-line flags; each overrides its OMNI_WORKER_* variable."""
    parser = argparse.ArgumentParser(
        prog="omnifabric worker", description="Run one omnifabric worker (one engine, one GPU)."
    )
    settings.add_flags(parser, WorkerConfig)
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the engine's model directory and environment, print the report, exit",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """OMNI_WORKER_* variables with the given flags on top. Raises ConfigError."""
    return settings.load(WorkerConfig, flags=settings.flag_values(args, WorkerConfig))


async def serve(config: WorkerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; prints the ready line once serving and registered."""
    stop = process.stop_on_signals()
    from omnifabric.common import telemetry

    provider = telemetry.setup("worker", config.worker_id)
    worker = await start_worker(config)
    try:
        metrics_word = ""
        if config.metrics_port >= 0:
            _, metrics_port = serve_http(
                worker.runtime.metrics.registry, config.host, config.metrics_port
            )
            metrics_word = f" metrics={listen.target(config.host, metrics_port)}"
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
    except ConfigError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 2
    if args.check:
        return check(config)
    try:
        return process.run(serve(config))
    except WorkerError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omnifabric worker: {exc}", file=sys.stderr)
        return 1
