"""What only the job's supervisor sees, counted for the master's /metrics.

The brain's plans arrive here (`BrainLink`), the platform reports node exits
here, and the master's own restarts are the supervisor's doing; the
Prometheus endpoint is the master's. The supervisor keeps running totals and
sends them with each status request it makes anyway (every `POLL_S`), and
the master exports the latest it heard. Totals, not increments: a request
lost or sent twice changes nothing, and a restarted master has them again
within one poll.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

from collections import Counter

from dlfleet.api.v1 import job_pb2
from dlfleet.master.job.platform import (
    EXIT_NODE_CHECK_FAILED,
    EXIT_NODE_FAULTY,
    EXIT_NODE_LOST,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    EXIT_WORKERS_FAILED,
    REASON_DELETED,
    REASON_EVICTED,
    REASON_OOM,
)

_PLATFORM_REASONS = {
    REASON_OOM: "oom_killed",
    REASON_EVICTED: "evicted",
    REASON_DELETED: "deleted",
}


def exit_reason(code: int, reason: str, asked_to_leave: bool) -> str:
    """A node's end as a bounded label."""
    if asked_to_leave:
        return "left"
    if reason:
        return _PLATFORM_REASONS.get(reason, "other")
    if code == 0:
        return "succeeded"
    if code == EXIT_WORKERS_FAILED:
        return "workers_failed"
    if code == EXIT_NODE_LOST:
        return "lost"
    if code == EXIT_NODE_FAULTY:
        return "faulty"
    if code == EXIT_NODE_CHECK_FAILED:
        return "node_check_failed"
    if code == EXIT_OUT_OF_MEMORY:
        return "out_of_memory"
    if code == EXIT_PREEMPTED:
        return "preempted"
    if code < 0 or code > 128:
        return "killed"
    return "error"


class SupervisorTally:
    def __init__(self) -> None:
        self.plans: Counter[tuple[str, bool]] = Counter()
        self.node_exits: Counter[str] = Counter()
        self.node_relaunches = 0
        self.master_restarts = 0

    def plan(self, action: str, applied: bool) -> None:
        self.plans[(action, applied)] += 1

    def node_exit(self, reason: str) -> None:
        self.node_exits[reason] += 1

    def to_wire(self) -> job_pb2.SupervisorTotals:
        return job_pb2.SupervisorTotals(
            brain_plans=[
                job_pb2.PlanCount(action=action, applied=applied, count=count)
                for (action, applied), count in sorted(self.plans.items())
            ],
            node_exits=[
                job_pb2.ReasonCount(reason=reason, count=count)
                for reason, count in sorted(self.node_exits.items())
            ],
            node_relaunches=self.node_relaunches,
            master_restarts=self.master_restarts,
        )
