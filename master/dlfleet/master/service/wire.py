"""Conversions between the wire messages (dlfleet.api.v1) and the core's values.

Kept apart from the servicers so that the handlers read as "decode, decide,
persist, encode", and so that the one place that knows both vocabularies is
small.

Lives in the master service process.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.v1 import checkpoint_pb2, nodecheck_pb2, shards_pb2
from dlfleet.master.core.checkpoint_events import ImageCopy
from dlfleet.master.core.checkpoints import (
    CheckpointReport,
    CheckpointStatusView,
    CheckpointView,
    PersistedStep,
)
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.node_check import (
    CheckFailed,
    ComputeDone,
    ComputeOrder,
    Order,
    PairDone,
    PairOrder,
    Ready,
    Result,
)
from dlfleet.master.core.node_check_verdict import Verdict
from dlfleet.master.core.shards import (
    Answer,
    Consumer,
    DatasetStatusView,
    FailedRange,
    LeaseOutcome,
    RankConsumer,
    RoundConsumer,
    Snapshot,
)


def config_from_spec(spec: shards_pb2.DatasetSpec) -> DatasetConfig:
    return DatasetConfig.create(
        name=spec.name,
        size=spec.size,
        batch_size=spec.batch_size,
        shard_size=spec.shard_size,
        epochs=spec.epochs,
        shuffle=spec.shuffle,
        seed=spec.seed,
        drop_last=spec.drop_last,
        max_shard_failures=spec.max_shard_failures,
    )


def spec_from_config(config: DatasetConfig) -> shards_pb2.DatasetSpec:
    return shards_pb2.DatasetSpec(
        name=config.name,
        size=config.size,
        batch_size=config.batch_size,
        shard_size=config.shard_size,
        epochs=config.epochs,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=config.drop_last,
        max_shard_failures=config.max_shard_failures,
    )


def consumer_from_request(request: shards_pb2.LeaseRequest) -> Consumer:
    which = request.WhichOneof("consumer")
    if which == "rank":
        return RankConsumer(request.rank.node_id, request.rank.rank)
    if which == "round":
        return RoundConsumer(request.round.round, request.round.position)
    raise InvalidArgument("lease request names no consumer: set `rank` or `round`")


def lease_response(outcome: LeaseOutcome, *more: LeaseOutcome) -> shards_pb2.LeaseResponse:
    """`outcome`, and after a shard the shards of the following positions
    (`LeaseRequest.count`)."""
    if outcome.answer is Answer.SHARD:
        return shards_pb2.LeaseResponse(
            shard=shard_to_wire(outcome), more=[shard_to_wire(o) for o in more]
        )
    if outcome.answer is Answer.END_OF_EPOCH:
        return shards_pb2.LeaseResponse(end_of_epoch=shards_pb2.EndOfEpoch(epoch=outcome.epoch))
    if outcome.answer is Answer.END_OF_DATASET:
        return shards_pb2.LeaseResponse(end_of_dataset=shards_pb2.EndOfDataset())
    return shards_pb2.LeaseResponse(wait=shards_pb2.Wait(retry_after_ms=outcome.retry_after_ms))


def shard_to_wire(outcome: LeaseOutcome) -> shards_pb2.Shard:
    shard = outcome.shard
    assert shard is not None and outcome.answer is Answer.SHARD
    return shards_pb2.Shard(
        dataset=shard.dataset,
        epoch=shard.epoch,
        start=shard.start,
        end=shard.end,
        lease_id=shard.lease_id,
        deadline_unix_ms=shard.deadline_ms,
        round=shard.round,
    )


def failed_to_wire(failed: FailedRange) -> shards_pb2.FailedShard:
    return shards_pb2.FailedShard(
        epoch=failed.epoch,
        range=shards_pb2.Range(start=failed.start, end=failed.end),
        failures=failed.failures,
        last_reason=failed.reason,
    )


@dataclass(frozen=True)
class LeaseReport:
    """A consumer's word on one lease (`Report`): trained whole (`done`), or
    given up after `consumed` of its records, for `reason`."""

    dataset: str
    lease_id: int
    round: int
    done: bool
    consumed: int = 0
    reason: str = ""


def lease_report_from_wire(msg: shards_pb2.ReportRequest) -> LeaseReport:
    which = msg.WhichOneof("result")
    if which == "done":
        return LeaseReport(msg.dataset, msg.lease_id, msg.round, done=True)
    if which == "failure":
        return LeaseReport(
            msg.dataset,
            msg.lease_id,
            msg.round,
            done=False,
            consumed=msg.failure.consumed,
            reason=msg.failure.reason,
        )
    raise InvalidArgument("report names no result: set `done` or `failure`")


def snapshot_to_wire(snap: Snapshot) -> shards_pb2.DatasetSnapshot:
    return shards_pb2.DatasetSnapshot(
        dataset=snap.dataset,
        spec_digest=snap.spec_digest,
        epoch=snap.epoch,
        done=[shards_pb2.Range(start=s, end=e) for s, e in snap.done],
        failed=[failed_to_wire(f) for f in snap.failed],
        finished=snap.finished,
    )


def snapshot_from_wire(msg: shards_pb2.DatasetSnapshot) -> Snapshot:
    return Snapshot(
        dataset=msg.dataset,
        spec_digest=msg.spec_digest,
        epoch=msg.epoch,
        done=tuple((r.start, r.end) for r in msg.done),
        failed=tuple(
            FailedRange(f.epoch, f.range.start, f.range.end, f.failures, f.last_reason)
            for f in msg.failed
        ),
        finished=msg.finished,
    )


def status_to_wire(view: DatasetStatusView) -> shards_pb2.DatasetStatus:
    return shards_pb2.DatasetStatus(
        spec=spec_from_config(view.config),
        epoch=view.epoch,
        finished=view.finished,
        records_per_epoch=view.records_per_epoch,
        records_done=view.records_done,
        records_doing=view.records_doing,
        records_todo=view.records_todo,
        leases_active=view.leases_active,
        failed=[failed_to_wire(f) for f in view.failed],
    )


# ------------------------------------------------------------- checkpoints


def checkpoint_report_from_wire(msg: checkpoint_pb2.CheckpointReport) -> CheckpointReport:
    """A copy that names no node is held by the reporting node."""
    copies = tuple(
        ImageCopy(
            rank=c.rank,
            node_id=c.node_id or msg.node_id,
            address=c.address,
            replica=c.replica,
            size=c.bytes,
        )
        for c in msg.copies
    )
    return CheckpointReport(
        node_id=msg.node_id,
        step=msg.step,
        round=msg.round,
        world_size=msg.world_size,
        copies=copies,
        dropped_below=msg.dropped_below,
        earlier_steps=tuple(msg.earlier_steps),
    )


def image_copy_to_wire(copy: ImageCopy) -> checkpoint_pb2.ImageCopy:
    return checkpoint_pb2.ImageCopy(
        rank=copy.rank,
        node_id=copy.node_id,
        address=copy.address,
        replica=copy.replica,
        bytes=copy.size,
    )


def checkpoint_record_to_wire(view: CheckpointView | None) -> checkpoint_pb2.CheckpointRecord:
    if view is None:
        return checkpoint_pb2.CheckpointRecord(found=False)
    return checkpoint_pb2.CheckpointRecord(
        found=True,
        step=view.step,
        round=view.round,
        world_size=view.world_size,
        copies=[image_copy_to_wire(c) for c in view.copies],
    )


def persisted_from_wire(msg: checkpoint_pb2.PersistedReport) -> PersistedStep:
    return PersistedStep(step=msg.step, path=msg.path, round=msg.round, world_size=msg.world_size)


def checkpoint_status_to_wire(view: CheckpointStatusView) -> checkpoint_pb2.CheckpointStatus:
    return checkpoint_pb2.CheckpointStatus(
        committed_step=view.committed_step,
        restorable_step=view.restorable_step,
        bytes_held=view.bytes_held,
        persisted_step=view.persisted_step,
        persisted_path=view.persisted_path,
        replicated_step=view.replicated_step,
    )


# ---------------------------------------------------------------- node check

MAX_CHECK_ERROR = 2_000


def check_result_from_wire(report: nodecheck_pb2.NodeCheckReport) -> Result:
    which = report.WhichOneof("result")
    if which == "ready":
        return Ready()
    if which == "compute":
        if not report.compute.best_ms >= 0:
            raise InvalidArgument(f"compute.best_ms must be >= 0, got {report.compute.best_ms}")
        return ComputeDone(report.compute.best_ms, report.compute.device[:100])
    if which == "pair":
        pair = report.pair
        if not pair.allreduce_ms >= 0:
            raise InvalidArgument(f"pair.allreduce_ms must be >= 0, got {pair.allreduce_ms}")
        return PairDone(pair.pair, pair.ok, pair.allreduce_ms, pair.error[:MAX_CHECK_ERROR])
    if which == "failed":
        return CheckFailed(report.failed[:MAX_CHECK_ERROR] or "the check failed")
    return None  # a poll


def pair_order_to_wire(order: PairOrder, check_id: str) -> nodecheck_pb2.PairOrder:
    return nodecheck_pb2.PairOrder(
        pair=order.pair,
        rank=order.rank,
        peer=order.peer,
        store_host=order.store_host,
        store_port=order.store_port,
        iterations=order.iterations,
        numel=order.numel,
        timeout_ms=order.timeout_ms,
        backend=order.backend,
        check_id=check_id,
    )


def verdict_to_wire(verdict: Verdict) -> nodecheck_pb2.NodeCheckVerdict:
    return nodecheck_pb2.NodeCheckVerdict(
        node_id=verdict.node_id,
        faulty=verdict.faulty,
        rule=verdict.rule.value,
        reason=verdict.reason,
        slow_factor=verdict.slow_factor,
        compute_ms=verdict.compute_ms,
        compute_reference_ms=verdict.compute_reference_ms,
        pairs=[
            nodecheck_pb2.PairMeasurement(
                peer=p.peer,
                outcome=p.outcome.value,
                allreduce_ms=p.allreduce_ms,
                error=p.error,
                helper=p.helper,
            )
            for p in verdict.pairs
        ],
        pair_reference_ms=verdict.pair_reference_ms,
        took_ms=verdict.took_ms,
        at_ms=verdict.at_ms,
        measure_ms=verdict.measure_ms,
    )


def check_order_to_wire(seq: int, order: Order, check_id: str) -> nodecheck_pb2.NodeCheckOrder:
    answer = nodecheck_pb2.NodeCheckOrder(order=seq, check_id=check_id)
    if isinstance(order, ComputeOrder):
        answer.compute.CopyFrom(nodecheck_pb2.ComputeOrder(size=order.size, repeats=order.repeats))
    elif isinstance(order, PairOrder):
        answer.pair.CopyFrom(pair_order_to_wire(order, check_id))
    elif isinstance(order, Verdict):
        answer.verdict.CopyFrom(verdict_to_wire(order))
    else:
        answer.wait.SetInParent()
    return answer
