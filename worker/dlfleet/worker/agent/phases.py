"""The agent's phases, one frozen value each (see `dlfleet.worker.agent.loop`
for how they follow each other), and the node's exit codes that the final
ones end with.

Lives in the node agent process (`dlworker`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlfleet.api.diagnosis import Action
from dlfleet.worker.agent.env import RoundAssignment
from dlfleet.worker.agent.workers import WorkerFailure
from dlfleet.worker.nodecheck import EXIT_FAULTY


@dataclass(frozen=True)
class Checking:
    """The pre-flight node check, before the node first joins."""


@dataclass(frozen=True)
class Joining:
    restart_count: int


@dataclass(frozen=True)
class Running:
    assignment: RoundAssignment
    restart_count: int


@dataclass(frozen=True)
class Restarting:
    failure: WorkerFailure
    restart_count: int


@dataclass(frozen=True)
class Rejoining:
    reason: str
    restart_count: int


@dataclass(frozen=True)
class Dropped:
    """The master dropped this node while its agent lives (it took the node
    for dead: a partition, a stall): register a new incarnation, join again."""

    reason: str
    restart_count: int


EXIT_WORKERS_FAILED = 1
EXIT_NODE_LOST = 3
EXIT_NODE_FAULTY = 4  # diagnosed: a hardware fault, replace this node
EXIT_OUT_OF_MEMORY = 5  # diagnosed: relaunch this node with more memory
EXIT_NODE_CHECK_FAILED = EXIT_FAULTY  # 6: its node check found it slow or broken
# The node's exit code for each diagnosis action that ends it.
EXIT_FOR = {
    Action.FAIL_JOB: EXIT_WORKERS_FAILED,
    Action.REPLACE_NODE: EXIT_NODE_FAULTY,
    Action.RELAUNCH_NODE_WITH_MORE_MEMORY: EXIT_OUT_OF_MEMORY,
}
EXIT_PREEMPTED = 128 + 15  # SIGTERM


@dataclass(frozen=True)
class Succeeded:
    """The workers finished: exit 0."""


@dataclass(frozen=True)
class Failed:
    failure: WorkerFailure | None
    reason: str
    exit_code: int = EXIT_WORKERS_FAILED  # EXIT_NODE_LOST without a failure


@dataclass(frozen=True)
class Preempted:
    """SIGTERM from outside: leave, exit 143."""


@dataclass(frozen=True)
class CheckFailed:
    reason: str  # the master's verdict, with the numbers


Phase = (
    Checking | Joining | Running | Restarting | Rejoining | Dropped | Succeeded | Failed
    | Preempted | CheckFailed
)  # fmt: skip
FINAL = (Succeeded, Failed, Preempted, CheckFailed)
