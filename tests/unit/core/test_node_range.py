"""A node's --nnodes against the master's node range: the master's decides; a
range that differs is a warning naming both, one that cannot overlap it is
refused with the flag that would fix it, and no range is no news."""

from __future__ import annotations

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.node_range import NodeRange, judge_range, requested_range
from dlfleet.master.core.rendezvous import RendezvousSettings

TWO = RendezvousSettings(min_nodes=2, max_nodes=2)


def test_a_node_that_gave_no_range_or_the_masters_own_is_told_nothing() -> None:
    assert requested_range(0, 0) is None
    assert judge_range(None, TWO) == ""
    assert judge_range(NodeRange(2, 2), TWO) == ""


def test_a_range_that_differs_but_overlaps_is_a_warning_naming_both_and_which_decides() -> None:
    warning = judge_range(NodeRange(1, 3), TWO)
    assert warning.startswith("--nnodes 1:3 is not the master's node range")
    assert "--min-nodes 2 --max-nodes 2 decide the world size (rounds of 2 nodes)" in warning
    assert "this node's --nnodes is ignored" in warning
    elastic = RendezvousSettings(min_nodes=2, max_nodes=4)
    assert "(rounds of 2 to 4 nodes)" in judge_range(NodeRange(3, 3), elastic)


def test_a_min_above_the_masters_max_is_refused_naming_the_fix() -> None:
    with pytest.raises(InvalidArgument) as refused:
        judge_range(NodeRange(3, 3), TWO)
    message = str(refused.value)
    assert message.startswith("--nnodes 3 cannot be met")
    assert "a round of 3 or more nodes never forms there" in message
    assert "start the node with --nnodes 2 (or the master with --max-nodes 3)" in message


def test_a_max_below_the_masters_min_is_refused_naming_the_fix() -> None:
    with pytest.raises(InvalidArgument, match=r"--nnodes 1 cannot be met.*at least 2 nodes"):
        judge_range(NodeRange(1, 1), TWO)


@pytest.mark.parametrize(("low", "high"), [(0, 2), (3, 2), (-1, -1), (2, 0)])
def test_a_registration_whose_range_is_no_range_is_refused(low: int, high: int) -> None:
    with pytest.raises(InvalidArgument, match="1 <= MIN <= MAX"):
        requested_range(low, high)
