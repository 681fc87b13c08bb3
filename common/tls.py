"""TLS between the services (OMNI_FABRIC_TLS_CA / _CERT / _KEY), for gRPC servers and channels.

Server: cert + key = TLS only; cert + key + CA = clients must also present a certificate
signed by the CA (mutual TLS). Channel: CA set = TLS with the server's certificate checked
against the CA, cert + key presented when set. Nothing set: plaintext.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ServerCredentials | None:
    """Credentials for `add_secure_port`, or None for plaintext (no cert and key).
    Raises OSError naming a file that cannot be read."""
    if cert is None or key is None:
        return None
    root = read(ca, "CA") if ca else None
    return grpc.ssl_server_credentials(
        [(read(key, "key"), read(cert, "certificate"))],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def channel_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """Credentials of a channel to another service, or None for plaintext (no CA).
    Raises OSError naming a file that cannot be read."""
    if ca is None:
        return None
    with_cert = cert is not None and key is not None
    return grpc.ssl_channel_credentials(
        root_certificates=read(ca, "CA"),
        private_key=read(key, "key") if with_cert and key else None,
        certificate_chain=read(cert, "certificate") if with_cert and cert else None,
    )


def read(path: str, what: str) -> bytes:
    """The PEM file's bytes; OSError naming `what` and the path when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read the fabric TLS {what} {path}: {exc.strerror}") from None
