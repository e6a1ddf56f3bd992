"""Network addresses as every dlfleet process writes and reads them: `host:port`
with IPv6 bracketed, the IP in a gRPC peer string, loopback or not."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost`: reachable from this machine only."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def with_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def split_host_port(text: str) -> tuple[str, int]:
    """`"host:port"` or `"[v6addr]:port"` -> (host, port); ValueError otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"{text!r}: write an IPv6 address as [ADDR]:PORT")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not in 1..65535")
    return host, port


def peer_host(peer: str) -> str | None:
    """The IP in a gRPC peer string (`ipv4:10.0.0.2:5000`, `ipv6:[::1]:5000`,
    `ipv6:%5B::1%5D:5000`); None for a Unix socket or anything else."""
    kind, _, rest = peer.partition(":")
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        bracketed = rest.startswith("[")
        host = rest[1:].partition("]")[0] if bracketed else rest.rpartition(":")[0]
        return host.partition("%")[0] or None  # a zone index is the master's own
    return None
