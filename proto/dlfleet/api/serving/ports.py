"""Whether a port is free to listen on, asked before a server binds it.

gRPC answers a port in use with a line of its own C++ log and a bare
RuntimeError, aiohttp with an OSError: neither names the setting a user would
change. The master asks here before it binds, and the job supervisor before
it starts the master, so that a taken port is one `PortInUse`; each program
names the setting in its own terms (`--port` for `dlmaster`, `master.port` in
job.yaml for a job).

Used by the master service process and the job supervisor process.
"""

from __future__ import annotations

import enum
import errno
import socket

from dlfleet.api.errors import DlfleetError


class Endpoint(enum.Enum):
    """What listens on a port the master is given."""

    GRPC = "the master"
    HTTP = "the master's HTTP endpoint"


class PortInUse(DlfleetError):
    """Another process listens on the port an endpoint was told to use."""

    def __init__(self, endpoint: Endpoint, host: str, port: int) -> None:
        super().__init__(f"{endpoint.value} cannot listen on {host}:{port}: the port is in use")
        self.endpoint = endpoint
        self.host = host
        self.port = port


def check_port_free(endpoint: Endpoint, host: str, port: int) -> None:
    """Raise `PortInUse` when every address `host` stands for has `port` taken.
    Port 0 (any free port) is always free; an address that fails to bind for
    another reason (not this host's, say) is left to the server to report."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    in_use = False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As the servers bind: a port whose old connections linger in
            # TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                in_use = in_use or exc.errno == errno.EADDRINUSE
                continue
        return  # gRPC listens where it can: one address is enough
    if in_use:
        raise PortInUse(endpoint, host, port)
