"""The goodput ledger on the wire: the master's report as `job_pb2.Goodput`
(every cause, in seconds, summing to the window) and as the live status
block's pace line."""

from __future__ import annotations

import pytest

from dlfleet.api.v1 import job_pb2
from dlfleet.master.core.goodput import Cause, Goodput
from dlfleet.master.job.display import goodput_text, status_lines
from dlfleet.master.service.status_service import goodput_to_wire


def report() -> Goodput:
    lost = dict.fromkeys(Cause, 0.0)
    lost[Cause.RESTART] = 2_000.0
    lost[Cause.HANG_DETECTION] = 3_500.0
    lost[Cause.OTHER] = 500.0
    return Goodput(
        opened_ms=1_000,
        as_of_ms=61_000,
        productive_ms=54_000.0,
        lost_ms=lost,
        phase=Cause.RESTART,
    )


def test_the_wire_holds_every_cause_in_seconds_and_they_sum_to_the_window() -> None:
    wire = goodput_to_wire(report())
    assert [item.cause for item in wire.badput] == [cause.value for cause in Cause]
    assert wire.window_seconds == pytest.approx(60.0)
    assert wire.productive_seconds + sum(item.seconds for item in wire.badput) == pytest.approx(
        wire.window_seconds
    )
    assert wire.ratio == pytest.approx(0.9)
    assert (wire.opened_unix_ms, wire.as_of_unix_ms, wire.phase) == (1_000, 61_000, "restart")


def test_before_the_first_step_the_wire_says_so_with_zeros() -> None:
    empty = Goodput(
        opened_ms=None, as_of_ms=0, productive_ms=0.0, lost_ms=dict.fromkeys(Cause, 0.0), phase=None
    )
    wire = goodput_to_wire(empty)
    assert (wire.ratio, wire.window_seconds, wire.opened_unix_ms, wire.phase) == (0, 0, 0, "")
    assert goodput_text(wire) is None


def test_the_status_block_shows_the_goodput_and_its_two_largest_losses_on_the_pace_line() -> None:
    status = job_pb2.JobStatus(
        job_name="job", phase="running", samples_per_second=12.5, eta_seconds=90
    )
    status.goodput.CopyFrom(goodput_to_wire(report()))
    pace = status_lines(status)[1]
    assert pace == (
        "  12.5 samples/s | ETA 1m30s | goodput 90.0% (lost: hang_detection 3.5s, restart 2.0s)"
    )
