"""Where a job's nodes run: `local` (dlworker processes on this machine) or
`kubernetes` (one Pod per node).

A platform only starts, stops and watches nodes; what an exit means for the
job is the runner's call (`dlfleet.master.job.runner`). It is not
thread-safe: one owner (the runner's event loop) calls it, and `poll()` is
where it learns what happened.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import abc
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

# Re-exported: the platforms, the runner and their tests name it from here.
from dlfleet.api.node_state import NodeState as NodeState


@dataclass
class Node:
    """One node of the job as the platform sees it. `name` (node-<index>) is
    what its agent registers as; a relaunch keeps it (the master tells the
    incarnations apart)."""

    name: str
    index: int
    relaunches: int = 0
    state: NodeState = NodeState.STARTING
    exit_code: int | None = None
    start_at: float = 0.0  # monotonic time at which a pending launch happens
    memory_bytes: int | None = None  # its memory limit, where the platform sets one
    detail: str = ""  # what the platform says about it now (a Pod's pending reason)

    @property
    def pid(self) -> int:
        return 0

    @property
    def active(self) -> bool:
        return self.state in (NodeState.STARTING, NodeState.RUNNING, NodeState.STOPPING)


# Why a node ended, where the platform knows more than the exit code.
REASON_OOM = "OOMKilled"
REASON_EVICTED = "Evicted"
REASON_DELETED = "Deleted"  # its Pod went away without our asking (preemption)

# dlworker's exit codes (dlfleet.worker.agent.phases).
EXIT_WORKERS_FAILED = 1  # its training failed beyond its restarts
EXIT_NODE_LOST = 3  # it lost the job: master unreachable, dropped, rendezvous timed out
EXIT_NODE_FAULTY = 4  # its agent diagnosed a hardware fault: replace the node
EXIT_OUT_OF_MEMORY = 5  # its agent diagnosed a worker killed for memory
EXIT_NODE_CHECK_FAILED = 6  # its pre-flight node check found it slow or broken
EXIT_PREEMPTED = 128 + 15  # SIGTERM from outside


@dataclass(frozen=True)
class NodeExit:
    node: Node
    exit_code: int  # -N for signal N (a process), 128+N as a container runtime reports it
    reason: str = ""  # REASON_*, or "" for a plain exit


def describe_exit(code: int, reason: str = "") -> str:
    if reason == REASON_OOM:
        return "killed: out of memory (OOMKilled)"
    if reason == REASON_EVICTED:
        return "evicted"
    if reason == REASON_DELETED:
        return "its pod was deleted"
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name}" if code < 0 else f"exit code {code}, {name}"
    return f"exit code {code}"


N = TypeVar("N", bound=Node)


class Platform(abc.ABC, Generic[N]):
    """Starts, relaunches, stops and watches the job's nodes."""

    nodes: list[N]
    log_dir: Path

    def start(self, count: int) -> None:
        for _ in range(count):
            self.add_node()

    @abc.abstractmethod
    def add_node(self, delay_s: float = 0.0) -> N:
        """A new node (the next index), launched after `delay_s`."""

    @abc.abstractmethod
    def relaunch(self, node: N, delay_s: float, memory_bytes: int | None = None) -> None:
        """Replace a lost node under the same name after `delay_s`, with a new
        memory limit where given (after it ran out of memory)."""

    @abc.abstractmethod
    def stop_node(self, node: N) -> None:
        """Ask a node to leave: its agent stops its workers and leaves the
        round, and the others re-form without it."""

    @abc.abstractmethod
    def poll(self) -> list[NodeExit]:
        """Launch nodes whose relaunch delay is over; report nodes that ended
        since the last poll."""

    @abc.abstractmethod
    def shutdown(self, grace_s: float) -> None:
        """Stop and remove every node (the job is over)."""

    # Whether the nodes go on when the runner stops (Pods do; local processes
    # die with it). A runner interrupted then leaves them to its successor,
    # which adopts them; and the master keeps their registrations.
    outlives_runner = False

    @abc.abstractmethod
    def log_hint(self, node: N) -> str:
        """Where to read a node's output, for a message."""

    def problem(self) -> str | None:
        """Why the job cannot go on, where the platform knows (fewer than
        the minimum nodes can ever run); None while it can."""
        return None

    @property
    def active(self) -> list[N]:
        return [node for node in self.nodes if node.active]
