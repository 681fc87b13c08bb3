"""Optional TLS of the scheduler's gRPC server (OMNI_FABRIC_TLS_*).

cert + key: the server speaks TLS only. cert + key + CA: clients (edges, workers) must
also present a certificate signed by that CA (mutual TLS). Nothing set: plaintext.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ServerCredentials | None:
    """Credentials for `add_secure_port`, or None for plaintext.

    Raises OSError naming the file that cannot be read.
    """
    if cert is None or key is None:
        return None
    root = _read(ca, "CA") if ca else None
    return grpc.ssl_server_credentials(
        [(_read(key, "key"), _read(cert, "certificate"))],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read the fabric TLS {what} {path}: {exc.strerror}") from None
