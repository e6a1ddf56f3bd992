"""A private network of test machines in Linux namespaces, with a link
emulator that can cut a host off or slow its link down (what `tc netem loss`
and `tc netem delay` would do, for kernels built without sch_netem).

    lab = NetLab({"m": "10.231.0.1", "a": "10.231.0.2"}).start()
    proc = lab.popen("a", ["/abs/path/to/program", ...])   # runs inside host a
    lab.shared            # a folder every host sees: stands for a network file system
    lab.cut("a")          # every packet from or to a is dropped: no RST, no FIN
    lab.delay("a", 1.2)   # every packet from or to a is held 1.2 s
    lab.heal("a")         # a's link is clean again
    lab.close()           # kills what runs in the hosts, deletes the namespaces

Each host is a namespace of its own (named after this process's pid and a
random tag, so parallel runs never clash) with its loopback up and one TUN
device, `tun0`, holding the host's address in a /24. The "wire" is a
subprocess (this module run as a script) that holds the TUN devices of every
host and forwards each IPv4 packet to the TUN of the host owning its
destination address, dropping or delaying it as told on its stdin. So all
traffic stays inside the namespaces made here; the root namespace carries
none of it, and the TUN devices vanish with the wire.

A TUN device gets whole, checksummed packets (no offloads), so the wire needs
no `ethtool`, no bridge and no qdisc module: only `ip`, /dev/net/tun, and root.

A node is a machine: each host also has a hostname of its own (`host<name>`,
a UTS namespace), an /etc/hosts naming every host (`ip netns exec` lays
/etc/netns/<ns>/hosts over /etc/hosts), and a mount namespace with a /tmp
and a /dev/shm of its own (tmpfs), held by one process per host that every
process of the host enters. Nothing else is shared but `shared`, under
/var/tmp (outside every host's /tmp), and the paths the hosts' programs run
from (this repository and the interpreter stay visible even under a /tmp).
Variants of real machines: `debian_hosts` resolve their own hostname to
127.0.1.1 (Debian's default /etc/hosts); `second_net` gives a host a second
interface, `veth1`, on a network no other host reaches, and resolves its
hostname to that address there.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import os
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

NETNS_DIR = "/var/run/netns"
TUN_NAME = "tun0"
PREFIX_LEN = 24
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65_536
ETC_NETNS = Path("/etc/netns")
# Paths a host's programs need even where they lie under the root /tmp (a
# clone of the repository there, its virtual environment).
KEEP = (Path(__file__).resolve().parents[1], Path(sys.prefix), Path(sys.base_prefix))


def netns_unavailable() -> str | None:
    """Why a NetLab cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    probe = f"dlfprobe{os.getpid()}{secrets.token_hex(2)}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip a test where a NetLab cannot be built, but never in CI: there the
    machine is root with iproute2, and the multi-machine tests must run."""
    reason = netns_unavailable()
    if reason is None:
        return
    from harness import missing  # tests only: the lab itself runs without pytest

    missing(f"the network-namespace lab cannot be built: {reason}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass
class NetLab:
    """Hosts by name -> IPv4 address (all in one /24)."""

    hosts: dict[str, str]
    debian_hosts: frozenset[str] = frozenset()
    second_net: dict[str, str] = field(default_factory=dict)  # host -> its /24 address there
    shm_size: str = "256m"
    tag: str = field(default_factory=lambda: f"dlf{os.getpid()}{secrets.token_hex(2)}")
    namespaces: list[str] = field(default_factory=list)
    wire: subprocess.Popen[str] | None = None
    started: list[subprocess.Popen[str]] = field(default_factory=list)
    holders: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return self.hosts[host]

    def hostname(self, host: str) -> str:
        return f"host{host}"

    @property
    def root(self) -> Path:
        return Path("/var/tmp") / self.tag

    @property
    def shared(self) -> Path:
        """Seen by every host at the same path: a network file system."""
        return self.root / "shared"

    def etc_hosts(self, host: str) -> str:
        """`host`'s /etc/hosts: every host by name, its own as configured."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for other, address in self.hosts.items():
            if other != host:
                lines.append(f"{address}\t{self.hostname(other)}")
            elif host in self.debian_hosts:
                lines.append(f"127.0.1.1\t{self.hostname(host)}")
            elif host in self.second_net:
                lines.append(f"{self.second_net[host]}\t{self.hostname(host)}")
            else:
                lines.append(f"{address}\t{self.hostname(host)}")
        return "\n".join(lines) + "\n"

    # ---------------------------------------------------------------- life

    def start(self, timeout_s: float = 20) -> NetLab:
        """Create the namespaces and the wire; on any failure, undo it all."""
        try:
            self.shared.mkdir(parents=True)
            for host in self.hosts:
                _ip("netns", "add", self.ns(host))
                self.namespaces.append(self.ns(host))
                _ip("-n", self.ns(host), "link", "set", "lo", "up")
                etc = ETC_NETNS / self.ns(host)
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(self.etc_hosts(host))
                (etc / "hostname").write_text(self.hostname(host) + "\n")
            ends = [f"{self.ns(h)}={a}" for h, a in self.hosts.items()]
            self.wire = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "wire", *ends],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self._expect("ready", timeout_s)
            for host, address in self.hosts.items():
                ns = self.ns(host)
                _ip("-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", TUN_NAME)
                _ip("-n", ns, "link", "set", TUN_NAME, "up")
                if host in self.second_net:
                    # A link to nowhere: both ends in the host.
                    _ip("-n", ns, "link", "add", "veth1", "type", "veth", "peer", "name", "veth2")
                    _ip("-n", ns, "addr", "add", f"{self.second_net[host]}/24", "dev", "veth1")
                    _ip("-n", ns, "link", "set", "veth1", "up")
                    _ip("-n", ns, "link", "set", "veth2", "up")
            for host in self.hosts:
                self._start_holder(host, timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _start_holder(self, host: str, timeout_s: float) -> None:
        """The process that holds `host`'s hostname and mounts: its own /tmp
        (with KEEP bound back in where it lies under /tmp) and /dev/shm."""
        staging = self.root / f"tmp-{host}"
        staging.mkdir()
        keep = sorted({str(p) for p in KEEP if p.is_relative_to("/tmp") and p.exists()})
        binds = "".join(
            f'mkdir -p "{staging}/{Path(p).relative_to("/tmp")}"; '
            f'mount --bind "{p}" "{staging}/{Path(p).relative_to("/tmp")}"; '
            for p in keep
        )
        script = (
            "set -e; "
            f"hostname {self.hostname(host)}; "
            f'mount -t tmpfs -o size=2g,mode=1777 tmpfs "{staging}"; '
            f"{binds}"
            f'mount --move "{staging}" /tmp; '
            f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm; "
            "echo ready; exec sleep infinity"
        )
        holder = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.holders[host] = holder
        assert holder.stdout is not None
        line = _readline_within(holder.stdout, timeout_s)
        if line.strip() != "ready":
            raise RuntimeError(f"host {host} did not start: {line}{holder.stdout.read()}")

    def close(self) -> None:
        """Kill every process in the hosts, stop the wire, delete the namespaces.
        Safe to call twice, and after a partial start."""
        self.kill_processes()
        for holder in self.holders.values():
            if holder.poll() is None:
                holder.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                holder.wait(10)
            if holder.stdout is not None:
                holder.stdout.close()
        self.holders.clear()
        if self.wire is not None and self.wire.poll() is None:
            self.wire.kill()
            self.wire.wait(10)
        for stream in (self.wire.stdin, self.wire.stdout) if self.wire else ():
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self.namespaces.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def kill_processes(self, timeout_s: float = 10) -> None:
        """SIGKILL what was started in the hosts and whatever it left behind
        there (workers in sessions of their own): the namespaces are ours."""
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + timeout_s
        self._kill_all(self.namespaces, deadline)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        self.started.clear()

    def _kill_all(self, namespaces: Sequence[str], deadline: float) -> bool:
        """SIGKILL every process in `namespaces` but the hosts' holders, until
        none is left (True) or `deadline` (False)."""
        held = {holder.pid for holder in self.holders.values()}
        while time.monotonic() < deadline:
            pids = [pid for ns in namespaces for pid in self._pids(ns) if pid not in held]
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return False

    @staticmethod
    def _pids(ns: str) -> list[int]:
        done = _ip("netns", "pids", ns, check=False)
        return [int(pid) for pid in done.stdout.split() if pid.isdigit()]

    # ----------------------------------------------------------- processes

    def argv(self, host: str, argv: Sequence[str], cwd: str = "/tmp") -> list[str]:
        """`argv` run in `host`: its network, hostname and mounts, in `cwd`
        (a path of the host's: its own /tmp by default)."""
        holder = self.holders.get(host)
        if holder is None:
            return ["ip", "netns", "exec", self.ns(host), *argv]
        return ["nsenter", "-t", str(holder.pid), "-n", "-m", "-u", f"--wd={cwd}", "--", *argv]

    def kill_host(self, host: str) -> None:
        """SIGKILL every process of `host` (a machine lost), its mounts kept."""
        if not self._kill_all([self.ns(host)], time.monotonic() + 10):
            raise RuntimeError(f"processes of host {host} outlived SIGKILL")

    def popen(
        self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str = "/tmp"
    ) -> subprocess.Popen[str]:
        """Start `argv` (absolute program path) in `host`, stdout and stderr
        together on one pipe. `nsenter` execs it: the pid is the program's."""
        proc = subprocess.Popen(
            self.argv(host, argv, cwd),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.started.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(host, argv),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # ---------------------------------------------------------- impairments

    def cut(self, host: str) -> None:
        """Drop every packet from or to `host`, silently, from now on."""
        self._command(f"cut {self.ns(host)}")

    def delay(self, host: str, seconds: float) -> None:
        """Hold every packet from or to `host` for `seconds` (each way)."""
        self._command(f"delay {self.ns(host)} {seconds}")

    def heal(self, host: str) -> None:
        """Neither drop nor delay packets of `host` any more."""
        self._command(f"heal {self.ns(host)}")

    def _command(self, line: str, timeout_s: float = 10) -> None:
        """Tell the wire; it answers once the change is in effect."""
        assert self.wire is not None and self.wire.stdin is not None, "the lab is not started"
        self.wire.stdin.write(line + "\n")
        self.wire.stdin.flush()
        self._expect(f"ok {line}", timeout_s)

    def _expect(self, wanted: str, timeout_s: float) -> None:
        assert self.wire is not None and self.wire.stdout is not None
        line = _readline_within(self.wire.stdout, timeout_s)
        if line.strip() != wanted:
            raise RuntimeError(f"the wire said {line!r}, not {wanted!r} (exit {self.wire.poll()})")


def user_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell has on a machine (the interpreter's
    folder first on PATH, where dlmaster and dlworker are), plus `extra`:
    nothing a user would not set."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", **extra}


# ------------------------------------------------------- what hosts print


class Output:
    """A process's merged stdout/stderr, line by line, each line stamped with
    the monotonic time it was read (so the test can time log events)."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self._lines.append((time.monotonic(), line.rstrip("\n")))

    def lines(self, since: float = 0.0) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, line) for t, line in self._lines if t >= since]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines())

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines()[-n:])

    def matches(self, pattern: str, since: float = 0.0) -> list[tuple[float, re.Match[str]]]:
        found = []
        for t, line in self.lines(since):
            match = re.search(pattern, line)
            if match:
                found.append((t, match))
        return found

    def wait_for(
        self, pattern: str, *, timeout: float, since: float = 0.0
    ) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.matches(pattern, since)
            if found:
                return found[0]
            if time.monotonic() > deadline or not self._reader.is_alive():
                raise AssertionError(
                    f"{self.name}: no line matching {pattern!r} within {timeout}s "
                    f"(exit {self.proc.poll()}); last lines:\n{self.tail()}"
                )
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still runs after {timeout}s; last lines:\n{self.tail()}"
            ) from None


def _readline_within(stream: IO[str], timeout_s: float) -> str:
    """One line of a pipe that only ever holds answers to single requests
    (so nothing can wait in the text buffer while select sees no data)."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"no answer from the wire within {timeout_s}s")
    return stream.readline()


# ------------------------------------------------------------------ the wire


def _open_tun(ns: str) -> int:
    """A TUN device named TUN_NAME created inside namespace `ns` (a TUN device
    belongs to the namespace the opener was in), and its file descriptor."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        request = struct.pack("16sH22x", TUN_NAME.encode(), IFF_TUN | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, request)
    finally:
        if libc.setns(own, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
        os.close(own)
        os.close(target)
    return fd


def _address_bytes(address: str) -> bytes:
    return bytes(int(part) for part in address.split("."))


class Wire:
    """Forwards IPv4 packets between the hosts' TUN devices, by destination
    address, dropping those of cut hosts and holding those of slow ones.
    Packets from one host to another arrive in the order they were sent,
    whatever the delays; a slow host never holds up the others' packets."""

    def __init__(self, ends: dict[str, str]) -> None:
        self.fd_of = {ns: _open_tun(ns) for ns in ends}
        self.ns_of_fd = {fd: ns for ns, fd in self.fd_of.items()}
        self.ns_of_address = {_address_bytes(a): ns for ns, a in ends.items()}
        self.cut: set[str] = set()
        self.delay: dict[str, float] = dict.fromkeys(ends, 0.0)
        # (due, seq, from, to, packet)
        self.held: list[tuple[float, int, str, str, bytes]] = []
        self.last_due: dict[tuple[str, str], float] = {}  # by (from, to)
        self.seq = 0

    def serve(self) -> None:
        print("ready", flush=True)
        pending = b""
        while True:
            timeout = max(0.0, self.held[0][0] - time.monotonic()) if self.held else None
            ready, _, _ = select.select([0, *self.ns_of_fd], [], [], timeout)
            for fd in ready:
                if fd != 0:
                    self._forward_from(fd)
                    continue
                data = os.read(0, 4096)
                if not data:
                    return  # the lab is gone
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self._obey(line.decode().strip())
            self._release_due()

    def _obey(self, line: str) -> None:
        verb, ns, *rest = line.split()
        if verb == "cut":
            self.cut.add(ns)
        elif verb == "heal":
            self.cut.discard(ns)
            self.delay[ns] = 0.0
        elif verb == "delay":
            self.delay[ns] = float(rest[0])
        else:
            raise ValueError(f"unknown wire command {line!r}")
        print(f"ok {line}", flush=True)

    def _forward_from(self, fd: int) -> None:
        source = self.ns_of_fd[fd]
        while True:
            try:
                packet = os.read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                continue  # IPv4 only (IPv6 router solicitations and such are dropped)
            target = self.ns_of_address.get(packet[16:20])
            if target is None or source in self.cut or target in self.cut:
                continue
            wait = self.delay[source] + self.delay[target]
            last = self.last_due.get((source, target), 0.0)
            if wait <= 0 and last <= time.monotonic():
                self._send(self.fd_of[target], packet)
                continue
            due = max(time.monotonic() + wait, last)
            self.last_due[(source, target)] = due
            self.seq += 1
            heapq.heappush(self.held, (due, self.seq, source, target, packet))

    def _release_due(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, _, source, target, packet = heapq.heappop(self.held)
            if source not in self.cut and target not in self.cut:
                self._send(self.fd_of[target], packet)

    @staticmethod
    def _send(fd: int, packet: bytes) -> None:
        with contextlib.suppress(OSError):  # a full or downed device drops it
            os.write(fd, packet)


def _wire_main(args: list[str]) -> int:
    ends = dict(arg.split("=", 1) for arg in args)
    Wire(ends).serve()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["wire"]:
        sys.exit("usage: netns.py wire NAMESPACE=ADDRESS ...")
    sys.exit(_wire_main(sys.argv[2:]))
