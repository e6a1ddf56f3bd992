"""A server's TLS pair (certificate chain, private key), read and checked as
PEM before the server starts, so that a wrong path or file is one line naming
it rather than gRPC's own error at bind time. Imports grpc only to build
credentials: a command line (`serving.flags`) is checked before gRPC loads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dlfleet.api.errors import InvalidArgument

if TYPE_CHECKING:
    import grpc

TlsPair = tuple[bytes, bytes]


def load_tls_pair(cert_file: Path, key_file: Path) -> TlsPair:
    """(certificate chain, private key), read and sanity-checked as PEM;
    `InvalidArgument` naming the file otherwise."""
    pair = []
    for what, path, marker in (
        ("certificate", cert_file, b"-----BEGIN CERTIFICATE-----"),
        ("private key", key_file, b"PRIVATE KEY-----"),
    ):
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"TLS {what} {path}: {exc.strerror}") from None
        if marker not in data:
            raise InvalidArgument(f"TLS {what} {path}: not a PEM {what}")
        pair.append(data)
    return pair[0], pair[1]


def server_credentials(pair: TlsPair) -> grpc.ServerCredentials:
    import grpc

    cert, key = pair
    return grpc.ssl_server_credentials([(key, cert)])
