"""TLS between the services (OMNI_FABRIC_TLS_CA / _CERT / _KEY): the settings, declared once
here (`FabricTls`, which the edge's, worker's and scheduler's configs include), and the
credentials of gRPC servers and channels built from them.

Server: cert + key = TLS only; cert + key + CA = clients must also present a certificate
signed by the CA (mutual TLS). Channel: CA set = TLS with the server's certificate checked
against the CA, cert + key presented when set. Nothing set: plaintext.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from omnifabric.common.config import ConfigError, setting

#: The variables and flags of the certificate and key, which go together.
PAIR_ENV = ("OMNI_FABRIC_TLS_CERT", "OMNI_FABRIC_TLS_KEY")
PAIR_FLAGS = ("--fabric-tls-cert", "--fabric-tls-key")


@dataclass(frozen=True, kw_only=True)
class FabricTls:
    """The fabric's TLS files, the same three settings on every service: a config class
    inherits them (keyword-only, so they sit beside fields without defaults) and calls
    `check_fabric_tls` from its __post_init__."""

    fabric_tls_ca: str | None = setting(
        None,
        env="OMNI_FABRIC_TLS_CA",
        flag="--fabric-tls-ca",
        help="PEM CA the fabric's certificates are checked against: TLS to the scheduler "
        "and workers; a server with a certificate then requires client certificates (mTLS)",
    )
    """PEM CA. Set: channels to the scheduler and workers speak TLS and check the server's
    certificate against it; a server with fabric_tls_cert/_key also requires clients to
    present a certificate it signed. Unset: plaintext channels."""
    fabric_tls_cert: str | None = setting(
        None,
        env="OMNI_FABRIC_TLS_CERT",
        flag="--fabric-tls-cert",
        help="PEM certificate: a scheduler or worker serves TLS only; presented as the "
        "client certificate on TLS channels (with --fabric-tls-key: both or neither)",
    )
    """PEM certificate (chain): the scheduler's and worker's gRPC servers speak TLS only
    with it, and every service presents it on its TLS channels. Needs fabric_tls_key."""
    fabric_tls_key: str | None = setting(
        None,
        env="OMNI_FABRIC_TLS_KEY",
        flag="--fabric-tls-key",
        help="PEM private key of --fabric-tls-cert",
    )
    """PEM private key of fabric_tls_cert."""

    def check_fabric_tls(self) -> None:
        """ConfigError when only one of the certificate and its key is set."""
        if (self.fabric_tls_cert is None) != (self.fabric_tls_key is None):
            raise ConfigError(
                " and ".join(PAIR_ENV), f"({', '.join(PAIR_FLAGS)}) must be set together"
            )


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
