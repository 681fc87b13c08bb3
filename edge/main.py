"""`omnifabric edge`: run one edge process (WebSocket + HTTP + RealtimeService gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from omnifabric.common import logs
from omnifabric.edge.config import EdgeConfig, read_key_file


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
    parser.add_argument(
        "--default-ref-audio", help="WAV served at GET /api/default_ref_audio (the default voice)"
    )
    parser.add_argument("--grace", type=float, help="drain grace period on SIGTERM, s (default 5)")
    parser.add_argument(
        "--open-timeout", type=float, help="seconds to finish the opening handshake (default 10)"
    )
    parser.add_argument("--ping-interval", type=float, help="keepalive ping interval, s (20)")
    parser.add_argument("--ping-timeout", type=float, help="keepalive pong timeout, s (20)")
    parser.add_argument(
        "--max-sessions-per-key",
        type=int,
        help="open sessions one API key may hold (default 0 = unlimited)",
    )
    parser.add_argument("--tls-cert", help="PEM certificate: wss:// and TLS on the gRPC port")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--fabric-tls-ca", help="PEM CA of the scheduler's and workers' certificates (TLS)"
    )
    parser.add_argument("--fabric-tls-cert", help="PEM client certificate for the fabric (mTLS)")
    parser.add_argument("--fabric-tls-key", help="PEM private key of --fabric-tls-cert")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure("edge", logging.INFO)  # JSON lines on stderr (OMNI_LOG_FORMAT=text: plain)
    try:
        config = EdgeConfig.from_env().with_overrides(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            scheduler=args.scheduler,
            max_frame_bytes=args.max_frame_bytes,
            record_dir=args.record_dir,
            default_ref_audio=args.default_ref_audio,
            allowed_origins=tuple(args.allowed_origin) if args.allowed_origin else None,
            drain_grace_s=args.grace,
            open_timeout_s=args.open_timeout,
            ping_interval_s=args.ping_interval,
            ping_timeout_s=args.ping_timeout,
            max_sessions_per_key=args.max_sessions_per_key,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            fabric_tls_ca=args.fabric_tls_ca,
            fabric_tls_cert=args.fabric_tls_cert,
            fabric_tls_key=args.fabric_tls_key,
        )
        if args.api_keys_file:
            keys, limits = read_key_file(args.api_keys_file)
            merged = {**dict(config.api_key_limits), **dict(limits)}
            config = config.with_overrides(
                api_key_digests=config.api_key_digests | keys,
                api_key_limits=tuple(sorted(merged.items())),
            )
        _check_flags(args)
        config.tls()  # both files or neither, readable, a valid pair: fail before binding
        from omnifabric.edge.fabric import channel_credentials

        channel_credentials(config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key)
    except (ValueError, OSError) as exc:
        print(f"omnifabric edge: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(_run(config, config.drain_grace_s))
    except ImportError:
        asyncio.run(_run(config, config.drain_grace_s))
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Range checks of the flags that override range-checked variables."""
    for flag, value, lo, hi in (
        ("--grace", args.grace, 0, 3600),
        ("--open-timeout", args.open_timeout, 0.1, 600),
        ("--ping-interval", args.ping_interval, 0.1, 3600),
        ("--ping-timeout", args.ping_timeout, 0.1, 3600),
        ("--max-sessions-per-key", args.max_sessions_per_key, 0, 1_000_000),
    ):
        if value is not None and not lo <= value <= hi:
            raise ValueError(f"{flag} must be in [{lo}, {hi}], got {value}")


async def _run(config: EdgeConfig, grace_s: float) -> None:
    import os
    import socket

    from omnifabric.common import telemetry
    from omnifabric.edge.metrics import METRICS
    from omnifabric.edge.server import start_edge

    provider = telemetry.setup("edge", f"{socket.gethostname()}-{os.getpid()}")
    edge = await start_edge(config)
    # Modules and servers live as long as the process: keep them out of full collections,
    # which otherwise walk the whole heap (~0.2 s) while sessions wait for their units.
    gc.collect()
    gc.freeze()
    METRICS.time_gc()
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
