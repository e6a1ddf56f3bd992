"""What the job supervisor does about a node that ended, a network suspect,
a new target or a job with no node left: pure decisions over plain values.

The runner (`dlfleet.master.job.runner`) asks, then acts: it relaunches,
adds and stops nodes, logs, tells the brain and counts. Here nothing is
done, so each rule can be read, and tested, over exit codes and counts
alone. Every decision returns exactly one frozen action; a relaunch the
policy grants says how many are left after it, never fewer than none.

The exit rules (the runner's docstring tells them for a user): 0 finished;
1 its training failed (the job fails); 4 (a hardware fault its agent
diagnosed) and 6 (its node check failed) retire the node for a fresh one;
5 (a worker killed for memory) is a loss relaunched with more memory;
a signal, 3 (lost the job) or any platform reason is a loss: relaunched
while the job has relaunches and wants the node, replaced by a fresh node
once lost `FAULTY_AFTER_LOSSES` times; with no relaunch left, the job goes
on while `nodes.min` nodes remain. Anything else (2: dlworker refused its
flags) fails the job.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from dlfleet.master.job.platform import (
    EXIT_NODE_CHECK_FAILED,
    EXIT_NODE_FAULTY,
    EXIT_NODE_LOST,
    EXIT_OUT_OF_MEMORY,
    EXIT_WORKERS_FAILED,
    REASON_OOM,
    NodeState,
    describe_exit,
)
from dlfleet.master.job.states import JobResult, JobState

FAULTY_AFTER_LOSSES = 3  # a node slot lost this many times is replaced, not relaunched
OUT_OF_MEMORY = "a worker was killed for memory (its agent's diagnosis)"


@dataclass(frozen=True)
class NodeEnd:
    """A node's exit, as the platform reported it, with what the runner
    knew of the node."""

    name: str
    code: int  # -N for signal N (a process), 128+N as a container runtime reports it
    reason: str = ""  # the platform's REASON_*, or "" for a plain exit
    asked_to_leave: bool = False  # the runner had stopped it
    losses: int = 0  # how often it was lost before (its relaunches)


class Fault(enum.Enum):
    """Why a node is retired at once, for a fresh one (another host)."""

    HARDWARE = "hardware"  # exit 4: its agent diagnosed a hardware fault
    NODE_CHECK = "node check"  # exit 6: its pre-flight node check failed


@dataclass(frozen=True)
class Lost:
    """The node is gone, not its training broken."""

    how: str  # its exit, in words
    times: int  # lost this many times, this one included


@dataclass(frozen=True)
class Faulty:
    fault: Fault


Loss = Lost | Faulty


@dataclass(frozen=True)
class Finished:
    """Its workers finished."""


@dataclass(frozen=True)
class LeftAsAsked:
    how: str


@dataclass(frozen=True)
class Retired:
    """A network suspect the runner stopped has exited."""

    how: str
    why: str


@dataclass(frozen=True)
class TrainingFailed:
    """Its training failed beyond its restarts: the job fails, for the root
    cause its agent reported."""

    how: str


@dataclass(frozen=True)
class DlworkerFailed:
    """dlworker ended in a way no rule covers (2: it refused its flags)."""

    how: str


@dataclass(frozen=True)
class Relaunch:
    """The same node again, after the delay; with more memory where it ran
    out and the platform sets limits."""

    lost: Lost
    delay_s: float
    grow_memory: bool
    relaunches_left: int


@dataclass(frozen=True)
class ReplaceFresh:
    """Retire the node and start a fresh one (a new name: another host)."""

    loss: Loss
    delay_s: float
    relaunches_left: int


@dataclass(frozen=True)
class GoOnWithout:
    """No relaunch for it, and enough nodes remain."""

    loss: Loss
    active: int


@dataclass(frozen=True)
class FailJob:
    """No relaunch for it, and fewer than nodes.min nodes remain."""

    loss: Loss
    active: int


ExitAction = (
    Finished
    | LeftAsAsked
    | Retired
    | TrainingFailed
    | DlworkerFailed
    | Relaunch
    | ReplaceFresh
    | GoOnWithout
    | FailJob
)


def is_loss(code: int, reason: str) -> bool:
    """Killed, lost the job, preempted (143), evicted, out of memory as the
    platform saw it, or its Pod deleted."""
    return bool(reason) or code < 0 or code > 128 or code == EXIT_NODE_LOST


def failed_node_check(code: int, reason: str) -> bool:
    return code == EXIT_NODE_CHECK_FAILED and not reason


def decide_exit(
    end: NodeEnd, job: JobState, *, active: int, nodes_min: int, relaunch_delay_s: float
) -> ExitAction:
    """What to do about `end`, while `active` other nodes are still active."""
    code, reason = end.code, end.reason
    how = describe_exit(code, reason)
    if end.asked_to_leave:
        why = job.retiring.get(end.name, "")
        return Retired(how, why) if why else LeftAsAsked(how)
    if not reason and code == 0:
        return Finished()
    if not reason and code == EXIT_WORKERS_FAILED:
        return TrainingFailed(how)
    if not reason and code == EXIT_NODE_FAULTY:
        return _without(Faulty(Fault.HARDWARE), job, active, nodes_min, delay_s=0.0)
    if failed_node_check(code, reason):
        return _without(Faulty(Fault.NODE_CHECK), job, active, nodes_min, delay_s=0.0)
    out_of_memory = reason == REASON_OOM
    if not reason and code == EXIT_OUT_OF_MEMORY:
        out_of_memory, how = True, OUT_OF_MEMORY
    if not out_of_memory and not is_loss(code, reason):
        return DlworkerFailed(how)
    lost = Lost(how, end.losses + 1)
    if active < job.target and job.relaunches_left > 0 and lost.times < FAULTY_AFTER_LOSSES:
        left = job.relaunches_left - 1
        return Relaunch(lost, relaunch_delay_s, out_of_memory, left)
    # A slot that keeps dying is retired: a fresh node rather than a retry forever.
    return _without(lost, job, active, nodes_min, delay_s=relaunch_delay_s)


def _without(
    loss: Loss, job: JobState, active: int, nodes_min: int, delay_s: float
) -> ReplaceFresh | GoOnWithout | FailJob:
    """The node is out: a fresh one while the job wants it and has a
    relaunch; else on with the rest while they are enough."""
    if active < job.target and job.relaunches_left > 0:
        return ReplaceFresh(loss, delay_s, job.relaunches_left - 1)
    if active >= nodes_min:
        return GoOnWithout(loss, active)
    return FailJob(loss, active)


def node_state_after(action: ExitAction) -> NodeState:
    """The state the ended node is left in."""
    match action:
        case Finished():
            return NodeState.SUCCEEDED
        case LeftAsAsked():
            return NodeState.STOPPED
        case TrainingFailed() | DlworkerFailed():
            return NodeState.FAILED
        case Relaunch():
            return NodeState.LOST
        case GoOnWithout(loss=Lost()) | FailJob(loss=Lost()):
            return NodeState.LOST
        case Retired() | ReplaceFresh() | GoOnWithout() | FailJob():
            return NodeState.FAULTY


# ------------------------------------------------------------- suspects


@dataclass(frozen=True)
class RetireSuspect:
    """Stop the suspect (marked faulty when it exits) and start a fresh node."""

    why: str
    relaunches_left: int


@dataclass(frozen=True)
class KeepSuspect:
    """No relaunch is left to replace it: a flaky node is better than none."""


@dataclass(frozen=True)
class IgnoreSuspect:
    """It is not running (any more): nothing to retire."""


SuspectAction = RetireSuspect | KeepSuspect | IgnoreSuspect


def decide_suspect(reason: str, running: bool, job: JobState) -> SuspectAction:
    """What to do about a node the others' network failures point at."""
    if not running:
        return IgnoreSuspect()
    if job.relaunches_left <= 0:
        return KeepSuspect()
    return RetireSuspect(f"network suspect: {reason}", job.relaunches_left - 1)


# ---------------------------------------------------------------- scale


@dataclass(frozen=True)
class ActiveNode:
    name: str
    index: int
    stopping: bool


@dataclass(frozen=True)
class ScaleTo:
    """Start `start` new nodes, and ask `leave` (the newest) to leave."""

    target: int
    start: int
    leave: tuple[str, ...]


@dataclass(frozen=True)
class ScaleRefused:
    message: str


def plan_scale(
    nodes: int, job: JobState, active: Sequence[ActiveNode], nodes_min: int, nodes_max: int
) -> ScaleTo | ScaleRefused:
    if not nodes_min <= nodes <= nodes_max:
        return ScaleRefused(
            f"nodes must lie in {nodes_min}..{nodes_max} (job.yaml nodes), got {nodes}"
        )
    if job.result is not None:
        return ScaleRefused(f"the job has ended: {job.result.reason}")
    staying = [node for node in active if not node.stopping]
    newest = sorted(staying, key=lambda node: -node.index)[: max(0, len(staying) - nodes)]
    return ScaleTo(nodes, max(0, nodes - len(active)), tuple(node.name for node in newest))


# ------------------------------------------------------------------ end


def decide_end(active: int, any_succeeded: bool) -> JobResult | None:
    """The job's result once no node is active; None while one is."""
    if active:
        return None
    if any_succeeded:
        return JobResult(0, "every node's workers finished")
    return JobResult(1, "no node is left and none finished its work")
