"""`omnifabric edge`: run one edge process (WebSocket + HTTP + RealtimeService gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from edge import logs
from edge.config import EdgeConfig, load_key_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric edge", description=__doc__)
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="WebSocket/HTTP port (default 8006; 0 = any)")
    parser.add_argument(
        "--grpc-port", type=int, help="RealtimeService port (default 8007; 0 = any; -1 = off)"
    )
    parser.add_argument("--scheduler", help="scheduler host:port (default 127.0.0.1:50051)")
    parser.add_argument("--api-keys-file", help="file of accepted API keys, one per line")
    parser.add_argument(
        "--allowed-origin",
        action="append",
        help="browser Origin allowed to connect (repeatable; default: any)",
    )
    parser.add_argument(
        "--max-frame-bytes", type=int, help="largest WebSocket message (default 16 MiB)"
    )
    parser.add_argument(
        "--record-dir", help="record every audio/video session under this folder (user audio!)"
    )
    parser.add_argument("--grace", type=float, default=5.0, help="drain grace period on SIGTERM, s")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(logging.INFO)  # JSON lines on stderr (OMNI_LOG_FORMAT=text: plain)
    try:
        config = EdgeConfig.from_env().with_overrides(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            scheduler=args.scheduler,
            max_frame_bytes=args.max_frame_bytes,
            record_dir=args.record_dir,
            allowed_origins=tuple(args.allowed_origin) if args.allowed_origin else None,
        )
        if args.api_keys_file:
            config = config.with_overrides(
                api_key_digests=config.api_key_digests | load_key_file(args.api_keys_file)
            )
    except (ValueError, OSError) as exc:
        print(f"omnifabric edge: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(_run(config, args.grace))
    except ImportError:
        asyncio.run(_run(config, args.grace))
    return 0


async def _run(config: EdgeConfig, grace_s: float) -> None:
    import os
    import socket

    from edge import telemetry
    from edge.server import start_edge

    provider = telemetry.setup(f"{socket.gethostname()}-{os.getpid()}")
    edge = await start_edge(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"omnifabric edge ready: {edge.url} grpc={config.host}:{edge.grpc_port}", flush=True)
    await stop.wait()
    logging.getLogger("omnifabric.edge").info("draining")
    await edge.drain_and_stop(grace_s)
    if provider is not None:
        provider.shutdown()  # flush the last spans


if __name__ == "__main__":
    sys.exit(main())
