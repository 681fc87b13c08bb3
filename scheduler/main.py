"""`omnifabric scheduler` / `python -m omnifabric.scheduler`: run the scheduler until SIGTERM
or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging

from omnifabric.common import config as settings
from omnifabric.common import listen, logs, process
from omnifabric.common.metrics import serve_http
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.heap import HeapKeeper
from omnifabric.scheduler.server import start_server

log = logging.getLogger("omnifabric.scheduler")


def build_parser() -> argparse.ArgumentParser:
    """The scheduler's command-line flags (each also settable by its OMNI_SCHEDULER_* variable)."""
    parser = argparse.ArgumentParser(
        prog="omnifabric scheduler",
        description="Worker registry, FIFO queue and leases for omnifabric.",
    )
    settings.add_flags(parser, SchedulerConfig)
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level for stderr (default INFO)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the scheduler; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = settings.load(SchedulerConfig, flags=settings.flag_values(args, SchedulerConfig))
    except ValueError as exc:
        parser.error(str(exc))
    logs.configure("scheduler", args.log_level)  # JSON lines (OMNI_LOG_FORMAT=text: plain)
    process.run(_serve(config))
    return 0


async def _serve(config: SchedulerConfig) -> None:
    import os
    import socket

    from omnifabric.common import telemetry

    provider = telemetry.setup("scheduler", f"{socket.gethostname()}-{os.getpid()}")
    try:
        running = await start_server(config)
    except (OSError, ImportError) as exc:
        raise SystemExit(f"omnifabric scheduler: {exc}") from None
    # Long-lived from here on (modules, server, then held sessions): out of the full
    # collections' walk, which otherwise pauses the loop in proportion to the fleet.
    heap = HeapKeeper()
    heap.settle()
    keeper = asyncio.ensure_future(heap.keep())
    stop = process.stop_on_signals()
    metrics_word = ""
    if config.metrics_port >= 0:
        try:
            _, metrics_port = serve_http(
                running.scheduler.metrics.registry, config.host, config.metrics_port
            )
        except OSError as exc:
            await running.stop(0)
            raise SystemExit(f"omnifabric scheduler: {exc}") from None
        metrics_word = f" metrics={listen.target(config.host, metrics_port)}"
    address = listen.target(config.host, running.port)
    print(f"omnifabric scheduler ready: {address}{metrics_word}", flush=True)
    await stop.wait()
    log.info("draining (grace %.1f s)", config.drain_grace_s)
    await running.drain(config.drain_grace_s)
    keeper.cancel()
    if provider is not None:
        provider.shutdown()  # flush the last spans
