"""Small facts about this host's sockets and processes that the agent needs:
free ports for a round's store, a worker's stacks, a stopped process.

Lives in the node agent process (`dlworker`) and torchrun's dlfleet handler.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from dlfleet.worker.elastic.channel import STACKS_SIGNAL


def free_port(host: str) -> int:
    """A port free on `host` now, for this node's process-group store should
    it lead the next round; released before the workers start."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int) -> list[int]:
    """`count` different ports free on `host` now (bound together, then
    released)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def dump_stacks(pid: int, wait_s: float = 0.2) -> None:
    """Ask a worker for its threads' stacks (`dlfleet.elastic` writes them to
    its stderr on STACKS_SIGNAL) and give it a moment to write them."""
    try:
        os.kill(pid, STACKS_SIGNAL)
    except OSError:
        return
    time.sleep(wait_s)


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal or a tracer (state T or t)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("T", "t")
