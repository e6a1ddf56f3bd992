"""What the job's supervisor counts for the master's /metrics: node exits as
bounded reasons, and the running totals it sends."""

from __future__ import annotations

import pytest

from dlfleet.master.job.platform import REASON_DELETED, REASON_EVICTED, REASON_OOM
from dlfleet.master.job.tally import SupervisorTally, exit_reason


@pytest.mark.parametrize(
    ("code", "reason", "asked", "label"),
    [
        (0, "", False, "succeeded"),
        (143, "", True, "left"),  # asked to leave: whatever it exited with
        (1, "", False, "workers_failed"),
        (3, "", False, "lost"),
        (143, "", False, "preempted"),
        (-9, "", False, "killed"),
        (137, "", False, "killed"),
        (137, REASON_OOM, False, "oom_killed"),
        (0, REASON_EVICTED, False, "evicted"),
        (0, REASON_DELETED, False, "deleted"),
        (0, "SomethingNew", False, "other"),
        (2, "", False, "error"),
    ],
)
def test_a_node_exit_becomes_a_bounded_reason(
    code: int, reason: str, asked: bool, label: str
) -> None:
    assert exit_reason(code, reason, asked) == label


def test_the_totals_on_the_wire_are_running_totals() -> None:
    tally = SupervisorTally()
    tally.node_exit("killed")
    tally.node_exit("killed")
    tally.node_exit("oom_killed")
    tally.node_relaunches = 2
    tally.master_restarts = 1
    wire = tally.to_wire()
    assert [(e.reason, e.count) for e in wire.node_exits] == [("killed", 2), ("oom_killed", 1)]
    assert (wire.node_relaunches, wire.master_restarts) == (2, 1)
    assert list(wire.brain_plans) == []
