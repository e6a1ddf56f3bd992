"""A node's state, as the job's status says it (`NodeStatus.state` on the
wire): the job supervisor's platform sets it, the display, the dashboard and
the master's status service read it. A master without a supervisor knows
only the nodes it hears from, and reports them RUNNING."""

from __future__ import annotations

import enum


class NodeState(enum.Enum):
    STARTING = "starting"  # launched (a Pod pending) or waiting out its relaunch delay
    RUNNING = "running"
    STOPPING = "stopping"  # asked to leave (scale down or job end)
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # its training failed beyond its restarts
    LOST = "lost"  # it died or lost the job; may be replaced
    STOPPED = "stopped"  # left when asked
    FAULTY = "faulty"  # lost too often: retired and replaced
