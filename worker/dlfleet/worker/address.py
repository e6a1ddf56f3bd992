"""Which address this node publishes for its process-group store, its
checkpoint keeper and its workers' collectives, and which interface holds it.

A node is a machine: what it publishes must be reachable from the other
machines of the job. torchrun publishes `socket.getfqdn()` and hangs where
the hostname does not resolve across hosts, or resolves to 127.0.1.1 (a
Debian default) or to another interface. dlfleet instead takes, in order:

1. `--local-addr` (or `PET_LOCAL_ADDR`, or `DLFLEET_NODE_HOST`), as given;
2. the source address of this host's route to the master: the address the
   master's own packets come back to, so one the job's network reaches;
3. where the master saw this node's connection come from another address
   (NAT, a proxy), that one, with a line in the log saying so.

`choose_address` is the decision, a pure function of what was observed;
`observe` gathers the observations (interfaces, the route) from the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlfleet.api.addresses import is_loopback, split_host_port
from dlfleet.api.env import LOCAL_ADDR_ENV, NODE_HOST_ENV

# The flag wins, then torchrun's variable, then dlfleet's older one.
LOCAL_ADDR_ENVS = (LOCAL_ADDR_ENV, NODE_HOST_ENV)
# Where unset, the agent sets these for its workers to the interface that
# holds the node's address (gloo, NCCL and TensorPipe each pick their own
# otherwise: gloo the one the hostname resolves to).
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class AddressChoice:
    """What to publish, where to bind, why, and what the log should say."""

    address: str  # published: what the other machines dial
    bind: str  # local: where this node's listeners bind (== address unless NATed)
    interface: str | None  # the interface holding `bind`, None if none does
    reason: str
    warnings: tuple[str, ...] = ()


def interface_of(address: str, interfaces: Sequence[Interface]) -> str | None:
    for interface in interfaces:
        if address in interface.addresses:
            return interface.name
    return None


def given_address(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(address, where it came from) when the user named one."""
    if flag:
        return flag, "--local-addr"
    for name in LOCAL_ADDR_ENVS:
        if environ.get(name):
            return environ[name], f"${name}"
    return None


def choose_address(
    *,
    given: tuple[str, str] | None,
    interfaces: Sequence[Interface],
    route_source: str | None,
    master_saw: str | None = None,
    master: str = "the master",
) -> AddressChoice:
    """The decision; see the module docstring. `master_saw` is the address
    the master saw this node's connection come from (None before it said)."""
    if given is not None:
        address, origin = given
        warnings: list[str] = []
        local = interface_of(address, interfaces)
        if local is None and _is_ip(address):
            warnings.append(
                f"{origin} {address} is not an address of any interface of this host "
                f"({_listing(interfaces)}); listeners bind to every interface"
            )
        if master_saw and master_saw != address and not is_loopback(master_saw):
            warnings.append(f"{master} sees this node's connection come from {master_saw}")
        return AddressChoice(
            address=address,
            bind=address if local is not None else "",
            interface=local,
            reason=origin,
            warnings=tuple(warnings),
        )
    if route_source is None:
        raise LookupError(
            f"this host has no route to {master}; name this node's address with --local-addr"
        )
    local = interface_of(route_source, interfaces)
    if master_saw and master_saw != route_source and not is_loopback(route_source):
        return AddressChoice(
            address=master_saw,
            bind=route_source,
            interface=local,
            reason=f"the address {master} sees this node's connection come from",
            warnings=(
                f"this node reaches {master} from {route_source} ({local or 'no interface'}), "
                f"but {master} sees it come from {master_saw} (NAT or a proxy between them?): "
                f"publishing {master_saw}; its ports must be forwarded to this host, "
                "or set --local-addr",
            ),
        )
    return AddressChoice(
        address=route_source,
        bind=route_source,
        interface=local,
        reason=f"the source address of this host's route to {master}",
    )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _listing(interfaces: Sequence[Interface]) -> str:
    return ", ".join(f"{i.name} {' '.join(i.addresses)}" for i in interfaces) or "none"


# ------------------------------------------------------------- observations


def route_source(host: str, port: int) -> str | None:
    """The local address this host's packets to `host:port` leave from (a UDP
    socket's connect picks the route and sends nothing); None if unroutable."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, target in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as sock:
            sock.connect(target)
            return str(sock.getsockname()[0]).partition("%")[0]
    return None


def interfaces() -> list[Interface]:
    """This host's interfaces with their addresses (IPv4 by ioctl, IPv6 from
    /proc/net/if_inet6): no iproute2 needed, so it works in a slim image."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                found.setdefault(name, [])
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(answer[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as lines:
        for line in lines:
            fields = line.split()
            if len(fields) < 6:
                continue
            packed = bytes.fromhex(fields[0])
            found.setdefault(fields[5], []).append(socket.inet_ntop(socket.AF_INET6, packed))
    return [Interface(name, tuple(addresses)) for name, addresses in found.items()]


def observe_and_choose(
    flag: str | None,
    environ: Mapping[str, str],
    master: str,
    master_saw: str | None = None,
) -> AddressChoice:
    """`choose_address` on this host's interfaces and its route to `master`
    (`host:port`)."""
    host, port = split_host_port(master)
    return choose_address(
        given=given_address(flag, environ),
        interfaces=interfaces(),
        route_source=route_source(host, port),
        master_saw=master_saw,
        master=f"the master at {master}",
    )


def interface_environment(choice: AddressChoice, environ: Mapping[str, str]) -> dict[str, str]:
    """The workers' interface variables that the user left unset."""
    if choice.interface is None:
        return {}
    return {name: choice.interface for name in IFNAME_ENVS if not environ.get(name)}
