"""Unblocking a process stuck in a collective, from another thread.

An in-process restart must get the training thread out of whatever collective
it waits in (a peer died silently, a node was cut off, the world changed) so
that it can leave the round and join the next one. NCCL has an abort for
that; gloo's `abort()` does not wake a pending receive (measured: a peer's
recv still waited for the whole 30 s timeout). What does wake it is the
connection: gloo fails every pending operation on a pair at once when the
pair's socket is shut down, as it does when a peer process dies.

So `CollectiveAbort` remembers which sockets the process opened while its
process group was set up (the gloo pairs and the store client) and, on
`abort()`, shuts those down (listening sockets excepted: gloo's listener
thread takes a failed accept() for a fatal error). The training thread's
collective then raises at once, and its peers', whose pairs it closed, too.

An abort while the group is still forming (between `before_init()` and
`arm()`: rank 0 waiting in the store for ranks that will never come, say)
shuts the sockets opened since `before_init()` the same way: the store's
pending wait fails at once instead of at the group's timeout.

Invariant: the sockets are only touched between `before_init()` and
`disarm()`, so a file descriptor number reused after the group is destroyed
is never shut.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
from typing import Any

_log = logging.getLogger(__name__)
_FD_DIR = "/proc/self/fd"


def socket_fds() -> set[int]:
    """The file descriptors of this process that are sockets."""
    found: set[int] = set()
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            if stat.S_ISSOCK(os.stat(f"{_FD_DIR}/{name}").st_mode):
                found.add(int(name))
    return found


def _shut(fd: int) -> bool:
    """Shut down a connected socket (both ways); True if it was one."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # not connected (any more)
    finally:
        sock.close()


def _is_tcp(fd: int) -> bool:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        sock.close()


class CollectiveAbort:
    """Set up around one process group's life; `abort()` from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._baseline: set[int] = set()
        self._fds: set[int] = set()
        self._group: Any = None
        self._forming = False
        self.aborted = threading.Event()

    def before_init(self) -> None:
        """Call right before the process group (and its store) are created."""
        with self._lock:
            self._baseline = socket_fds()
            self._fds = set()
            self._group = None
            self._forming = True
            self.aborted.clear()

    def arm(self, group: Any) -> None:
        """Call once the group is up: its sockets are the new ones."""
        with self._lock:
            self._fds = socket_fds() - self._baseline
            self._group = group
            self._forming = False

    def adopt(self, group: Any) -> None:
        """Arm for a group that was up before `before_init()` (made from the
        launch environment before `run`: Accelerate does so when HF's
        TrainingArguments are made): its sockets are not told from the
        others by time, so every TCP connection of the process counts as the
        group's (gloo pairs and the store are TCP; the agent's line is a
        Unix socket). Another TCP client of the process that the abort
        shuts (a gRPC channel) connects again."""
        with self._lock:
            self._fds = {fd for fd in socket_fds() if _is_tcp(fd)}
            self._group = group
            self._forming = False

    def disarm(self) -> None:
        with self._lock:
            self._fds = set()
            self._group = None
            self._forming = False

    def abort(self) -> None:
        """Make the group's pending and future collectives fail now."""
        with self._lock:
            self.aborted.set()
            group, fds = self._group, set(self._fds)
            if self._forming:  # the store and pairs made so far
                fds = socket_fds() - self._baseline
            if group is None and not fds:
                return
            self._abort_nccl(group)
            shut = sum(_shut(fd) for fd in sorted(fds))
        _log.info("aborted the process group (%d connections shut down)", shut)

    @staticmethod
    def _abort_nccl(group: Any) -> None:
        if group is None:
            return
        try:
            import torch.distributed as dist

            if dist.get_backend(group) == "nccl":
                dist.distributed_c10d._abort_process_group(group)
        except (RuntimeError, ValueError, AttributeError) as exc:
            _log.warning("NCCL abort failed: %s", exc)
