"""The client turns the master's oneofs into types once (`answers`): every
kind of answer comes out as its own type with the fields callers read."""

from __future__ import annotations

import pytest

from dlfleet.api.client import (
    CheckCompute,
    CheckPair,
    CheckPoll,
    CheckVerdict,
    EndOfDataset,
    EndOfEpoch,
    Leased,
    ReRendezvous,
    UnexpectedAnswer,
    Wait,
)
from dlfleet.api.client.answers import check_order, lease_answer, pushed
from dlfleet.api.v1 import nodecheck_pb2, rendezvous_pb2, shards_pb2


def _answer(response: shards_pb2.LeaseResponse) -> object:
    return lease_answer(response, response.WhichOneof("outcome"))


def test_each_lease_outcome_is_its_own_type() -> None:
    shard = shards_pb2.Shard(lease_id=3, epoch=1, start=0, end=16)
    more = [shards_pb2.Shard(lease_id=4, start=16, end=32)]
    leased = _answer(shards_pb2.LeaseResponse(shard=shard, more=more))
    assert isinstance(leased, Leased)
    assert leased.shard.lease_id == 3 and [s.lease_id for s in leased.more] == [4]
    wait = shards_pb2.LeaseResponse(wait=shards_pb2.Wait(retry_after_ms=250))
    assert _answer(wait) == Wait(250)
    end = shards_pb2.LeaseResponse(end_of_epoch=shards_pb2.EndOfEpoch(epoch=2))
    assert _answer(end) == EndOfEpoch(2)
    last = shards_pb2.LeaseResponse(end_of_dataset=shards_pb2.EndOfDataset())
    assert _answer(last) == EndOfDataset()


def test_a_lease_answer_of_no_known_kind_is_refused() -> None:
    with pytest.raises(UnexpectedAnswer, match="unexpected lease answer None"):
        _answer(shards_pb2.LeaseResponse())


def test_a_push_carries_its_round_reason_and_the_masters_join() -> None:
    answer = rendezvous_pb2.JoinResponse(round=3)
    push = rendezvous_pb2.ReRendezvous(closed_round=2, reason="b left", join_id=-1, answer=answer)
    assert pushed(push) == ReRendezvous(2, "b left", -1, answer)
    assert pushed(rendezvous_pb2.ReRendezvous(closed_round=1)) == ReRendezvous(1, "", 0, None)


def test_each_node_check_order_is_its_own_type() -> None:
    NodeCheckOrder = nodecheck_pb2.NodeCheckOrder
    compute = nodecheck_pb2.ComputeOrder(size=64, repeats=3)
    assert check_order(NodeCheckOrder(order=5, check_id="c", compute=compute)) == CheckCompute(
        5, "c", 64, 3
    )
    pair = nodecheck_pb2.PairOrder(pair=7, peer="b")
    assert check_order(NodeCheckOrder(order=5, check_id="c", pair=pair)) == CheckPair(5, "c", pair)
    verdict = nodecheck_pb2.NodeCheckVerdict(faulty=True, rule="hung")
    assert check_order(NodeCheckOrder(order=6, verdict=verdict)) == CheckVerdict(6, "", verdict)
    poll = NodeCheckOrder(order=5, check_id="c", wait=nodecheck_pb2.NodeCheckPoll())
    assert check_order(poll) == CheckPoll(5, "c")
