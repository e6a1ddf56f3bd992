"""Records to and from `dlfleet.api.v1.brain_pb2`, and the Brain service's name.
Decoding checks every field (through the records' own checks), so a bad request
is InvalidArgument. Both ends of the wire import this module: the server
(`server.py`) and the client (`client.py`), never one the other."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.v1 import brain_pb2 as pb
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

# The Brain service's full name, as the health service knows it: the server
# marks it SERVING, the client's readiness probe asks for it.
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Brain"].full_name

_STATUS: dict[JobStatus, pb.BrainJobStatus.ValueType] = {
    JobStatus.RUNNING: pb.BRAIN_JOB_STATUS_RUNNING,
    JobStatus.SUCCEEDED: pb.BRAIN_JOB_STATUS_SUCCEEDED,
    JobStatus.FAILED: pb.BRAIN_JOB_STATUS_FAILED,
}
_STATUS_BACK = {v: k for k, v in _STATUS.items()} | {
    pb.BRAIN_JOB_STATUS_UNSPECIFIED: JobStatus.RUNNING
}
_FAILURE: dict[FailureKind, pb.BrainFailureKind.ValueType] = {
    FailureKind.CRASH: pb.BRAIN_FAILURE_KIND_CRASH,
    FailureKind.OOM: pb.BRAIN_FAILURE_KIND_OOM,
    FailureKind.EVICTED: pb.BRAIN_FAILURE_KIND_EVICTED,
    FailureKind.HANG: pb.BRAIN_FAILURE_KIND_HANG,
    FailureKind.LOST: pb.BRAIN_FAILURE_KIND_LOST,
    FailureKind.NODE_CHECK: pb.BRAIN_FAILURE_KIND_NODE_CHECK,
}
_FAILURE_BACK = {v: k for k, v in _FAILURE.items()}
_PLAN: dict[PlanKind, pb.PlanKind.ValueType] = {
    PlanKind.NONE: pb.PLAN_KIND_NONE,
    PlanKind.INITIAL: pb.PLAN_KIND_INITIAL,
    PlanKind.SCALE: pb.PLAN_KIND_SCALE,
    PlanKind.MEMORY: pb.PLAN_KIND_MEMORY,
    PlanKind.REPLACE_NODE: pb.PLAN_KIND_REPLACE_NODE,
}
_PLAN_BACK = {v: k for k, v in _PLAN.items()}


def _json_object(text: str, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value


def _dump(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def job_to_wire(info: JobInfo) -> pb.BrainJob:
    return pb.BrainJob(
        name=info.name,
        signature=info.signature,
        min_nodes=info.min_nodes,
        max_nodes=info.max_nodes,
        initial_nodes=info.initial_nodes,
        memory_request_bytes=info.memory_request_bytes,
        memory_limit_bytes=info.memory_limit_bytes,
        cpu_request=info.cpu_request,
        status=_STATUS[info.status],
        config_json=_dump(info.config) if info.config else "",
    )


def job_from_wire(msg: pb.BrainJob) -> JobInfo:
    status = _STATUS_BACK.get(msg.status)
    if status is None:
        raise InvalidArgument(f"job {msg.name!r}: unknown status {msg.status}")
    return JobInfo(
        name=msg.name,
        signature=msg.signature,
        min_nodes=msg.min_nodes,
        max_nodes=msg.max_nodes,
        initial_nodes=msg.initial_nodes,
        memory_request_bytes=msg.memory_request_bytes,
        memory_limit_bytes=msg.memory_limit_bytes,
        cpu_request=msg.cpu_request,
        status=status,
        config=_json_object(msg.config_json, f"job {msg.name!r}: config_json"),
    )


def round_to_wire(r: RoundMetrics) -> pb.BrainRound:
    return pb.BrainRound(
        round=r.round,
        nodes=r.nodes,
        world_size=r.world_size,
        started_unix_ms=r.started_ms,
        ended_unix_ms=r.ended_ms,
        samples_per_second=r.samples_per_s,
        step_time_mean_s=r.step_time_mean_s,
        step_time_p50_s=r.step_time_p50_s,
        step_time_p90_s=r.step_time_p90_s,
    )


def round_from_wire(m: pb.BrainRound) -> RoundMetrics:
    return RoundMetrics(
        round=m.round,
        nodes=m.nodes,
        world_size=m.world_size,
        started_ms=m.started_unix_ms,
        ended_ms=m.ended_unix_ms,
        samples_per_s=m.samples_per_second,
        step_time_mean_s=m.step_time_mean_s,
        step_time_p50_s=m.step_time_p50_s,
        step_time_p90_s=m.step_time_p90_s,
    )


def sample_to_wire(s: NodeSample) -> pb.BrainNodeSample:
    return pb.BrainNodeSample(
        node=s.node,
        round=s.round,
        time_unix_ms=s.at_ms,
        cpu_percent=s.cpu_percent,
        memory_rss_bytes=s.memory_rss_bytes,
        memory_limit_bytes=s.memory_limit_bytes,
        memory_request_bytes=s.memory_request_bytes,
        samples_per_second=s.samples_per_s,
        step_time_s=s.step_time_s,
    )


def sample_from_wire(m: pb.BrainNodeSample) -> NodeSample:
    return NodeSample(
        node=m.node,
        round=m.round,
        at_ms=m.time_unix_ms,
        cpu_percent=m.cpu_percent,
        memory_rss_bytes=m.memory_rss_bytes,
        memory_limit_bytes=m.memory_limit_bytes,
        memory_request_bytes=m.memory_request_bytes,
        samples_per_s=m.samples_per_second,
        step_time_s=m.step_time_s,
    )


def failure_to_wire(f: FailureRecord) -> pb.BrainFailure:
    msg = pb.BrainFailure(
        node=f.node, kind=_FAILURE[f.kind], message=f.message, time_unix_ms=f.at_ms
    )
    if f.exit_code is not None:
        msg.exit_code = f.exit_code
    return msg


def failure_from_wire(m: pb.BrainFailure) -> FailureRecord:
    kind = _FAILURE_BACK.get(m.kind)
    if kind is None:
        raise InvalidArgument(f"failure of node {m.node!r}: kind {m.kind} is not a known kind")
    return FailureRecord(
        node=m.node,
        kind=kind,
        at_ms=m.time_unix_ms,
        exit_code=m.exit_code if m.HasField("exit_code") else None,
        message=m.message,
    )


def check_to_wire(c: NodeCheckRecord) -> pb.BrainNodeCheck:
    return pb.BrainNodeCheck(
        node=c.node,
        time_unix_ms=c.at_ms,
        faulty=c.faulty,
        rule=c.rule,
        compute_ms=c.compute_ms,
        compute_reference_ms=c.compute_reference_ms,
        pair_ms=c.pair_ms,
        pair_reference_ms=c.pair_reference_ms,
        reason=c.reason,
    )


def check_from_wire(m: pb.BrainNodeCheck) -> NodeCheckRecord:
    return NodeCheckRecord(
        node=m.node,
        at_ms=m.time_unix_ms,
        faulty=m.faulty,
        rule=m.rule,
        compute_ms=m.compute_ms,
        compute_reference_ms=m.compute_reference_ms,
        pair_ms=m.pair_ms,
        pair_reference_ms=m.pair_reference_ms,
        reason=m.reason,
    )


def batch_to_wire(batch: MetricsBatch) -> pb.PersistMetricsRequest:
    msg = pb.PersistMetricsRequest(
        job_name=batch.job,
        rounds=[round_to_wire(r) for r in batch.rounds],
        samples=[sample_to_wire(s) for s in batch.samples],
        failures=[failure_to_wire(f) for f in batch.failures],
        node_checks=[check_to_wire(c) for c in batch.node_checks],
    )
    if batch.info is not None:
        msg.job.CopyFrom(job_to_wire(batch.info))
    return msg


def batch_from_wire(msg: pb.PersistMetricsRequest) -> MetricsBatch:
    return MetricsBatch(
        job=msg.job_name,
        info=job_from_wire(msg.job) if msg.HasField("job") else None,
        rounds=[round_from_wire(r) for r in msg.rounds],
        samples=[sample_from_wire(s) for s in msg.samples],
        failures=[failure_from_wire(f) for f in msg.failures],
        node_checks=[check_from_wire(c) for c in msg.node_checks],
    )


def plan_request_to_wire(request: PlanRequest) -> pb.PlanRequest:
    msg = pb.PlanRequest(
        job=job_to_wire(request.job),
        nodes=request.nodes,
        memory_limit_bytes=request.memory_limit_bytes,
    )
    if request.oom_relaunch is not None:
        msg.oom_relaunch.CopyFrom(
            pb.OomRelaunch(
                node=request.oom_relaunch.node,
                memory_limit_bytes=request.oom_relaunch.memory_limit_bytes,
            )
        )
    return msg


def plan_request_from_wire(msg: pb.PlanRequest) -> PlanRequest:
    if not msg.HasField("job"):
        raise InvalidArgument("plan request without its job")
    relaunch = None
    if msg.HasField("oom_relaunch"):
        relaunch = OomRelaunch(msg.oom_relaunch.node, msg.oom_relaunch.memory_limit_bytes)
    return PlanRequest(
        job=job_from_wire(msg.job),
        nodes=msg.nodes,
        memory_limit_bytes=msg.memory_limit_bytes,
        oom_relaunch=relaunch,
    )


def plan_to_wire(plan: Plan) -> pb.BrainPlan:
    return pb.BrainPlan(
        id=plan.id,
        job_name=plan.job,
        kind=_PLAN[plan.kind],
        target_nodes=plan.target_nodes,
        node=plan.node,
        memory_bytes=plan.memory_bytes,
        cpu=plan.cpu,
        reason=plan.reason,
        evidence_json=_dump(plan.evidence),
        created_unix_ms=plan.created_ms,
        applied=plan.applied,
        applied_unix_ms=plan.applied_ms or 0,
        current_nodes=plan.current_nodes,
    )


def plan_from_wire(msg: pb.BrainPlan) -> Plan:
    kind = _PLAN_BACK.get(msg.kind)
    if kind is None:
        raise InvalidArgument(f"plan {msg.id}: unknown kind {msg.kind}")
    return Plan(
        id=PlanId(msg.id),
        job=msg.job_name,
        kind=kind,
        reason=msg.reason,
        evidence=_json_object(msg.evidence_json, f"plan {msg.id}: evidence_json"),
        created_ms=msg.created_unix_ms,
        current_nodes=msg.current_nodes,
        target_nodes=msg.target_nodes,
        node=msg.node,
        memory_bytes=msg.memory_bytes,
        cpu=msg.cpu,
        applied=msg.applied,
        applied_ms=msg.applied_unix_ms if msg.applied else None,
    )


def report_to_wire(report: JobReport) -> pb.BrainReport:
    return pb.BrainReport(
        job=job_to_wire(report.job),
        sizes=[
            pb.SizeThroughput(
                nodes=s.nodes,
                world_size=s.world_size,
                rounds=s.rounds,
                samples_per_second=s.samples_per_s,
                efficiency=s.efficiency,
            )
            for s in report.sizes
        ],
        plans=[plan_to_wire(p) for p in report.plans],
        failures=[
            pb.FailureCount(kind=_FAILURE[kind], count=count)
            for kind, count in sorted(report.failures.items(), key=lambda kv: kv[0].value)
        ],
        created_unix_ms=report.created_ms,
        updated_unix_ms=report.updated_ms,
        rounds=[
            pb.RoundSpan(round=r.round, nodes=r.nodes, duration_s=r.duration_s)
            for r in report.rounds
        ],
        min_round_s=report.min_round_s,
        node_checks=[check_to_wire(c) for c in report.node_checks],
    )


def report_from_wire(msg: pb.BrainReport) -> JobReport:
    return JobReport(
        job=job_from_wire(msg.job),
        created_ms=msg.created_unix_ms,
        updated_ms=msg.updated_unix_ms,
        sizes=[
            SizeThroughput(
                nodes=s.nodes,
                world_size=s.world_size,
                rounds=s.rounds,
                samples_per_s=s.samples_per_second,
                efficiency=s.efficiency,
            )
            for s in msg.sizes
        ],
        plans=[plan_from_wire(p) for p in msg.plans],
        failures={_FAILURE_BACK[f.kind]: f.count for f in msg.failures if f.kind in _FAILURE_BACK},
        rounds=[RoundSpan(r.round, r.nodes, r.duration_s) for r in msg.rounds],
        min_round_s=msg.min_round_s,
        node_checks=[check_from_wire(c) for c in msg.node_checks],
    )
