"""The job supervisor's decisions (dlfleet.master.job.policy), over exit
codes and counts alone: a table of the rules, then properties over every
exit: exactly one action, relaunches never below none, a job never failed
for a lost or faulty node while nodes.min nodes remain."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.master.job.platform import (
    EXIT_PREEMPTED,
    REASON_DELETED,
    REASON_EVICTED,
    REASON_OOM,
    NodeState,
)
from dlfleet.master.job.policy import (
    OUT_OF_MEMORY,
    ActiveNode,
    DlworkerFailed,
    ExitAction,
    FailJob,
    Fault,
    Faulty,
    Finished,
    GoOnWithout,
    IgnoreSuspect,
    KeepSuspect,
    LeftAsAsked,
    Lost,
    NodeEnd,
    Relaunch,
    ReplaceFresh,
    Retired,
    RetireSuspect,
    ScaleRefused,
    ScaleTo,
    TrainingFailed,
    decide_end,
    decide_exit,
    decide_suspect,
    is_loss,
    node_state_after,
    plan_scale,
)
from dlfleet.master.job.states import JobResult, JobState

ACTIONS = (
    Finished,
    LeftAsAsked,
    Retired,
    TrainingFailed,
    DlworkerFailed,
    Relaunch,
    ReplaceFresh,
    GoOnWithout,
    FailJob,
)
DELAY = 2.0


def decide(
    code: int,
    reason: str = "",
    *,
    losses: int = 0,
    active: int = 1,
    target: int = 2,
    left: int = 3,
    nodes_min: int = 1,
    asked: bool = False,
    retiring: dict[str, str] | None = None,
) -> ExitAction:
    job = JobState(target, left)
    for name, why in (retiring or {}).items():
        job = job.retire(name, why)
    end = NodeEnd("node-1", code, reason, asked, losses)
    return decide_exit(end, job, active=active, nodes_min=nodes_min, relaunch_delay_s=DELAY)


@pytest.mark.parametrize(
    ("exit", "action"),
    [
        (decide(0), Finished()),
        (decide(1), TrainingFailed("exit code 1")),
        (decide(2), DlworkerFailed("exit code 2")),
        (decide(7), DlworkerFailed("exit code 7")),
        (decide(128), DlworkerFailed("exit code 128")),
        (decide(3), Relaunch(Lost("exit code 3", 1), DELAY, False, 2)),
        (decide(-9), Relaunch(Lost("killed by SIGKILL", 1), DELAY, False, 2)),
        (decide(EXIT_PREEMPTED), Relaunch(Lost("exit code 143, SIGTERM", 1), DELAY, False, 2)),
        (decide(5), Relaunch(Lost(OUT_OF_MEMORY, 1), DELAY, True, 2)),
        (
            decide(137, REASON_OOM),
            Relaunch(Lost("killed: out of memory (OOMKilled)", 1), DELAY, True, 2),
        ),
        (decide(0, REASON_EVICTED), Relaunch(Lost("evicted", 1), DELAY, False, 2)),
        (decide(1, REASON_DELETED), Relaunch(Lost("its pod was deleted", 1), DELAY, False, 2)),
        (decide(4, REASON_EVICTED), Relaunch(Lost("evicted", 1), DELAY, False, 2)),
        (decide(3, losses=1), Relaunch(Lost("exit code 3", 2), DELAY, False, 2)),
        (decide(3, losses=2), ReplaceFresh(Lost("exit code 3", 3), DELAY, 2)),
        (decide(3, losses=2, left=0), GoOnWithout(Lost("exit code 3", 3), 1)),
        (decide(3, active=2), GoOnWithout(Lost("exit code 3", 1), 2)),
        (decide(3, left=0), GoOnWithout(Lost("exit code 3", 1), 1)),
        (decide(3, left=0, nodes_min=2), FailJob(Lost("exit code 3", 1), 1)),
        (decide(3, left=0, active=0), FailJob(Lost("exit code 3", 1), 0)),
        (decide(4), ReplaceFresh(Faulty(Fault.HARDWARE), 0.0, 2)),
        (decide(6), ReplaceFresh(Faulty(Fault.NODE_CHECK), 0.0, 2)),
        (decide(4, left=0), GoOnWithout(Faulty(Fault.HARDWARE), 1)),
        (decide(6, active=2), GoOnWithout(Faulty(Fault.NODE_CHECK), 2)),
        (decide(6, left=0, nodes_min=2), FailJob(Faulty(Fault.NODE_CHECK), 1)),
        (decide(0, asked=True), LeftAsAsked("exit code 0")),
        (decide(-15, asked=True), LeftAsAsked("killed by SIGTERM")),
        (decide(1, asked=True), LeftAsAsked("exit code 1")),
        (
            decide(-15, asked=True, retiring={"node-1": "network suspect: x"}),
            Retired("killed by SIGTERM", "network suspect: x"),
        ),
        (decide(-15, asked=True, retiring={"node-0": "x"}), LeftAsAsked("killed by SIGTERM")),
    ],
)
def test_each_exit_has_its_action(exit: ExitAction, action: ExitAction) -> None:
    assert exit == action


@pytest.mark.parametrize(
    ("action", "state"),
    [
        (Finished(), NodeState.SUCCEEDED),
        (LeftAsAsked("x"), NodeState.STOPPED),
        (Retired("x", "y"), NodeState.FAULTY),
        (TrainingFailed("x"), NodeState.FAILED),
        (DlworkerFailed("x"), NodeState.FAILED),
        (Relaunch(Lost("x", 1), 0.0, False, 0), NodeState.LOST),
        (ReplaceFresh(Lost("x", 3), 0.0, 0), NodeState.FAULTY),
        (ReplaceFresh(Faulty(Fault.HARDWARE), 0.0, 0), NodeState.FAULTY),
        (GoOnWithout(Lost("x", 1), 1), NodeState.LOST),
        (GoOnWithout(Faulty(Fault.NODE_CHECK), 1), NodeState.FAULTY),
        (FailJob(Lost("x", 1), 0), NodeState.LOST),
        (FailJob(Faulty(Fault.HARDWARE), 0), NodeState.FAULTY),
    ],
)
def test_the_ended_node_is_left_in_the_state_its_action_says(
    action: ExitAction, state: NodeState
) -> None:
    assert node_state_after(action) is state


codes = st.one_of(st.integers(-64, 260), st.sampled_from([0, 1, 2, 3, 4, 5, 6, 143]))
reasons = st.sampled_from(["", REASON_OOM, REASON_EVICTED, REASON_DELETED])


@given(
    code=codes,
    reason=reasons,
    asked=st.booleans(),
    losses=st.integers(0, 10),
    active=st.integers(0, 8),
    target=st.integers(1, 8),
    left=st.integers(0, 4),
    nodes_min=st.integers(1, 8),
)
def test_every_exit_yields_one_action_that_keeps_the_counts_sound(
    code: int,
    reason: str,
    asked: bool,
    losses: int,
    active: int,
    target: int,
    left: int,
    nodes_min: int,
) -> None:
    job = JobState(target, left)
    end = NodeEnd("node-1", code, reason, asked, losses)
    action = decide_exit(end, job, active=active, nodes_min=nodes_min, relaunch_delay_s=DELAY)
    assert sum(isinstance(action, kind) for kind in ACTIONS) == 1
    assert action == decide_exit(
        end, job, active=active, nodes_min=nodes_min, relaunch_delay_s=DELAY
    )
    if isinstance(action, Relaunch | ReplaceFresh):
        # A relaunch is spent only while the job wants the node and has one.
        assert action.relaunches_left == left - 1 >= 0 and active < target
        assert job.spent(action.relaunches_left).relaunches_left >= 0
    if isinstance(action, FailJob):
        assert active < nodes_min
    if isinstance(action, GoOnWithout):
        assert active >= nodes_min
    if asked:
        assert isinstance(action, LeftAsAsked)
    elif is_loss(code, reason):  # the node is gone, not its training broken
        assert isinstance(action, Relaunch | ReplaceFresh | GoOnWithout | FailJob)
    node_state_after(action)  # every action leaves the node in a state


@given(running=st.booleans(), left=st.integers(0, 4))
def test_a_suspect_is_retired_only_while_running_and_a_relaunch_is_left(
    running: bool, left: int
) -> None:
    action = decide_suspect("named it in rounds 3, 5", running, JobState(2, left))
    if not running:
        assert action == IgnoreSuspect()
    elif left == 0:
        assert action == KeepSuspect()
    else:
        assert action == RetireSuspect("network suspect: named it in rounds 3, 5", left - 1)


def nodes(*spec: tuple[int, bool]) -> list[ActiveNode]:
    return [ActiveNode(f"node-{index}", index, stopping) for index, stopping in spec]


def test_scaling_up_starts_the_missing_nodes() -> None:
    plan = plan_scale(4, JobState(2, 0), nodes((0, False), (1, False)), 1, 4)
    assert plan == ScaleTo(4, 2, ())


def test_scaling_down_asks_the_newest_nodes_not_already_leaving_to_leave() -> None:
    active = nodes((0, False), (1, False), (2, True), (3, False))
    assert plan_scale(1, JobState(4, 0), active, 1, 4) == ScaleTo(1, 0, ("node-3", "node-1"))


def test_a_target_outside_the_node_range_is_refused() -> None:
    assert plan_scale(5, JobState(2, 0), [], 1, 4) == ScaleRefused(
        "nodes must lie in 1..4 (job.yaml nodes), got 5"
    )


def test_an_ended_job_is_not_scaled() -> None:
    ended = JobState(2, 0).finish(0, "every node's workers finished")
    assert plan_scale(2, ended, [], 1, 4) == ScaleRefused(
        "the job has ended: every node's workers finished"
    )


def test_a_job_ends_once_no_node_is_active() -> None:
    assert decide_end(1, False) is None
    assert decide_end(0, True) == JobResult(0, "every node's workers finished")
    assert decide_end(0, False) == JobResult(1, "no node is left and none finished its work")


def test_the_first_result_stands_and_the_phase_follows_it_at_the_end() -> None:
    job = JobState(2, 1).finish(1, "first").finish(0, "second")
    assert job.result == JobResult(1, "first") and job.reason == ""
    concluded = job.conclude()
    assert concluded.phase.value == "failed" and concluded.reason == "first"


def test_retiring_a_node_is_forgotten_once_it_is_retired() -> None:
    job = JobState(2, 1).retire("node-1", "why").retire("node-2", "other")
    assert dict(job.retired("node-1").retiring) == {"node-2": "other"}
