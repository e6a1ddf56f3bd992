"""The master's answers as the domain's types: the one place a oneof of the
wire is decoded on the way in, so that callers branch on a type, never on a
protobuf field name.

Each answer is a small frozen value built once per message (slots, no dict):
a lease's answer is on the hot path. Messages without a oneof (a `Shard`, a
`PairOrder`, a verdict) are carried as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlfleet.api.v1 import nodecheck_pb2, rendezvous_pb2, shards_pb2

# ------------------------------------------------------------------ leases


@dataclass(frozen=True, slots=True)
class Leased:
    """A shard to train, and with `LeaseRequest.count` > 1 the shards of the
    positions after it (possibly none)."""

    shard: shards_pb2.Shard
    more: Sequence[shards_pb2.Shard]


@dataclass(frozen=True, slots=True)
class EndOfEpoch:
    epoch: int


@dataclass(frozen=True, slots=True)
class EndOfDataset:
    """Every epoch of the dataset is done: nothing more to lease."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to lease yet: ask again, at the same position, after this."""

    retry_after_ms: int


LeaseAnswer = Leased | EndOfEpoch | EndOfDataset | Wait


class UnexpectedAnswer(RuntimeError):
    """The master answered with a kind this client does not know (a newer
    master, or a broken one)."""


def lease_answer(response: shards_pb2.LeaseResponse, kind: str | None) -> LeaseAnswer:
    """A lease's answer, of the `kind` its outcome is (a stream's error
    outcome is raised before this)."""
    if kind == "shard":
        return Leased(response.shard, response.more)
    if kind == "wait":
        return Wait(response.wait.retry_after_ms)
    if kind == "end_of_epoch":
        return EndOfEpoch(response.end_of_epoch.epoch)
    if kind == "end_of_dataset":
        return EndOfDataset()
    raise UnexpectedAnswer(f"unexpected lease answer {kind!r}")


# ----------------------------------------------------------------- session


@dataclass(frozen=True, slots=True)
class ReRendezvous:
    """A push: round `closed_round` closed, for `reason` (`gone_ranks` died
    in it). With a `join_id` the master joined this node into the next round
    itself, and `answer` is that round when it formed at once (the session's
    next join takes it)."""

    closed_round: int
    reason: str
    join_id: int
    answer: rendezvous_pb2.JoinResponse | None
    gone_ranks: tuple[int, ...] = ()  # the closed round's ranks that died with their node


def pushed(push: rendezvous_pb2.ReRendezvous) -> ReRendezvous:
    """The session event's push, as a value."""
    answer = push.answer if push.HasField("answer") else None
    return ReRendezvous(
        push.closed_round, push.reason, push.join_id, answer, tuple(push.gone_ranks)
    )


# -------------------------------------------------------------- node check


@dataclass(frozen=True, slots=True)
class CheckPoll:
    """Nothing yet: report again (a poll)."""

    order: int
    check_id: str


@dataclass(frozen=True, slots=True)
class CheckCompute:
    """Measure a `size` x `size` matmul, `repeats` times."""

    order: int
    check_id: str
    size: int
    repeats: int


@dataclass(frozen=True, slots=True)
class CheckPair:
    """Run this side of a pair's all-reduce."""

    order: int
    check_id: str
    pair: nodecheck_pb2.PairOrder


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    """The end of the node's check."""

    order: int
    check_id: str
    verdict: nodecheck_pb2.NodeCheckVerdict


CheckOrder = CheckPoll | CheckCompute | CheckPair | CheckVerdict


def check_order(order: nodecheck_pb2.NodeCheckOrder) -> CheckOrder:
    """A node check's next order; a kind this client does not know is a
    poll (report again), as the check process has always treated it."""
    what = order.WhichOneof("what")
    if what == "verdict":
        return CheckVerdict(order.order, order.check_id, order.verdict)
    if what == "compute":
        return CheckCompute(order.order, order.check_id, order.compute.size, order.compute.repeats)
    if what == "pair":
        return CheckPair(order.order, order.check_id, order.pair)
    return CheckPoll(order.order, order.check_id)
