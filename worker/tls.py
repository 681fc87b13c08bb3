"""Optional TLS of the worker's server and of its channel to the scheduler (OMNI_FABRIC_TLS_*).

Server: cert + key = TLS only; cert + key + CA = edges must also present a certificate
signed by the CA (mutual TLS). Client (Register stream): CA set = TLS, the scheduler's
certificate checked against the CA, and cert + key presented when set. Nothing set:
plaintext, as before.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from omnifabric.worker.config import WorkerConfig


def server_credentials(config: WorkerConfig) -> grpc.ServerCredentials | None:
    """Credentials of the WorkerService port, or None for plaintext. Raises OSError."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    root = _read(config.tls_ca, "CA") if config.tls_ca else None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key, "key"), _read(config.tls_cert, "certificate"))],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def channel_credentials(config: WorkerConfig) -> grpc.ChannelCredentials | None:
    """Credentials of the channel to the scheduler, or None for plaintext. Raises OSError."""
    if config.tls_ca is None:
        return None
    with_cert = config.tls_cert is not None and config.tls_key is not None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca, "CA"),
        private_key=_read(config.tls_key, "key") if with_cert else None,  # type: ignore[arg-type]
        certificate_chain=_read(config.tls_cert, "certificate") if with_cert else None,  # type: ignore[arg-type]
    )


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read the fabric TLS {what} {path}: {exc.strerror}") from None
