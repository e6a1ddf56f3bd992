"""The Pod network of the test kubelet: each Pod a machine of its own on one
private IPv4 subnet of this machine.

    network = PodNetwork().open()      # a bridge holding host_ip, e.g. 10.213.7.1/24
    iface = network.attach()           # a network namespace with eth0 = 10.213.7.2/24
    ...                                # run the Pod in iface.netns_path
    network.detach(iface)
    network.close()

Each Pod's network namespace has its loopback up and one veth, `eth0`, whose
other end is a port of the network's bridge; the bridge holds `host_ip`, the
address Pods reach this machine at (the Node's InternalIP). There is no
default route: a Pod reaches the other Pods of the network and the host
address, nothing else, so all traffic stays on links made here. The subnet is
a /24 of 10.0.0.0/8 that no route of this machine overlaps, picked at random
so that parallel runs do not clash.

Invariants: every name made here carries this process's pid (a network
namespace's name) or is labelled with it (a link's alias), so `open` deletes
what a crashed earlier run left (its pid no longer alive) and never what a
live run owns; `close` deletes every namespace and link of this network.
Needs root and iproute2 (`network_unavailable` says why not).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NETNS_DIR = Path("/run/netns")
NETNS_PREFIX = "kubetest-"
ALIAS_PREFIX = "kubetest:"
POD_INTERFACE = "eth0"
PREFIX_LEN = 24
CLONE_NEWNET = 0x40000000
_CANDIDATE_NETWORKS = ipaddress.ip_network("10.128.0.0/9")
_OWNED_NETNS = re.compile(rf"^{NETNS_PREFIX}(\d+)-")


class NetworkError(RuntimeError):
    """The Pod network could not be set up or changed."""


def network_unavailable() -> str | None:
    """Why Pods cannot get network namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "Pod network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", *args], input=stdin, capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        what = " ".join(args) + (f" <<{stdin.strip()!r}" if stdin else "")
        raise NetworkError(f"ip {what} failed: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class PodInterface:
    """One Pod's network namespace and address."""

    netns: str  # its name under /run/netns
    ip: str
    host_link: str  # the bridge's end of its veth

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns


class PodNetwork:
    """A bridge and the network namespaces of the Pods attached to it."""

    def __init__(self) -> None:
        self._tag = secrets.token_hex(3)[:5]
        self._owner = f"{ALIAS_PREFIX}{os.getpid()}"
        self.bridge = f"ktb{self._tag}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._lock = threading.Lock()
        self._attached: dict[str, PodInterface] = {}  # by netns name
        self._serial = 0
        self._next_host = 2

    @property
    def host_ip(self) -> str:
        """This machine's address on the network (the bridge's)."""
        if self.subnet is None:
            raise NetworkError("the Pod network is not open")
        return str(self.subnet.network_address + 1)

    def open(self) -> PodNetwork:
        """Remove a crashed run's leftovers, then make the bridge."""
        reason = network_unavailable()
        if reason is not None:
            raise NetworkError(reason)
        remove_leftovers()
        self.subnet = _free_subnet()
        _ip("-batch", "-", stdin="\n".join([
            f"link add {self.bridge} type bridge",
            f"link set {self.bridge} alias {self._owner}",
            f"addr add {self.host_ip}/{PREFIX_LEN} dev {self.bridge}",
            f"link set {self.bridge} up",
        ]) + "\n")  # fmt: skip
        return self

    def attach(self) -> PodInterface:
        """A new network namespace on the network, with an address of its own."""
        with self._lock:
            if self.subnet is None:
                raise NetworkError("the Pod network is not open")
            ip = self._free_address()
            self._serial += 1
            iface = PodInterface(
                netns=f"{NETNS_PREFIX}{os.getpid()}-{self._tag}-{self._serial}",
                ip=ip,
                host_link=f"kt{self._tag}v{self._serial}",
            )
            self._attached[iface.netns] = iface
        try:
            _ip("-batch", "-", stdin="\n".join([
                f"netns add {iface.netns}",
                f"link add {iface.host_link} type veth peer name {POD_INTERFACE} "
                f"netns {iface.netns}",
                f"link set {iface.host_link} alias {self._owner} master {self.bridge} up",
            ]) + "\n")  # fmt: skip
            _ip("-n", iface.netns, "-batch", "-", stdin="\n".join([
                f"addr add {ip}/{PREFIX_LEN} dev {POD_INTERFACE}",
                f"link set {POD_INTERFACE} up",
                "link set lo up",
            ]) + "\n")  # fmt: skip
        except NetworkError:
            self.detach(iface)
            raise
        return iface

    def detach(self, iface: PodInterface) -> None:
        """Delete the Pod's veth and namespace; its address is free again."""
        _delete_link(iface.host_link)
        _delete_netns(iface.netns)
        with self._lock:
            self._attached.pop(iface.netns, None)

    def close(self) -> None:
        """Delete every namespace attached and the bridge. Idempotent."""
        with self._lock:
            attached = list(self._attached.values())
        for iface in attached:
            self.detach(iface)
        if self.subnet is not None:
            _delete_link(self.bridge)

    def _free_address(self) -> str:
        """The next address in turn that no attached Pod holds (in turn, so that
        an address freed is taken again as late as possible)."""
        assert self.subnet is not None
        taken = {iface.ip for iface in self._attached.values()}
        hosts = self.subnet.num_addresses - 2
        for _ in range(hosts):
            candidate = str(self.subnet.network_address + self._next_host)
            self._next_host = self._next_host + 1 if self._next_host < hosts else 2
            if candidate not in taken:
                return candidate
        raise NetworkError(f"no address left in {self.subnet}")


def _delete_link(name: str) -> None:
    with contextlib.suppress(NetworkError):
        _ip("link", "del", name)


def _delete_netns(name: str) -> None:
    with contextlib.suppress(NetworkError):
        _ip("netns", "del", name)


def remove_leftovers() -> list[str]:
    """Delete the namespaces and links of Pod networks whose process is gone
    (a run killed before its `close`); returns their names."""
    removed = []
    for name in _netns_names():
        match = _OWNED_NETNS.match(name)
        if match and not _alive(int(match.group(1))):
            _delete_netns(name)
            removed.append(name)
    links = json.loads(_ip("-json", "link", "show") or "[]")
    for link in links:
        alias: str = link.get("ifalias") or ""
        pid = alias.removeprefix(ALIAS_PREFIX)
        if alias.startswith(ALIAS_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            _delete_link(link["ifname"])
            removed.append(link["ifname"])
    return removed


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _free_subnet() -> ipaddress.IPv4Network:
    """A random /24 of 10.128.0.0/9 that no route of this machine overlaps."""
    routes: list[dict[str, Any]] = json.loads(_ip("-json", "-4", "route", "show", "table", "all"))
    used = []
    for route in routes:
        destination = route.get("dst", "default")
        if destination != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(destination, strict=False))
    subnets = _CANDIDATE_NETWORKS.num_addresses // 2 ** (32 - PREFIX_LEN)
    for _ in range(100):
        index = secrets.randbelow(subnets)
        first = _CANDIDATE_NETWORKS.network_address + index * 2 ** (32 - PREFIX_LEN)
        candidate = ipaddress.IPv4Network(f"{first}/{PREFIX_LEN}")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise NetworkError(f"no /{PREFIX_LEN} of {_CANDIDATE_NETWORKS} is free on this machine")


# ----------------------------------------------------- sockets in a namespace


def listen_in(path: Path, host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port inside the network namespace at
    `path`. A socket belongs to the namespace of the thread that made it, and
    namespaces are per thread: a thread of its own enters it, makes the
    socket and ends."""
    made: list[socket.socket] = []
    failed: list[str] = []

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            target = os.open(path, os.O_RDONLY)
        except OSError as exc:
            failed.append(str(exc))
            return
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                failed.append(f"setns: {os.strerror(ctypes.get_errno())}")
                return
        finally:
            os.close(target)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            failed.append(str(exc))
            return
        made.append(sock)

    thread = threading.Thread(target=make, name="kubetest-netns-listen", daemon=True)
    thread.start()
    thread.join()
    if not made:
        raise NetworkError(f"listening on {host}:{port} in {path}: {failed[0]}")
    return made[0]
