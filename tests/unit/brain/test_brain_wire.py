"""Records survive the wire unchanged; bad fields are InvalidArgument."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.v1 import brain_pb2
from dlfleet.brain import wire
from dlfleet.brain.records import (
    FailureKind,
    FailureRecord,
    JobInfo,
    JobReport,
    JobStatus,
    MetricsBatch,
    NodeCheckRecord,
    NodeSample,
    OomRelaunch,
    Plan,
    PlanId,
    PlanKind,
    PlanRequest,
    RoundMetrics,
    RoundSpan,
    SizeThroughput,
)

names = st.text(min_size=1, max_size=40)  # no surrogates: they are not UTF-8
ms = st.integers(0, 2**50)
rates = st.floats(0, 1e9, allow_nan=False)
jobs = st.builds(
    lambda name, sig, lo, extra, status, mem, cpu, cfg: JobInfo(
        name=name,
        signature=sig,
        min_nodes=lo,
        max_nodes=lo + extra,
        memory_request_bytes=mem,
        cpu_request=cpu,
        status=status,
        config=cfg,
    ),
    names,
    names,
    st.integers(1, 100),
    st.integers(0, 100),
    st.sampled_from(JobStatus),
    st.integers(0, 2**60),
    rates,
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
)


@given(
    job=jobs,
    round_=st.builds(
        lambda r, n, start, span, rate: RoundMetrics(r, n, n * 2, start, start + span, rate),
        st.integers(0, 2**40),
        st.integers(1, 1000),
        ms,
        ms,
        rates,
    ),
    sample=st.builds(NodeSample, names, st.integers(0, 99), ms, rates, st.integers(0, 2**60)),
    failure=st.builds(
        FailureRecord,
        names,
        st.sampled_from(FailureKind),
        ms,
        st.none() | st.integers(-(2**31), 2**31 - 1),
        st.text(max_size=50),
    ),
    check=st.builds(
        NodeCheckRecord,
        names,
        ms,
        st.booleans(),
        st.sampled_from(["healthy", "compute_slow", "pairs_failed"]),
        rates,
        rates,
        rates,
        rates,
        st.text(max_size=50),
    ),
)
def test_a_batch_round_trips(
    job: JobInfo,
    round_: RoundMetrics,
    sample: NodeSample,
    failure: FailureRecord,
    check: NodeCheckRecord,
) -> None:
    batch = MetricsBatch(job.name, job, [round_], [sample], [failure], [check])
    raw = wire.batch_to_wire(batch).SerializeToString()
    assert wire.batch_from_wire(brain_pb2.PersistMetricsRequest.FromString(raw)) == batch


def test_plans_requests_and_reports_round_trip() -> None:
    job = JobInfo(name="j", signature="s", min_nodes=1, max_nodes=4)
    request = PlanRequest(job, 2, 1 << 30, OomRelaunch("n1", 1 << 30))
    assert wire.plan_request_from_wire(wire.plan_request_to_wire(request)) == request
    plan = Plan(
        id=PlanId(7),
        job="j",
        kind=PlanKind.SCALE,
        reason="why",
        evidence={"throughput": {"2": 10.0}},
        created_ms=5,
        current_nodes=2,
        target_nodes=3,
        applied=True,
        applied_ms=9,
    )
    assert wire.plan_from_wire(wire.plan_to_wire(plan)) == plan
    report = JobReport(
        job, 1, 2, [SizeThroughput(2, 8, 3, 10.0, 1.0)], [plan], {FailureKind.OOM: 2},
        rounds=[RoundSpan(1, 2, 75.5), RoundSpan(2, 2, 12.0)], min_round_s=60.0,
        node_checks=[NodeCheckRecord("n1", 3, False, "healthy", 10.5, 10.0, 0.8, 0.75, "ok")],
    )  # fmt: skip
    assert wire.report_from_wire(wire.report_to_wire(report)) == report


@pytest.mark.parametrize(
    "message, complaint",
    [
        (brain_pb2.BrainJob(name="", signature="s", min_nodes=1, max_nodes=1), "job name"),
        (brain_pb2.BrainJob(name="j", signature="s", min_nodes=0, max_nodes=1), "min"),
        (brain_pb2.BrainJob(name="j", signature="s", min_nodes=3, max_nodes=2), "min"),
        (
            brain_pb2.BrainJob(name="j", signature="s", min_nodes=1, max_nodes=1, config_json="["),
            "not JSON",
        ),
        (
            brain_pb2.BrainJob(name="j", signature="s", min_nodes=1, max_nodes=1, config_json="1"),
            "JSON object",
        ),
    ],
)
def test_a_bad_job_is_refused_naming_the_field(message: brain_pb2.BrainJob, complaint: str) -> None:
    with pytest.raises(InvalidArgument, match=complaint):
        wire.job_from_wire(message)


def test_bad_records_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="ends before it starts"):
        wire.round_from_wire(
            brain_pb2.BrainRound(round=1, nodes=1, world_size=1, started_unix_ms=5, ended_unix_ms=4)
        )
    with pytest.raises(InvalidArgument, match="not a known kind"):
        wire.failure_from_wire(brain_pb2.BrainFailure(node="n"))
    with pytest.raises(InvalidArgument, match="samples_per_s"):
        wire.sample_from_wire(brain_pb2.BrainNodeSample(node="n", samples_per_second=-1))
    with pytest.raises(InvalidArgument, match="memory_rss_bytes"):
        NodeSample("n", 1, 0, memory_rss_bytes=2**64)
    with pytest.raises(InvalidArgument, match="exit_code"):
        FailureRecord("n", FailureKind.CRASH, 0, exit_code=2**40)
    with pytest.raises(InvalidArgument, match="without its job"):
        wire.plan_request_from_wire(brain_pb2.PlanRequest(nodes=1))
