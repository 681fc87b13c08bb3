"""`omnifabric edge`: run one edge process (WebSocket + HTTP + RealtimeService gRPC)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from omnifabric.common import config as settings
from omnifabric.common import listen, logs, process
from omnifabric.edge.access import warn_if_open
from omnifabric.edge.config import EdgeConfig, read_key_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric edge", description=__doc__)
    settings.add_flags(parser, EdgeConfig)
    parser.add_argument(
        "--api-keys-file", help="file of accepted API keys, one per line (env OMNI_API_KEYS_FILE)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure("edge", logging.INFO)  # JSON lines on stderr (OMNI_LOG_FORMAT=text: plain)
    try:
        config = EdgeConfig.from_env(flags=settings.flag_values(args, EdgeConfig))
        if args.api_keys_file:
            keys, limits, admins = read_key_file(args.api_keys_file)
            merged = {**dict(config.api_key_limits), **dict(limits)}
            config = config.with_overrides(
                api_key_digests=config.api_key_digests | keys,
                api_key_limits=tuple(sorted(merged.items())),
                admin_key_digests=config.admin_key_digests | admins,
            )
        config.tls()  # both files or neither, readable, a valid pair: fail before binding
        from omnifabric.edge.fabric import channel_credentials

        channel_credentials(config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key)
    except (ValueError, OSError) as exc:
        print(f"omnifabric edge: {exc}", file=sys.stderr)
        return 2
    if config.process_index == 0:
        # Once per edge: a lone one, or the supervisor of --processes (not each child);
        # `omnifabric serve` shows its edge's.
        warn_if_open(config)
    if config.processes > 1:
        from omnifabric.edge import processes

        return processes.run(config, sys.argv[1:] if argv is None else argv)
    process.run(_run(config, config.drain_grace_s))
    return 0


async def _run(config: EdgeConfig, grace_s: float) -> None:
    import os
    import socket

    from omnifabric.common import telemetry
    from omnifabric.edge.metrics import METRICS
    from omnifabric.edge.server import start_edge

    provider = telemetry.setup("edge", f"{socket.gethostname()}-{os.getpid()}")
    try:
        edge = await start_edge(config)
    except OSError as exc:  # a port in use, or an address that is not this host's
        raise SystemExit(f"omnifabric edge: {exc}") from None
    # Modules and servers live as long as the process: keep them out of full collections,
    # which otherwise walk the whole heap (~0.2 s) while sessions wait for their units.
    gc.collect()
    gc.freeze()
    METRICS.time_gc()
    METRICS.identify(config.process_index)
    stop = process.stop_on_signals()
    print(
        f"omnifabric edge ready: {edge.url} grpc={listen.target(config.host, edge.grpc_port)}",
        flush=True,
    )
    await stop.wait()
    logging.getLogger("omnifabric.edge").info("draining")
    await edge.drain_and_stop(grace_s)
    if provider is not None:
        provider.shutdown()  # flush the last spans


if __name__ == "__main__":
    sys.exit(main())
