"""GoodputLedger: the job's wall time tiled into productive steps and lost
time by cause, from what the master hears. Checked on the scenarios a fault
makes (a crash, a hang, a lost node, waiting for nodes, a roll-back) and, with
hypothesis, on any sequence of events: the window is always productive plus
every cause, the ratio stays in [0, 1], and no cause's total ever shrinks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from dlfleet.master.core.goodput import Cause, GoodputLedger

STEP_MS = 100.0


def train(
    ledger: GoodputLedger, node: str, steps: int, start_ms: int, beats: int, age_ms: float = 0.0
) -> int:
    """`beats` heartbeats of `node`, a second apart, 10 steps each, from
    `steps` made at `start_ms`, their counts written `age_ms` before each
    (0: not said); returns the steps made."""
    for beat in range(1, beats + 1):
        steps += 10
        ledger.stepped(node, steps, STEP_MS, start_ms + 1000 * beat, None, age_ms)
    return steps


def test_steady_training_is_all_productive_from_the_first_step() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    train(ledger, "a", 0, 0, 10)
    report = ledger.report()
    assert report.opened_ms == 0
    assert report.productive_ms == pytest.approx(10_000)
    assert report.ratio == pytest.approx(1.0)
    assert report.phase is None


def test_nothing_is_accounted_before_the_first_step() -> None:
    ledger = GoodputLedger()
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 500)
    ledger.waiting_for_nodes(True, 600)
    ledger.stepped("a", 0, 0.0, 1000)
    report = ledger.report()
    assert report.opened_ms is None and report.window_ms == 0 and report.ratio == 0.0


def test_a_crash_loses_the_time_from_the_last_step_to_the_first_step_after_it() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5)  # trains 0..5 s
    # The worker dies at 5.3 s after 3 more steps; the agent reports at 5.4 s.
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5400)
    ledger.stepped("a", steps + 3, STEP_MS, 6000)
    ledger.stepped("a", steps + 3, STEP_MS, 7000)
    # Training resumes at 7.5 s: 5 steps by 8 s.
    ledger.stepped("a", steps + 8, STEP_MS, 8000)
    train(ledger, "a", steps + 8, 8000, 2)
    report = ledger.report()
    assert report.productive_ms == pytest.approx(5300 + 500 + 2000)
    assert report.lost_ms[Cause.RESTART] == pytest.approx(2200)
    assert report.window_ms == pytest.approx(10_000)
    assert report.phase is None


def test_a_hang_is_lost_to_its_detection_then_to_the_restart() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 3)
    for at in (4000, 5000, 6000):
        ledger.stepped("a", steps, STEP_MS, at)
    ledger.interrupted(Cause.HANG_DETECTION, Cause.RESTART, 6500)
    ledger.stepped("a", steps + 5, STEP_MS, 8000)  # resumed at 7.5 s
    train(ledger, "a", steps + 5, 8000, 1)
    report = ledger.report()
    assert report.lost_ms[Cause.HANG_DETECTION] == pytest.approx(3500)
    assert report.lost_ms[Cause.RESTART] == pytest.approx(1000)
    assert report.productive_ms == pytest.approx(3000 + 500 + 1000)


def test_two_nodes_stepping_together_are_counted_once() -> None:
    ledger = GoodputLedger()
    for node in ("a", "b"):
        ledger.stepped(node, 0, 0.0, 0)
    steps = 0
    for beat in range(1, 11):
        steps += 10
        ledger.stepped("a", steps, STEP_MS, 1000 * beat)
        ledger.stepped("b", steps, STEP_MS, 1000 * beat + 500)
    report = ledger.report()
    assert report.productive_ms == pytest.approx(10_000)
    assert report.ratio == pytest.approx(1.0)


def test_a_lost_reference_hands_over_to_the_next_node_that_steps() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    ledger.stepped("b", 0, 0.0, 0)
    train(ledger, "a", 0, 0, 4)
    ledger.stepped("b", 40, STEP_MS, 4000)
    ledger.interrupted(Cause.NODE_REPLACEMENT, Cause.NODE_REPLACEMENT, 4200)
    ledger.node_gone("a")
    ledger.round_formed(frozenset({"b"}))
    ledger.stepped("b", 42, STEP_MS, 5000)  # two steps before the loss
    ledger.stepped("b", 47, STEP_MS, 6000)  # resumed at 5.5 s
    train(ledger, "b", 47, 6000, 2)
    report = ledger.report()
    assert report.productive_ms == pytest.approx(4200 + 500 + 2000)
    assert report.lost_ms[Cause.NODE_REPLACEMENT] == pytest.approx(1300)
    assert report.window_ms == pytest.approx(8000)


def test_waiting_for_nodes_is_its_own_cause_then_the_one_before_it_resumes() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 2)
    ledger.interrupted(Cause.NODE_REPLACEMENT, Cause.NODE_REPLACEMENT, 2000)
    ledger.waiting_for_nodes(True, 3000)
    ledger.waiting_for_nodes(False, 6000)
    ledger.stepped("a", steps, STEP_MS, 6500)
    ledger.stepped("a", steps + 5, STEP_MS, 7500)  # resumed at 7 s
    report = ledger.report()
    assert report.lost_ms[Cause.WAITING_FOR_NODES] == pytest.approx(3000)
    assert report.lost_ms[Cause.NODE_REPLACEMENT] == pytest.approx(2000)
    assert report.productive_ms == pytest.approx(2500)


def test_rolled_back_steps_and_checkpoint_blocking_move_out_of_productive() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    ledger.checkpoint_blocked("a", 0.0, 0)
    train(ledger, "a", 0, 0, 5)
    ledger.rolled_back(3, 5000)
    ledger.checkpoint_blocked("a", 0.25, 5000)
    report = ledger.report()
    assert report.lost_ms[Cause.ROLLED_BACK] == pytest.approx(300)
    assert report.lost_ms[Cause.CHECKPOINT] == pytest.approx(250)
    assert report.productive_ms == pytest.approx(5000 - 550)
    assert report.window_ms == pytest.approx(5000)


def test_steps_counted_a_heartbeat_late_are_still_productive() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 1)
    for beat in range(2, 10):
        # The progress file's writes and the heartbeats drift: 0, then 20 steps.
        steps += 20 if beat % 2 else 0
        ledger.stepped("a", steps, STEP_MS, 1000 * beat)
    report = ledger.report()
    assert report.lost_ms[Cause.OTHER] == 0
    assert report.productive_ms == pytest.approx(9000)
    assert report.ratio == 1.0


def test_steps_written_every_few_steps_are_all_productive_over_time() -> None:
    """A rank writes its progress file every 5 steps of 117 ms, and the
    heartbeats read it every second: each beat sees 5 or 10 steps, lagging
    the truth by up to 5; the ledger must not call the lag slack."""
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    for beat in range(1, 101):
        steps = int(beat * 1000 // 117)
        ledger.stepped("a", steps - steps % 5, 117.0, beat * 1000)
    report = ledger.report()
    assert report.ratio > 0.995
    assert report.lost_ms[Cause.OTHER] < 0.005 * report.window_ms


def test_slack_between_steps_is_other_once_the_job_steps_on() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = 0
    for beat in range(1, 6):
        steps += 9  # 900 ms of steps a second
        ledger.stepped("a", steps, STEP_MS, 1000 * beat)
    report = ledger.report()
    assert report.productive_ms == pytest.approx(900 + 4 * 900)
    # Slack once two more counts of steps went by without taking it back (a
    # write may lag a heartbeat); the last two beats' waits are still idle,
    # outside the window until explained.
    assert report.lost_ms[Cause.OTHER] == pytest.approx(200)
    assert report.as_of_ms == 4800


# ------------------------------------------------------------ properties

NODES = ("a", "b", "c")
CAUSES = tuple(c for c in Cause if c not in (Cause.CHECKPOINT, Cause.ROLLED_BACK, Cause.OTHER))


@dataclass(frozen=True)
class Op:
    kind: str
    node: str
    value: int
    cause: Cause
    then: Cause
    after_ms: int


ops = st.builds(
    Op,
    kind=st.sampled_from(
        [
            *("step", "step", "step", "interrupt", "wait", "gone", "formed"),
            *("rolled", "restored", "blocked", "stopped"),
        ]
    ),
    node=st.sampled_from(NODES),
    value=st.integers(0, 30),
    cause=st.sampled_from(CAUSES),
    then=st.sampled_from(CAUSES),
    after_ms=st.integers(0, 3000),
)


def play(ledger: GoodputLedger, op: Op, now_ms: int, steps: dict[str, int]) -> None:
    if op.kind == "step":
        # Mostly forward; now and then a new process (counts start over).
        steps[op.node] = op.value if op.value < 3 else steps.get(op.node, 0) + op.value
        trained = steps[op.node] + op.value if op.value % 2 else None
        age = float(op.after_ms % 700)
        run = float(op.after_ms % 1900) if op.value % 3 else 0.0
        ended = run + float(op.after_ms % 1300) if op.value % 5 == 1 else 0.0
        ledger.stepped(
            op.node, steps[op.node], float(op.value * 10), now_ms, trained, age, run, ended
        )
    elif op.kind == "interrupt":
        ledger.interrupted(op.cause, op.then, now_ms)
    elif op.kind == "wait":
        ledger.waiting_for_nodes(op.value % 2 == 0, now_ms)
    elif op.kind == "gone":
        ledger.node_gone(op.node)
    elif op.kind == "formed":
        ledger.round_formed(frozenset(NODES[: op.value % 3 + 1]))
    elif op.kind == "rolled":
        ledger.rolled_back(op.value, now_ms)
    elif op.kind == "restored":
        ledger.restored(op.value - 1, op.value + 2, now_ms)
    elif op.kind == "stopped":
        steps[op.node] = steps.get(op.node, 0) + op.value
        trained = steps[op.node] if op.value % 2 else None
        ledger.stopped(op.node, steps[op.node], now_ms, trained, float(op.after_ms % 500))
    else:
        ledger.checkpoint_blocked(op.node, op.value / 10, now_ms)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=60))
def test_the_window_is_productive_plus_every_cause_and_causes_never_shrink(
    sequence: list[Op],
) -> None:
    ledger = GoodputLedger()
    now, steps = 0, dict[str, int]()
    before = ledger.report()
    for op in sequence:
        now += op.after_ms
        play(ledger, op, now, steps)
        report = ledger.report()
        assert 0.0 <= report.ratio <= 1.0
        assert report.productive_ms >= -1e-6
        for cause in Cause:
            assert report.lost_ms[cause] >= before.lost_ms[cause] - 1e-6, cause
        if ledger.opened_ms is not None:
            # Accounted, idle and not yet settled: the whole of the time.
            unsettled = sum(charge.ms for charge in ledger.charges if charge.cause is not None)
            assert report.window_ms + ledger.idle_ms + unsettled == pytest.approx(
                ledger.until_ms - ledger.opened_ms, abs=1e-6
            )
            assert ledger.idle_ms >= -1e-6
            assert ledger.until_ms <= now
            assert report.opened_ms is not None
            assert report.opened_ms <= report.as_of_ms <= now
        before = report


def trained(ledger: GoodputLedger, node: str, step: int, start_ms: int, beats: int) -> int:
    """Like `train`, with each heartbeat saying the training step: from
    `step` at `start_ms`, the process's count starting at 0."""
    for beat in range(1, beats + 1):
        ledger.stepped(node, 10 * beat, STEP_MS, start_ms + 1000 * beat, step + 10 * beat)
    return step + 10 * beats


def test_steps_trained_beyond_the_step_a_round_restores_are_rolled_back() -> None:
    ledger = GoodputLedger()
    ledger.restored(-1, -1, 0)
    ledger.stepped("a", 0, 0.0, 0)
    step = trained(ledger, "a", 0, 0, 5)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5000)
    ledger.round_formed(frozenset({"a"}))
    ledger.restored(step - 5, step - 5, 6000)  # the last commit was 5 steps back
    report = ledger.report()
    assert report.lost_ms[Cause.ROLLED_BACK] == pytest.approx(500)
    assert report.productive_ms == pytest.approx(4500)


def test_a_stale_trained_step_rolls_back_no_more_than_the_round_counted() -> None:
    ledger = GoodputLedger()
    ledger.restored(-1, -1, 0)
    ledger.stepped("a", 0, 0.0, 0)
    trained(ledger, "a", 0, 0, 3)  # at step 30
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 3000)
    ledger.restored(25, 25, 3500)  # 5 steps rolled back
    # Restored in place: the process counts on and says step 40 before its
    # next save, though it trained from 25 to 35.
    ledger.stepped("a", 30, STEP_MS, 4000)
    ledger.stepped("a", 40, STEP_MS, 5000, 40)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5000)
    ledger.restored(32, 32, 5500)
    report = ledger.report()
    assert report.lost_ms[Cause.ROLLED_BACK] == pytest.approx(500 + 300)


def test_steps_a_stopped_reference_made_after_its_last_beat_are_productive() -> None:
    """The reference's process steps from 5 s to 5.6 s, then a peer dies and
    the round closes at 6 s; its agent stops it and tells the final count at
    6.2 s, before the next round forms: those 6 steps were training."""
    ledger = GoodputLedger()
    ledger.restored(-1, -1, 0)
    ledger.stepped("a", 0, 0.0, 0)
    step = trained(ledger, "a", 0, 0, 5)  # at step 50, counted at 5 s
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 6000)
    ledger.stopped("a", 56, 6200, step + 6)
    ledger.stopped("a", 56, 6500, step + 6)  # the same count again: nothing more
    ledger.round_formed(frozenset({"a"}))
    ledger.restored(step + 6, step + 6, 7000)  # saved every step: nothing rolled back
    trained(ledger, "a", step + 6, 7500, 2)  # a new process, from 7.5 s
    report = ledger.report()
    assert report.productive_ms == pytest.approx(5000 + 600 + 2000)
    assert report.lost_ms[Cause.RESTART] == pytest.approx(400 + 1000 + 500)
    assert report.lost_ms[Cause.ROLLED_BACK] == 0


def test_a_final_count_after_the_next_round_formed_rolls_back_what_it_restored_past() -> None:
    """The same, but the round re-formed (restoring step 52) before the final
    count came: of the 6 late steps, 4 were trained beyond step 52."""
    ledger = GoodputLedger()
    ledger.restored(-1, -1, 0)
    ledger.stepped("a", 0, 0.0, 0)
    step = trained(ledger, "a", 0, 0, 5)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 6000)
    ledger.round_formed(frozenset({"a"}))
    ledger.restored(52, 52, 6100)
    ledger.stopped("a", 56, 6200, step + 6)
    report = ledger.report()
    assert report.productive_ms == pytest.approx(5000 + 200)
    assert report.lost_ms[Cause.ROLLED_BACK] == pytest.approx(400)
    trained(ledger, "a", 52, 7000, 2)
    assert ledger.report().lost_ms[Cause.ROLLED_BACK] == pytest.approx(400)


def test_a_final_count_is_ignored_from_another_node_or_once_training_resumed() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    ledger.stepped("b", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5500)
    ledger.stopped("b", 9, 5600)  # not the reference: its steps are the job's too
    ledger.stepped("a", 3, STEP_MS, 7000)  # a new process trains again
    ledger.stepped("a", 8, STEP_MS, 7500)
    settled = ledger.report()
    ledger.stopped("a", steps + 5, 7600)  # the old process's word, too late
    assert ledger.report() == settled


def test_checkpoint_blocking_of_a_new_process_counts_from_zero() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    train(ledger, "a", 0, 0, 5)
    ledger.checkpoint_blocked("a", 0.4, 5000)
    ledger.checkpoint_blocked("a", 0.1, 5000)  # restarted: its total starts again
    assert ledger.report().lost_ms[Cause.CHECKPOINT] == pytest.approx(500)


def test_the_time_since_the_counts_were_written_waits_for_the_next_count() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5000)
    # Resumed at 5.4 s; the counts read at 6 s were written at 5.7 s (3
    # steps), and the next ones show the 3 steps made until 6 s as well.
    ledger.stepped("a", steps + 3, STEP_MS, 6000, None, 300.0)
    ledger.stepped("a", steps + 16, STEP_MS, 7000, None, 0.0)
    report = ledger.report()
    assert report.lost_ms[Cause.RESTART] == pytest.approx(400)
    assert report.productive_ms == pytest.approx(5000 + 300 + 1300)


def test_counts_with_their_write_times_make_training_productive_up_to_the_write() -> None:
    """Steps slower than their reported time (a loaded machine: 5 steps a
    second, each said to take 100 ms): steps x step time would leave half of
    every second as slack; the write times show training went on."""
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = 0
    for beat in range(1, 11):
        steps += 5
        age = 50.0 + 40 * (beat % 4)  # each beat reads a write 50-170 ms old
        ledger.stepped("a", steps, STEP_MS, 1000 * beat, None, age)
    report = ledger.report()
    assert report.lost_ms[Cause.OTHER] == 0
    # From the first count (5 steps of 100 ms: opened at 0.5 s) up to the
    # last write (10 s - 130 ms): the rest waits for a count.
    assert report.opened_ms == 500
    assert report.productive_ms == pytest.approx(10_000 - 500 - 130)
    assert report.ratio == 1.0


def test_a_crash_with_write_times_loses_from_the_last_write_before_it() -> None:
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    ledger.stepped("b", 0, 0.0, 0)
    steps = 0
    for beat in range(1, 6):
        steps += 10
        ledger.stepped("a", steps, STEP_MS, 1000 * beat, None, 100.0)
        ledger.stepped("b", steps, STEP_MS, 1000 * beat + 500, None, 100.0)
    # Both step on until 5.8 s; "a" (the reference) is killed with its agent
    # and never tells; the round closes at 6.2 s, and "b", aborted in place,
    # tells its final count, written at 5.8 s.
    ledger.interrupted(Cause.NODE_REPLACEMENT, Cause.NODE_REPLACEMENT, 6200)
    ledger.node_gone("a")
    ledger.stopped("b", steps + 4, 6300, None, 500.0)
    ledger.stopped("b", steps + 4, 6400, None, 600.0)  # the same again: nothing more
    report = ledger.report()
    assert report.productive_ms == pytest.approx(5800)
    assert report.lost_ms[Cause.NODE_REPLACEMENT] == pytest.approx(0)  # not settled yet
    # Training resumes at 7 s ("b", in place: 3 steps since its word).
    ledger.stepped("b", steps + 7, STEP_MS, 7300, None, 0.0)
    report = ledger.report()
    assert report.lost_ms[Cause.NODE_REPLACEMENT] == pytest.approx(7000 - 5800)
    assert report.productive_ms == pytest.approx(5800 + 300)


def test_training_resumes_when_the_counts_say_their_run_of_steps_began() -> None:
    """A killed worker of the reference node: its agent's last word (written
    at 5.45 s), the failure at 5.6 s, a beat that still reads the dead
    process's file, then the spare's counts: its first step was at 6.3 s.
    Lost: 5.45 to 6.3 s, not up to the beat that showed no steps."""
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5, age_ms=100.0)
    ledger.stepped("a", steps + 4, STEP_MS, 5600, None, 150.0)  # the last word
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5600)
    ledger.round_formed(frozenset({"a"}))
    ledger.stepped("a", steps + 4, STEP_MS, 6100, None, 650.0)  # the same file again
    ledger.stepped("a", 8, STEP_MS, 7100, None, 50.0, 800.0)  # the spare, from 6.3 s
    report = ledger.report()
    assert report.phase is None
    assert report.lost_ms[Cause.RESTART] == pytest.approx(6300 - 5450)
    assert report.productive_ms == pytest.approx(1000 + 5450 - 1000 + 7050 - 6300)
    # And on, by the write times.
    ledger.stepped("a", 18, STEP_MS, 8100, None, 100.0, 1800.0)
    assert ledger.report().productive_ms == pytest.approx(5450 + 8000 - 6300)


def test_a_survivor_says_when_training_stopped_once_it_steps_again() -> None:
    """The reference's workers live through a failure of the other node's
    (aborted in place): its file is gone while its process is between
    attempts, so the beat then tells nothing and settles nothing; its first
    counts of the next run say when the run before ended (5.5 s, after its
    last write before the failure, 4.9 s) and when this one began (6.3 s).
    Lost: 5.5 to 6.3 s."""
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5, age_ms=100.0)
    ledger.interrupted(Cause.RESTART, Cause.RESTART, 5700)
    ledger.round_formed(frozenset({"a", "b"}))
    ledger.stepped("a", 0, 0.0, 6000)  # between attempts: no file
    assert ledger.report().lost_ms[Cause.RESTART] == pytest.approx(0)  # nothing settled
    # 6 steps to 5.5 s, then 8 from 6.3 s, written at 7.05 s.
    ledger.stepped("a", steps + 14, STEP_MS, 7100, None, 50.0, 800.0, 1600.0)
    report = ledger.report()
    assert report.phase is None
    assert report.lost_ms[Cause.RESTART] == pytest.approx(6300 - 5500)
    assert report.productive_ms == pytest.approx(5500 + 7050 - 6300)


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, max_size=40), st.integers(0, 40))
def test_a_ledger_written_to_the_journal_and_read_back_goes_on_the_same(
    sequence: list[Op], cut: int
) -> None:
    """A restarted master goes on from the ledger it wrote (as JSON): from any
    point of any sequence, the copy and the original report the same after
    every later event."""
    ledger = GoodputLedger()
    now, steps = 0, dict[str, int]()
    for op in sequence[:cut]:
        now += op.after_ms
        play(ledger, op, now, steps)
    copy = GoodputLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert copy.to_dict() == ledger.to_dict()
    copy_steps = dict(steps)
    for op in sequence[cut:]:
        now += op.after_ms
        play(ledger, op, now, steps)
        play(copy, op, now, copy_steps)
        assert _same(copy, ledger)


def _same(a: GoodputLedger, b: GoodputLedger) -> bool:
    ra, rb = a.report(), b.report()
    return (
        ra.opened_ms == rb.opened_ms
        and ra.as_of_ms == rb.as_of_ms
        and ra.phase is rb.phase
        and ra.productive_ms == pytest.approx(rb.productive_ms)
        and all(ra.lost_ms[c] == pytest.approx(rb.lost_ms[c]) for c in Cause)
    )


def test_a_master_restart_gap_is_taken_back_by_the_steps_made_in_it() -> None:
    """The master was down from 5 s to 9 s (its last write of the ledger at
    5 s) while the node trained on: the new master's first heartbeat counts
    those steps, so the gap is productive, not lost."""
    ledger = GoodputLedger()
    ledger.stepped("a", 0, 0.0, 0)
    steps = train(ledger, "a", 0, 0, 5)
    restarted = GoodputLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    train(restarted, "a", steps + 40, 9000, 3)  # 40 steps in the gap, then on
    report = restarted.report()
    assert report.opened_ms == 0
    assert report.productive_ms == pytest.approx(12_000)
    assert report.ratio == pytest.approx(1.0)


def test_a_ledger_with_an_unknown_cause_is_an_error_naming_it() -> None:
    data = GoodputLedger().to_dict()
    data["lost_ms"]["solar_flare"] = 1.0
    with pytest.raises(ValueError, match="solar_flare"):
        GoodputLedger.from_dict(data)
