"""A lease report decodes to one value, done or failed, and a report that
names neither is refused with what to set."""

from __future__ import annotations

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.v1 import shards_pb2
from dlfleet.master.service.wire import LeaseReport, lease_report_from_wire


def test_a_done_report_and_a_failure_decode_to_their_values() -> None:
    done = shards_pb2.ReportRequest(dataset="d", lease_id=7, round=2, done=shards_pb2.ShardDone())
    assert lease_report_from_wire(done) == LeaseReport("d", 7, 2, done=True)
    failed = shards_pb2.ReportRequest(
        dataset="d",
        lease_id=8,
        round=3,
        failure=shards_pb2.ShardFailure(consumed=5, reason="worker died"),
    )
    assert lease_report_from_wire(failed) == LeaseReport(
        "d", 8, 3, done=False, consumed=5, reason="worker died"
    )


def test_a_report_without_a_result_is_refused_saying_what_to_set() -> None:
    with pytest.raises(InvalidArgument, match="set `done` or `failure`"):
        lease_report_from_wire(shards_pb2.ReportRequest(dataset="d", lease_id=1))
