"""Chaos, end to end and short: the chaos bench (bench/chaos.py) runs the
quickstart-shaped ledger job under `dlmaster --job-config` for about a minute
of training and injects one fault of each kind, in a seeded order, each once
the job has recovered from the previous one: a training process SIGKILLed, a
node's agent SIGKILLed (the node is relaunched), a node preempted (SIGTERM;
it leaves and a fresh node is scaled in), the master SIGKILLed (the
supervisor restarts it), a training process SIGSTOPped (the step watchdog
restarts the workers). The job must succeed, every fault must be detected
and recovered from, the ledger must hold each epoch's records exactly once
in the final lineage, and nothing of the job may outlive it.

About 1.5-2 minutes on a 2-core machine; the 10-minute run with a fault every
30-60 s is the bench itself (`bench/chaos.py`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dlfleet.master.job.runner import POLL_S as SUPERVISOR_POLL_S

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402
from _chaos_timeline import StepLine, account, intervals, stalled_between  # noqa: E402


def test_the_time_accounting_of_a_ledger() -> None:
    """Two ranks step every 0.1 s from t=0 (attempt 1, steps 1-10), stall
    (no step) until t=3, then attempt 2 restores step 8 and steps 9-18; attempt
    1's steps 9 and 10 were rolled back."""
    lines = []
    for rank in (0, 1):
        lines += [StepLine(1, rank, 2, s, (s - 1) * 0.1, counted=s <= 8) for s in range(1, 11)]
        lines += [StepLine(2, rank, 2, s, 3.0 + (s - 9) * 0.1) for s in range(9, 19)]
    a = account(lines)
    assert a.typical_step == pytest.approx(0.1)
    assert a.start == 0.0 and a.end == pytest.approx(4.0)  # last step at 3.9, one step long
    assert a.busy == pytest.approx(2.0)  # 20 steps of 0.1 s, ranks overlapping
    assert a.useful == pytest.approx(1.8)  # steps 9 and 10 of attempt 1 were lost
    assert a.stalled == pytest.approx(2.0) and a.lost_work == pytest.approx(0.2)
    assert a.goodput == pytest.approx(1.8 / 4.0)
    assert stalled_between(intervals(lines), 0.5, 3.5) == pytest.approx(2.0)


def test_a_step_far_longer_than_usual_counts_as_a_stall() -> None:
    lines = [StepLine(1, 0, 1, s, t) for s, t in enumerate([0.0, 0.1, 0.2, 0.3, 5.3, 5.4], 1)]
    a = account(lines)
    assert a.useful == pytest.approx(0.6) and a.stalled == pytest.approx(4.9)


def test_watchdog_calls_are_read_from_the_agents_logs_and_matched_to_the_hangs(
    tmp_path: Path,
) -> None:
    (tmp_path / "node-0.log").write_text(
        "2026-11-27 10:00:01,250 dlworker ERROR local rank 1 hung: no training step for 0.6s\n"
        "2026-11-27 10:00:01,300 dlworker INFO local rank 0 hung: quoted, not a call\n"
        "[rank0] hung: a training script's own line\n"
    )
    (tmp_path / "node-1.log").write_text(
        "2026-11-27 10:05:00,000 dlworker ERROR local rank 0 hung: no training step for 0.6s\n"
    )
    calls = chaos.watchdog_calls(tmp_path)
    base = time.mktime(time.strptime("2026-11-27 10:00:00", "%Y-%m-%d %H:%M:%S"))
    assert calls == [pytest.approx(base + 1.25), pytest.approx(base + 300.0)]
    hang = chaos.Fault(0, "hang-worker", "node-0", 1, base + 0.5, 1, 0)
    kill = chaos.Fault(1, "kill-worker", "node-1", 2, base + 299.0, 2, 0)
    assert chaos.unexplained(calls, [hang, kill]) == [pytest.approx(base + 300.0)]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_one_fault_of_each_kind_is_survived_and_every_record_trained_once(
    tmp_path: Path,
) -> None:
    settings = chaos.Settings(
        minutes=1.0,
        seed=1,
        fault_every=(3.0, 6.0),  # in practice: as soon as the job is steady again
        faults=len(chaos.KINDS),
        settle_s=3.0,
        recover_timeout_s=120.0,
        job_timeout_s=480.0,
        workdir=tmp_path / "chaos",
    )
    result = chaos.run(settings)
    chaos.report(result)  # shown when the test fails
    assert sorted(f.kind for f in result.faults) == sorted(chaos.KINDS)
    assert result.code == 0, f"the job failed: {result.reason}"
    assert result.ledger_ok, result.ledger_summary
    for fault in result.faults:
        assert fault.ok, f"{fault.kind} was not survived: {fault.as_dict()}"
        assert fault.detect_s is not None and fault.full_s is not None
        # Detection is read from a polled status, and an in-place restart can
        # be back at full strength before the poll that sees it (a poll takes
        # longer than POLL_S under load). The status is dlmaster's (the job's
        # supervisor), which asks the master every SUPERVISOR_POLL_S: it may
        # lag the master by that period and one round trip. What must hold:
        # the last status that showed no change was asked for before the world
        # was full again, give or take that lag.
        lag = 2 * SUPERVISOR_POLL_S
        assert (fault.since(fault.unchanged_at) or 0.0) <= fault.full_s + lag
    assert not result.problems, result.problems
    # The hang was called (by one agent or both) and nothing else was.
    assert result.hang_calls and not result.false_hangs, (result.hang_calls, result.false_hangs)
    assert result.discarded >= 0 and result.counted > 0
    assert 0.0 < result.goodput <= 1.0
    # The job's own goodput agrees with the step ledger's over the same
    # windows, checkpoint blocking counted alike (as step time: the step
    # ledger cannot see it). The 10-minute bench holds it within a point;
    # this minute of training, a fault every few seconds on a loaded
    # machine, within three.
    own, external = result.job_goodput_alike, result.external_in_job_windows
    assert own is not None and external is not None, result.job_ledgers
    assert abs(own - external) <= 0.03, (own, external, result.job_ledgers)
